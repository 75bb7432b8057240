"""Linear layers whose weights are pre-packed for MKL's sgemm (CPU, fp32).

On the CPU, ``F.linear`` hands MKL the weight as a plain matrix, and MKL copies it into its
blocked GEMM layout on every call. With a few hundred rows per step that copy is a large share
of the work: profiling the shared-prefix benchmark put MKL's ``scopy`` packing routines at about
a sixth of all GEMM time. :func:`pack_` does the copy once, at load time (``cblas_sgemm_pack``),
keeps the packed matrix as ``proj.packed`` and drops ``proj.weight``; :func:`linear` and
:func:`linear_add_` then call ``cblas_sgemm_compute`` on it. A packed matrix serves any number of
rows; the residual add of ``linear_add_`` is the GEMM's ``beta = 1``.

MKL is the copy statically linked into ``libtorch_cpu`` (x86-64 builds of torch export its
``cblas_sgemm_pack*`` functions); it runs on torch's intra-op threads. Where those functions are
missing (other platforms), on GPUs, in other dtypes, or with ``BATCHGEN_PACK_WEIGHTS=0``,
modules keep their weight and these functions run ``F.linear`` / ``addmm_``. Packing is checked
once against ``F.linear`` before it is used; results differ from it only by float rounding.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["PackedWeight", "linear", "linear_add_", "pack_", "packing_available"]

log = logging.getLogger(__name__)

# CBLAS enum values (mkl_cblas.h)
_ROW_MAJOR, _NO_TRANS, _TRANS, _PACKED, _B_MATRIX = 101, 111, 112, 151, 162
# The row count MKL is told at packing time; a packed matrix serves any row count.
_ROWS_HINT = 256

_lock = threading.Lock()
_mkl: _Mkl | None = None
_tried = False


class _Mkl:
    """ctypes bindings of MKL's packed-GEMM functions (MKL_INT is 32-bit: the LP64 interface)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        i, f, p = ctypes.c_int, ctypes.c_float, ctypes.c_void_p
        self.get_size = lib.cblas_sgemm_pack_get_size
        self.get_size.restype = ctypes.c_size_t
        self.get_size.argtypes = [i, i, i, i]
        self.pack = lib.cblas_sgemm_pack
        self.pack.restype = None
        self.pack.argtypes = [i, i, i, i, i, i, f, p, i, p]
        self.compute = lib.cblas_sgemm_compute
        self.compute.restype = None
        self.compute.argtypes = [i, i, i, i, i, i, p, i, p, i, f, p, i]


def _load() -> _Mkl | None:
    """The MKL inside torch, or None where it is missing or packing is switched off."""
    global _mkl, _tried
    if _tried:  # every GEMM asks: no lock once settled
        return _mkl
    with _lock:
        if not _tried:
            _mkl = _find()
            _tried = True  # after _mkl: the unlocked read above never sees a half-done load
        return _mkl


def _find() -> _Mkl | None:
    if os.environ.get("BATCHGEN_PACK_WEIGHTS", "1") == "0":
        return None
    libs = sorted((Path(torch.__file__).parent / "lib").glob("libtorch_cpu.*"))
    try:
        mkl = _Mkl(ctypes.CDLL(str(libs[0])))
    except (IndexError, OSError, AttributeError):
        return None  # no such library, or a torch built without MKL
    return mkl if _self_check(mkl) else None


def _self_check(mkl: _Mkl) -> bool:
    """Pack a random matrix and compare one product with ``F.linear``."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 80, generator=gen)
    h = torch.randn(70, 80, generator=gen)
    got = _compute(mkl, h, _pack(mkl, weight), torch.empty(70, 96), beta=0.0)
    ok = torch.allclose(got, F.linear(h, weight), rtol=1e-4, atol=1e-4)
    if not ok:
        log.warning("MKL packed GEMM disagrees with F.linear here; weights are not pre-packed")
    return ok


@dataclass(frozen=True)
class PackedWeight:
    """A ``[out_features, in_features]`` weight in MKL's packed layout (opaque bytes)."""

    buffer: Tensor  # uint8, MKL's layout; only MKL reads it
    out_features: int
    in_features: int


