"""MKL's packed sgemm (CPU, fp32): weights copied once into MKL's GEMM layout.

On the CPU, ``F.linear`` hands MKL the weight as a plain matrix, and MKL copies it into its
blocked GEMM layout on every call. With a few hundred rows per step that copy is a large share
of the work: profiling the shared-prefix benchmark put MKL's ``scopy`` packing routines at about
a sixth of all GEMM time. :func:`pack` does the copy once, at load time (``cblas_sgemm_pack``);
:func:`compute` runs ``cblas_sgemm_compute`` on the packed matrix, which serves any number of
rows (``beta = 1`` adds into the output: a fused residual add). The layers using this are
:class:`batchgen.model.layers.linear.PackedLinear`.

MKL is the copy statically linked into ``libtorch_cpu`` (x86-64 builds of torch export its
``cblas_sgemm_pack*`` functions); it runs on torch's intra-op threads. Where those functions are
missing (other platforms), on GPUs and in other dtypes :func:`for_dtype` returns None and layers
keep ``F.linear`` (as with ``BATCHGEN_PACK_WEIGHTS=0``, which :mod:`batchgen.engine.backends`
reads). Packing is checked once against
``F.linear`` before it is used; results differ from it only by float rounding.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from batchgen.model.once import Once

__all__ = ["Mkl", "PackedWeight", "compute", "for_dtype", "load", "pack"]

log = logging.getLogger(__name__)

# CBLAS enum values (mkl_cblas.h)
_ROW_MAJOR, _NO_TRANS, _TRANS, _PACKED, _B_MATRIX = 101, 111, 112, 151, 162
# The row count MKL is told at packing time; a packed matrix serves any row count.
_ROWS_HINT = 256


class Mkl:
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


def _find() -> Mkl | None:
    """The MKL inside torch, or None where it is missing."""
    libs = sorted((Path(torch.__file__).parent / "lib").glob("libtorch_cpu.*"))
    try:
        mkl = Mkl(ctypes.CDLL(str(libs[0])))
    except (IndexError, OSError, AttributeError):
        return None  # no such library, or a torch built without MKL
    return mkl if _self_check(mkl) else None


def _self_check(mkl: Mkl) -> bool:
    """Pack a random matrix and compare one product with ``F.linear``."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 80, generator=gen)
    h = torch.randn(70, 80, generator=gen)
    got = compute(mkl, h, pack(mkl, weight), torch.empty(70, 96), beta=0.0)
    ok = torch.allclose(got, F.linear(h, weight), rtol=1e-4, atol=1e-4)
    if not ok:
        log.warning("MKL packed GEMM disagrees with F.linear here; weights are not pre-packed")
    return ok


# the process's MKL bindings: looked up and checked by the first caller
_MKL: Once[Mkl | None] = Once(_find)


def load() -> Mkl | None:
    """MKL's packed GEMM, or None where it is missing (looked up once; concurrent first callers
    wait for the lookup)."""
    return _MKL.get()


def for_dtype(device: torch.device, dtype: torch.dtype) -> Mkl | None:
    """MKL for weights on ``device`` in ``dtype``: CPU fp32 only; None means ``F.linear``."""
    if device.type == "cpu" and dtype == torch.float32:
        return load()
    return None


@dataclass(frozen=True)
class PackedWeight:
    """A ``[out_features, in_features]`` weight in MKL's packed layout (opaque bytes)."""

    buffer: Tensor  # uint8, MKL's layout; only MKL reads it
    out_features: int
    in_features: int


def pack(mkl: Mkl, weight: Tensor) -> PackedWeight:
    """weight ``[out, in]`` fp32 (any strides) -> its packed copy for :func:`compute`."""
    n, k = weight.shape
    weight = weight.detach().contiguous()
    # the size MKL asks for includes slack it never writes (untouched pages stay unmapped)
    buffer = torch.empty(mkl.get_size(_B_MATRIX, _ROWS_HINT, n, k), dtype=torch.uint8)
    mkl.pack(
        _ROW_MAJOR, _B_MATRIX, _TRANS, _ROWS_HINT, n, k, 1.0, weight.data_ptr(), k,
        buffer.data_ptr(),
    )  # fmt: skip
    return PackedWeight(buffer, n, k)


def compute(mkl: Mkl, h: Tensor, w: PackedWeight, out: Tensor, beta: float) -> Tensor:
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
