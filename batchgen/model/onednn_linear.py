"""oneDNN's pre-packed GEMM (CPU, bf16 and fp32): weights reordered once into oneDNN's blocked
layout.

``F.linear`` in bf16 on the CPU also runs oneDNN, but hands it the weight as a plain matrix,
which oneDNN reorders into its blocked (AMX tile / VNNI pair) layout on every call.
:meth:`OneDnn.pack` does the reorder once, at load time (``torch.ops.mkldnn.
_reorder_linear_weight``, which torch's compiler uses for frozen CPU models);
:meth:`OneDnn.linear` runs oneDNN's inner product on the packed weight for any number of rows,
and :meth:`OneDnn.linear_add` fuses a residual add (a binary-add post-op: ``other + h @ W^T +
bias`` rounded to bf16 once, from the fp32 accumulator). The layers using this are
:class:`batchgen.model.layers.linear.OneDnnLinear`.

Used only where torch has these ops (for bf16: where oneDNN supports bf16 on this CPU) and a
one-time check against ``F.linear`` passes; elsewhere, on GPUs and in other dtypes
:func:`for_dtype` returns None and layers keep ``F.linear`` (or, in fp32, MKL's packed GEMM of
:mod:`batchgen.model.packed_linear`; as with ``BATCHGEN_PACK_WEIGHTS=0``, which
:mod:`batchgen.engine.backends` reads).

fp32 runs here where the C kernels' fp32 GEMM (:mod:`batchgen.model.kernel_linear`) does not,
rather than on MKL's packed sgemm: oneDNN uses the CPU's widest vectors, MKL's sgemm took its
AVX2 code on an AMD EPYC with AVX-512 (Zen 5, 2 threads, the benchmark model's layers at
128-2048 rows: oneDNN 430-487 GFLOP/s, MKL 184-207), and with both capped at AVX2 oneDNN was
still 1.2x faster (230-244 against 189-206).

Rounding: every bf16 output is rounded to bf16 once from an fp32 accumulator, like
``F.linear``; the order of the fp32 sums depends on the kernel oneDNN picks for the number of
rows M, so one row's result can differ in its last bit with M (``F.linear`` too; unlike MKL's
fp32 packed GEMM). Measured on AMX: rows of calls of up to 32 rows equal those rows computed alone;
above, about 1e-4 of the outputs are one bf16 place apart, varying with M
(tests/test_packed_linear.py, scripts/bench_gemm.py --invariance).

oneDNN builds (JIT-compiles) a kernel per distinct M on its first use and caches it (its
primitive cache, 1024 entries by default): the first call at a new M costs about 1 ms (small M)
to 10 ms (M ~ 300) per layer shape, as for ``F.linear`` in bf16. Engine steps hold any number of
tokens up to ``max_num_batched_tokens``, so a job would keep building kernels (and evict them
from the cache). :func:`padded_rows` therefore rounds M up to one of a few sizes (M itself up to
32, then 8 sizes per doubling, at most 12.5% more rows), and the calls run on zero-padded inputs:
about 100 distinct kernels per layer shape up to M = 8192.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from batchgen.model.once import Once

__all__ = ["OneDnn", "for_dtype", "load", "padded_rows"]

log = logging.getLogger(__name__)

# The row count oneDNN is told when the weight is reordered. None lets oneDNN pick; the layout
# serves any row count, and no hint measured faster (scripts/bench_gemm.py --hints).
_ROWS_HINT: int | None = None
# Row counts up to this run as they are; above, 2**_STEPS_PER_DOUBLING_LOG2 sizes per doubling.
_EXACT_ROWS = 32
_STEPS_PER_DOUBLING_LOG2 = 3


def padded_rows(m: int) -> int:
    """The row count a call with ``m`` rows runs at: ``m`` up to 32, else ``m`` rounded up to a
    multiple of 2**(floor(log2(m - 1)) - 3) (8 sizes per doubling, at most 12.5% padding)."""
    if m <= _EXACT_ROWS:
        return m
    step = 1 << ((m - 1).bit_length() - 1 - _STEPS_PER_DOUBLING_LOG2)
    return -(-m // step) * step


def _pad(x: Tensor, rows: int) -> Tensor:
    """x ``[m, k]`` -> ``[rows, k]`` (rows >= m): x on top of zero rows; x itself when equal."""
    m = x.shape[0]
    if rows == m:
        return x
    out = x.new_empty(rows, x.shape[1])
    out[:m].copy_(x)
    out[m:].zero_()
    return out


class OneDnn:
    """The torch ops that run oneDNN's inner product on a packed bf16 or fp32 weight."""

    def __init__(self, ops: Any) -> None:
        self._reorder = ops._reorder_linear_weight
        self._linear = ops._linear_pointwise.default
        self._linear_add = ops._linear_pointwise.binary

    def pack(self, weight: Tensor) -> Tensor:
        """weight ``[out, in]`` bf16 or fp32 (any strides) -> a copy in oneDNN's blocked layout
        (an opaque ``torch._mkldnn`` tensor of the same shape and byte size)."""
        return self._reorder(weight.detach().contiguous(), _ROWS_HINT)

    def linear(self, h: Tensor, packed: Tensor, bias: Tensor | None) -> Tensor:
        """h ``[M, in]`` (rows may be a column slice) -> ``h @ W^T + bias`` ``[M, out]``, run at
        :func:`padded_rows` (M) rows."""
        m = h.shape[0]
        rows = padded_rows(m)
        out = self._linear(_pad(h, rows), packed, bias, "none", [], "")
        return out if rows == m else out[:m]

    def linear_add(self, h: Tensor, other: Tensor, packed: Tensor, bias: Tensor | None) -> Tensor:
        """A new ``[M, out]`` tensor: ``other + h @ W^T + bias`` (other ``[M, out]``
        contiguous), rounded once, run at :func:`padded_rows` (M) rows."""
        m = h.shape[0]
        rows = padded_rows(m)
        out = self._linear_add(_pad(h, rows), _pad(other, rows), packed, bias, "add")
        return out if rows == m else out[:m]