def _pack(mkl: _Mkl, weight: Tensor) -> PackedWeight:
    n, k = weight.shape
    weight = weight.detach().contiguous()
    # the size MKL asks for includes slack it never writes (untouched pages stay unmapped)
    buffer = torch.empty(mkl.get_size(_B_MATRIX, _ROWS_HINT, n, k), dtype=torch.uint8)
    mkl.pack(
        _ROW_MAJOR, _B_MATRIX, _TRANS, _ROWS_HINT, n, k, 1.0, weight.data_ptr(), k,
        buffer.data_ptr(),
    )  # fmt: skip
    return PackedWeight(buffer, n, k)


def _compute(mkl: _Mkl, h: Tensor, w: PackedWeight, out: Tensor, beta: float) -> Tensor:
    """out ``[M, N]`` <- h ``[M, K]`` @ W^T + beta * out. Rows of h and out may be strided
    (a column slice), their elements must be contiguous."""
    m = h.shape[0]
    if m:
        mkl.compute(
            _ROW_MAJOR, _NO_TRANS, _PACKED, m, w.out_features, w.in_features,
            h.data_ptr(), h.stride(0), w.buffer.data_ptr(), w.out_features, beta,
            out.data_ptr(), out.stride(0),
        )  # fmt: skip
    return out


def packing_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether weights on ``device`` in ``dtype`` get pre-packed here."""
    return device.type == "cpu" and dtype == torch.float32 and _load() is not None


def pack_(model: nn.Module) -> int:
    """Pack the weight of every ``nn.Linear`` in ``model`` that can be, as ``module.packed``,
    and drop its ``weight`` (the model takes no more memory than before). Returns how many."""
    count = 0
    for module in model.modules():
        if not isinstance(module, nn.Linear) or module.weight is None:
            continue
        mkl = _load()
        if mkl is not None and packing_available(module.weight.device, module.weight.dtype):
            module.packed = _pack(mkl, module.weight)
            module.weight = None
            count += 1
    return count


def _usable(h: Tensor) -> Tensor:
    """h with unit stride along its rows (MKL takes any row stride)."""
    return h if h.stride(1) == 1 and h.stride(0) >= h.shape[1] else h.contiguous()


def linear(h: Tensor, proj: nn.Linear) -> Tensor:
    """``proj(h)``: h ``[T, in]`` -> ``[T, out]``."""
    packed: PackedWeight | None = getattr(proj, "packed", None)
    if packed is None:
        return F.linear(h, proj.weight, proj.bias)
    mkl = _load()
    assert mkl is not None
    out = _compute(mkl, _usable(h), packed, h.new_empty(h.shape[0], packed.out_features), 0.0)
    return out if proj.bias is None else out.add_(proj.bias)


def linear_add_(x: Tensor, h: Tensor, proj: nn.Linear) -> Tensor:
    """``x += proj(h)`` in place, returns x; x ``[T, out]``, h ``[T, in]``. Without a bias the
    add happens inside the GEMM (beta = 1): no ``[T, out]`` temporary, no second pass over x."""
    packed: PackedWeight | None = getattr(proj, "packed", None)
    if packed is not None and x.stride(1) == 1 and x.stride(0) >= x.shape[1]:
        mkl = _load()
        assert mkl is not None
        _compute(mkl, _usable(h), packed, x, 1.0)
        return x if proj.bias is None else x.add_(proj.bias)
    if packed is not None:
        return x.add_(linear(h, proj))
    if proj.bias is None:
        return x.addmm_(h, proj.weight.t())
    return x.add_(F.linear(h, proj.weight, proj.bias))
