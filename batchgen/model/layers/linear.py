"""Linear layers: ``Linear`` (``F.linear``), ``PackedLinear`` (weights pre-packed for MKL's
GEMM, CPU fp32 where neither oneDNN nor the C kernels' GEMM runs), ``OneDnnLinear`` (weights
pre-packed for oneDNN's GEMM, CPU bf16 on AMX CPUs, and the fallback elsewhere) and
``KernelLinear`` (weights packed for batchgen's own GEMMs: CPU fp32 on AVX2 or AVX-512, CPU bf16
with AVX512-BF16 and no AMX). Modules
are built as ``Linear``; once their weights are loaded, :func:`pack_linears_` swaps each for
the packed layer of the backend's GEMM (:attr:`LayerBackend.gemm
<batchgen.model.layers.backend.LayerBackend.gemm>`), if it has one."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from batchgen.model import packed_linear
from batchgen.model.kernel_linear import KernelGemm
from batchgen.model.onednn_linear import OneDnn
from batchgen.model.packed_linear import Mkl, PackedWeight

__all__ = [
    "Gemm",
    "KernelLinear",
    "Linear",
    "OneDnnLinear",
    "PackedLayer",
    "PackedLinear",
    "pack_linear",
    "pack_linears_",
]

# the packed GEMMs a LayerBackend may hold
Gemm = Mkl | OneDnn | KernelGemm


class Linear(nn.Linear):
    """``nn.Linear`` plus the residual form ``add_``."""

    def add_(self, x: Tensor, h: Tensor) -> Tensor:
        """``x += self(h)`` in place, returns x; x ``[T, out]``, h ``[T, in]``."""
        if self.bias is None:
            return x.addmm_(h, self.weight.t())
        return x.add_(F.linear(h, self.weight, self.bias))


class PackedLinear(nn.Module):
    """A linear layer whose weight is held only in MKL's packed layout (no ``weight``: the model
    takes no more memory than before). Results differ from ``F.linear`` only by rounding."""

    def __init__(self, weight: Tensor, bias: nn.Parameter | None, mkl: Mkl) -> None:
        super().__init__()
        self.mkl = mkl
        self.packed: PackedWeight = packed_linear.pack(mkl, weight)  # [out, in]
        self.bias = bias  # [out] or None
        self.in_features, self.out_features = self.packed.in_features, self.packed.out_features

    def forward(self, h: Tensor) -> Tensor:
        """h ``[T, in]`` -> ``[T, out]``."""
        out = h.new_empty(h.shape[0], self.out_features)
        packed_linear.compute(self.mkl, _unit_rows(h), self.packed, out, 0.0)
        return out if self.bias is None else out.add_(self.bias)

    def add_(self, x: Tensor, h: Tensor) -> Tensor:
        """``x += self(h)`` in place, returns x. When x's rows are unit-stride the add happens
        inside the GEMM (beta = 1): no ``[T, out]`` temporary, no second pass over x."""
        if not (x.stride(1) == 1 and x.stride(0) >= x.shape[1]):
            return x.add_(self(h))
        packed_linear.compute(self.mkl, _unit_rows(h), self.packed, x, 1.0)
        return x if self.bias is None else x.add_(self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed"


class OneDnnLinear(nn.Module):
    """A bf16 linear layer whose weight is held only in oneDNN's packed layout (no ``weight``:
    the model takes no more memory than before). Results differ from ``F.linear`` only by the
    order of fp32 sums (:mod:`batchgen.model.onednn_linear`)."""

    def __init__(self, weight: Tensor, bias: nn.Parameter | None, onednn: OneDnn) -> None:
        super().__init__()
        self.onednn = onednn
        self.out_features, self.in_features = weight.shape
        self.packed: Tensor = onednn.pack(weight)  # [out, in], torch._mkldnn layout
        self.bias = bias  # [out] or None

    def forward(self, h: Tensor) -> Tensor:
        """h ``[T, in]`` -> ``[T, out]``."""
        return self.onednn.linear(h, self.packed, self.bias)

    def add_(self, x: Tensor, h: Tensor) -> Tensor:
        """``x += self(h)`` in place, returns x. When x is contiguous the add happens inside the
        GEMM (x + h W^T + bias rounded once, as ``addmm_``), into a new tensor copied into x."""
        if not x.is_contiguous():
            return x.add_(self(h))
        return x.copy_(self.onednn.linear_add(h, x, self.packed, self.bias))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, oneDNN-packed"


class KernelLinear(nn.Module):
    """A bf16 or fp32 linear layer whose weight is held only in the packed layout of the C
    kernels' GEMM (:mod:`batchgen.model.kernel_linear`; no ``weight``). Each output's sum runs in
    an order that does not depend on the rows beside it (bf16: rounded once from fp32)."""

    def __init__(self, weight: Tensor, bias: nn.Parameter | None, gemm: KernelGemm) -> None:
        super().__init__()
        self.gemm = gemm
        self.out_features, self.in_features = weight.shape
        # bf16 [ceil(out/16), ceil(in/2), 16, 2], fp32 [ceil(out/16), in, 16]
        self.packed: Tensor = gemm.pack(weight)
        self.bias = bias  # [out] or None

    def forward(self, h: Tensor) -> Tensor:
        """h ``[T, in]`` -> ``[T, out]``."""
        return self.gemm.linear(_unit_rows(h), self.packed, self.out_features, self.bias)

    def add_(self, x: Tensor, h: Tensor) -> Tensor:
        """``x += self(h)`` in place (bf16: rounded once; no temporary), returns x."""
        if x.stride(1) != 1:
            return x.add_(self(h))
        return self.gemm.linear_add_(x, _unit_rows(h), self.packed, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, kernel-packed"


# a linear layer on packed weights
PackedLayer = PackedLinear | OneDnnLinear | KernelLinear


def _unit_rows(h: Tensor) -> Tensor:
    """h with unit stride along its rows (MKL takes any row stride)."""
    return h if h.stride(1) == 1 and h.stride(0) >= h.shape[1] else h.contiguous()


def pack_linear(weight: Tensor, bias: nn.Parameter | None, gemm: Gemm) -> PackedLayer:
    """The layer computing ``F.linear(h, weight, bias)`` on ``gemm``'s packed copy of weight
    ``[out, in]`` (weight itself is not kept)."""
    if isinstance(gemm, OneDnn):
        return OneDnnLinear(weight, bias, gemm)
    if isinstance(gemm, KernelGemm):
        return KernelLinear(weight, bias, gemm)
    return PackedLinear(weight, bias, gemm)


def pack_linears_(model: nn.Module, gemm: Gemm | None) -> int:
    """Replace every ``nn.Linear`` of ``model`` (weights loaded, in the dtype ``gemm`` serves)
    by its packed layer (:func:`pack_linear`); returns how many. ``gemm`` None: nothing
    changes."""
    if gemm is None:
        return 0
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear)
    ]
    for parent, name, child in targets:
        setattr(parent, name, pack_linear(child.weight, child.bias, gemm))
    return len(targets)
