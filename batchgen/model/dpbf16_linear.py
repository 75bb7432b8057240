"""The bf16 GEMM of CPUs with AVX512-BF16 and no AMX (AMD Zen 4 and later, Intel Cooper Lake):
batchgen's own kernel (``gemm_bf16_dpbf16`` in batchgen/model/cpu_kernels_gemm.c) on weights
packed once at load time for its ``vdpbf16ps`` dot products.

Why not oneDNN there: at the row counts of decode steps, on weights that come from memory,
oneDNN's bf16 inner product ran at about half the CPU's bf16 peak; this kernel prefetches the
next panel of weights while it computes the current one, so the weights stream at the pace of
the arithmetic (near the peak from 32 rows on).
SmolLM2-135M's projections, 24 layers with distinct weights (read from memory each pass), AMD EPYC
Zen 5, 2 threads, ``scripts/bench_gemm.py --models smollm2,qwen --stream 24``: at 32 rows 7.0 ms
against oneDNN's 11.2 (1.59x), at 8 rows 1.43x, at 512 rows 1.09x; in cache, at 1,024-6,912
rows, within a few percent of oneDNN either way. On CPUs with AMX oneDNN runs its AMX kernels
and is kept (this kernel was not measured there).

Rounding: every output is the fp32 sum of exact bf16 products over the inputs in ascending
pairs, plus the bias and the residual, rounded to bf16 once (to nearest even). The order is the
same for every row whatever the number of rows in the call: a row's result does not depend on
the rows computed beside it (oneDNN's does, in its last bit, above 32 rows).

Packed layout: W ``[N, K]`` -> ``[ceil(N/16), ceil(K/2), 16, 2]`` (zero-padded), element
``[b, j, c, t] = W[16 b + c, 2 j + t]``: per block of 16 outputs, one 64-byte vector per pair
of inputs. It takes the bytes of W (plus padding); the plain weight is not kept.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import Tensor

from batchgen.model.cpu_features import bf16_support
from batchgen.model.cpu_kernels import CpuKernels

__all__ = ["Dpbf16", "for_dtype", "pack"]

log = logging.getLogger(__name__)


def pack(weight: Tensor) -> Tensor:
    """weight ``[N, K]`` bf16 -> a new ``[ceil(N/16), ceil(K/2), 16, 2]`` contiguous bf16
    tensor in the kernel's layout (the module docstring's)."""
    n, k = weight.shape
    n16, k2 = -(-n // 16), -(-k // 2)
    padded = F.pad(weight.detach(), (0, 2 * k2 - k, 0, 16 * n16 - n))
    return padded.view(n16, 16, k2, 2).transpose(1, 2).contiguous()


class Dpbf16:
    """The GEMM on packed weights, through the C kernels ``kernels``."""

    def __init__(self, kernels: CpuKernels) -> None:
        self.kernels = kernels

    def pack(self, weight: Tensor) -> Tensor:
        return pack(weight)

    def linear(self, h: Tensor, packed: Tensor, n: int, bias: Tensor | None) -> Tensor:
        """h ``[M, K]`` (unit column stride) -> a new ``[M, n]``: ``h @ W^T + bias``."""
        out = h.new_empty(h.shape[0], n)
        return self.kernels.gemm_bf16(h, packed, n, bias, None, out)

    def linear_add_(self, x: Tensor, h: Tensor, packed: Tensor, bias: Tensor | None) -> Tensor:
        """``x = x + h @ W^T + bias`` in place, rounded once; x ``[M, n]`` with unit column
        stride."""
        return self.kernels.gemm_bf16(h, packed, x.shape[1], bias, x, x)


def _self_check(gemm: Dpbf16) -> bool:
    """Pack a random matrix (odd sizes: padded blocks and pairs) and compare products (plain,
    with bias, with the residual add) with ``F.linear`` at a few row counts."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(83, 37, generator=gen).bfloat16()
    bias = torch.randn(83, generator=gen).bfloat16()
    packed = gemm.pack(weight)
    for rows in (1, 5, 70):
        h = torch.randn(rows, 37, generator=gen).bfloat16()
        x = torch.randn(rows, 83, generator=gen).bfloat16()
        expected = F.linear(h.float(), weight.float(), bias.float())
        got = gemm.linear(h, packed, 83, bias).float()
        added = gemm.linear_add_(x.clone(), h, packed, bias).float()
        if not (
            torch.allclose(got, expected, rtol=1e-2, atol=1e-1)
            and torch.allclose(added, expected + x.float(), rtol=1e-2, atol=1e-1)
        ):
            log.warning("the AVX512-BF16 GEMM disagrees with F.linear; oneDNN runs the GEMMs")
            return False
    return True


# the kernels' library path -> its GEMM, or None where the check failed (one per library)
_CHECKED: dict[str, Dpbf16 | None] = {}


def for_dtype(
    device: torch.device, dtype: torch.dtype, kernels: CpuKernels | None
) -> Dpbf16 | None:
    """The GEMM for weights on ``device`` in ``dtype``: CPU bf16, C kernels built with
    AVX512-BF16, a CPU without AMX, and a passed check; else None (oneDNN or ``F.linear``)."""
    if not (
        device.type == "cpu"
        and dtype == torch.bfloat16
        and kernels is not None
        and kernels.gemm_dpbf16
        and "AMX-BF16" not in bf16_support().features
    ):
        return None
    key = str(kernels.path)
    if key not in _CHECKED:
        gemm = Dpbf16(kernels)
        _CHECKED[key] = gemm if _self_check(gemm) else None
    return _CHECKED[key]