def _find(dtype: torch.dtype) -> OneDnn | None:
    """torch's oneDNN linear ops for ``dtype``, or None where they are missing, cannot run bf16
    here (for bf16), or disagree with ``F.linear``."""
    ops = torch.ops.mkldnn
    try:
        if not torch.backends.mkldnn.is_available():
            return None
        if dtype == torch.bfloat16 and not ops._is_mkldnn_bf16_supported():
            return None
        onednn = OneDnn(ops)
    except (AttributeError, RuntimeError):
        return None  # a torch without these ops
    return onednn if _self_check(onednn, dtype) else None


def _self_check(onednn: OneDnn, dtype: torch.dtype) -> bool:
    """Pack a random matrix and compare products (plain, with bias, with the residual add) with
    ``F.linear`` at a few row counts, in ``dtype``."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 80, generator=gen).to(dtype)
    bias = torch.randn(96, generator=gen).to(dtype)
    tol = {"rtol": 1e-2, "atol": 1e-1} if dtype == torch.bfloat16 else {"rtol": 1e-4, "atol": 1e-4}
    try:
        packed = onednn.pack(weight)
        for rows in (1, 5, 70):
            h = torch.randn(rows, 80, generator=gen).to(dtype)
            x = torch.randn(rows, 96, generator=gen).to(dtype)
            expected = F.linear(h.float(), weight.float(), bias.float())
            got = onednn.linear(h, packed, bias).float()
            added = onednn.linear_add(h, x, packed, bias).float()
            if not (
                torch.allclose(got, expected, **tol)
                and torch.allclose(added, expected + x.float(), **tol)
            ):
                log.warning("oneDNN packed GEMM disagrees with F.linear; weights are not packed")
                return False
    except RuntimeError as err:
        log.warning("oneDNN packed GEMM failed its check (%s); weights are not packed", err)
        return False
    return True


# the process's oneDNN ops per dtype: looked up and checked by the first caller
_ONEDNN: dict[torch.dtype, Once[OneDnn | None]] = {
    dt: Once(lambda dt=dt: _find(dt)) for dt in (torch.bfloat16, torch.float32)
}


def load(dtype: torch.dtype = torch.bfloat16) -> OneDnn | None:
    """oneDNN's packed GEMM in ``dtype`` (bf16 or fp32), or None where it is unavailable (looked
    up once per dtype; concurrent first callers wait for the lookup)."""
    return _ONEDNN[dtype].get()


def for_dtype(device: torch.device, dtype: torch.dtype) -> OneDnn | None:
    """oneDNN for weights on ``device`` in ``dtype``: CPU bf16 and fp32; None means ``F.linear``
    (fp32: MKL's packed GEMM where it is there)."""
    if device.type == "cpu" and dtype in _ONEDNN:
        return load(dtype)
    return None
