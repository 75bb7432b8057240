"""Which implementation the model's layers run, decided once when the model is built."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchgen.model import cpu_kernels, kernel_linear, onednn_linear, packed_linear
from batchgen.model.cpu_kernels import CpuKernels
from batchgen.model.layers.linear import Gemm

__all__ = ["LayerBackend"]


@dataclass(frozen=True)
class LayerBackend:
    """The implementations available to the layers of a model whose weights live on ``device``
    in ``dtype`` (the modules themselves are built on the meta device, then loaded).

    ``cpu``: the C kernels of :mod:`batchgen.model.cpu_kernels` (RMSNorm, RoPE, SwiGLU), on CPU fp32
    and bf16 when they could be built. ``gemm``: the GEMM whose packed weights the linear layers
    hold (:func:`batchgen.model.layers.linear.pack_linears_`): the C kernels' GEMM
    (:mod:`batchgen.model.kernel_linear`) on CPU fp32 where they were built with AVX2 and FMA
    or AVX-512, and on CPU bf16 where the CPU has AVX512-BF16 but no AMX; else oneDNN's packed
    inner product (:mod:`batchgen.model.onednn_linear`; bf16 where oneDNN runs bf16 here); else,
    in fp32, MKL's packed sgemm (:mod:`batchgen.model.packed_linear`) when torch exports it.
    None: the PyTorch ops (``F.linear``).
    """

    device: torch.device
    dtype: torch.dtype
    cpu: CpuKernels | None = None
    gemm: Gemm | None = None

    @classmethod
    def select(
        cls,
        device: torch.device,
        dtype: torch.dtype,
        native: bool = True,
        *,
        pack: bool = True,
        avx512bf16: bool = True,
    ) -> LayerBackend:
        """The fastest implementations available here; ``native=False``: PyTorch ops only;
        ``pack=False``: no packed GEMM; ``avx512bf16=False``: the C kernels' portable variant.
        (An engine's choice is :func:`batchgen.engine.backends.choose_backends`'.)"""
        if not native:
            return cls(device, dtype)
        cpu = cpu_kernels.for_dtype(device, dtype, avx512bf16)
        gemm = (
            kernel_linear.for_dtype(device, dtype, cpu)
            or onednn_linear.for_dtype(device, dtype)
            or packed_linear.for_dtype(device, dtype)
        )
        return cls(device, dtype, cpu=cpu, gemm=gemm if pack else None)
