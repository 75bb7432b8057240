"""batchgen's own GEMMs for the linear layers (``gemm_bf16_dpbf16`` and ``gemm_f32`` in
batchgen/model/cpu_kernels_gemm.c), on weights packed once at load time.

- **bf16**, on CPUs with AVX512-BF16 and no AMX (AMD Zen 4 and later, Intel Cooper Lake):
  ``vdpbf16ps`` dot products. At the row counts of decode steps, on weights that come from
  memory, oneDNN's bf16 inner product ran at about half the CPU's bf16 peak; this kernel
  prefetches the next panel of weights while it computes the current one, so the weights stream
  at the pace of the arithmetic (near the peak from 32 rows on). SmolLM2-135M's projections, 24
  layers with distinct weights (read from memory each pass), AMD EPYC Zen 5, 2 threads,
  ``scripts/bench_gemm.py --models smollm2,qwen --stream 24``: at 32 rows 7.0 ms against
  oneDNN's 11.2 (1.59x), at 8 rows 1.43x, at 512 rows 1.09x; in cache, at 1,024-6,912 rows,
  within a few percent of oneDNN either way. On CPUs with AMX oneDNN runs its AMX kernels and
  is kept (this kernel was not measured there).
- **fp32**, on CPUs with AVX2 and FMA or with AVX-512: fused multiply-adds on the same loop
  (tiles of 8 rows x 48 outputs in AVX-512 registers, 6 x 16 in AVX2's; inputs in blocks of up
  to 1,024). SmolLM2-135M's projections, 24 layers with distinct weights, AMD EPYC Zen 5, 2
  threads, ``scripts/bench_gemm.py --models smollm2 --no-table --stream 24 --stream-dtype
  float32`` (oneDNN fp32 is what ran before): with both capped at AVX2 (``BATCHGEN_CPU_ISA=avx2``,
  ``ONEDNN_MAX_CPU_ISA=AVX2``) 1.15-1.85x as fast as oneDNN at 8-64 rows; natively 1.18-1.41x
  at 8-64 rows, 1.07x at 256, and at 256-4,096 rows in cache 0.93-1.02x (docs/performance.md
  has the figures).

Rounding: bf16 outputs are the fp32 sum of exact bf16 products over the inputs in ascending
pairs, plus the bias and the residual, rounded to bf16 once (to nearest even). fp32 outputs are
one chain of fused multiply-adds over the inputs in ascending order, plus the bias, plus the
residual. Either way the order is the same for every row whatever the number of rows in the
call: a row's result does not depend on the rows computed beside it (oneDNN's does, in its
last bit, above 32 rows), and the fp32 result is the same in AVX2 and AVX-512 builds.

Packed layouts (zero-padded; the plain weight is not kept):
- bf16: W ``[N, K]`` -> ``[ceil(N/16), ceil(K/2), 16, 2]``, element ``[b, j, c, t] =
  W[16 b + c, 2 j + t]``: per block of 16 outputs, one 64-byte vector per pair of inputs.
- fp32: W ``[N, K]`` -> ``[ceil(N/16), K, 16]``, element ``[b, k, c] = W[16 b + c, k]``: per
  block of 16 outputs, one 64-byte line per input.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import Tensor

from batchgen.model.cpu_features import bf16_support
from batchgen.model.cpu_kernels import CpuKernels

__all__ = ["KernelGemm", "for_dtype", "pack"]

log = logging.getLogger(__name__)


def pack(weight: Tensor) -> Tensor:
    """weight ``[N, K]`` bf16 or fp32 -> a new contiguous tensor of its dtype in the kernel's
    layout for that dtype (the module docstring's)."""
    n, k = weight.shape
    n16 = -(-n // 16)
    if weight.dtype == torch.float32:
        padded = F.pad(weight.detach(), (0, 0, 0, 16 * n16 - n))
        return padded.view(n16, 16, k).transpose(1, 2).contiguous()
    k2 = -(-k // 2)
    padded = F.pad(weight.detach(), (0, 2 * k2 - k, 0, 16 * n16 - n))
    return padded.view(n16, 16, k2, 2).transpose(1, 2).contiguous()


class KernelGemm:
    """The GEMM on packed weights, bf16 or fp32 by the tensors' dtype, through the C kernels
    ``kernels``."""

    def __init__(self, kernels: CpuKernels) -> None:
        self.kernels = kernels

    def pack(self, weight: Tensor) -> Tensor:
        return pack(weight)

    def linear(self, h: Tensor, packed: Tensor, n: int, bias: Tensor | None) -> Tensor:
        """h ``[M, K]`` (unit column stride) -> a new ``[M, n]``: ``h @ W^T + bias``."""
        out = h.new_empty(h.shape[0], n)
        return self.kernels.gemm(h, packed, n, bias, None, out)

    def linear_add_(self, x: Tensor, h: Tensor, packed: Tensor, bias: Tensor | None) -> Tensor:
        """``x = x + h @ W^T + bias`` in place (bf16: rounded once); x ``[M, n]`` with unit
        column stride."""
        return self.kernels.gemm(h, packed, x.shape[1], bias, x, x)


def _self_check(gemm: KernelGemm, dtype: torch.dtype) -> bool:
    """Pack a random matrix (odd sizes: padded blocks and pairs) and compare products (plain,
    with bias, with the residual add) with ``F.linear`` at a few row counts, in ``dtype``."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(83, 37, generator=gen).to(dtype)
    bias = torch.randn(83, generator=gen).to(dtype)
    tol = {"rtol": 1e-2, "atol": 1e-1} if dtype == torch.bfloat16 else {"rtol": 1e-4, "atol": 1e-4}
    packed = gemm.pack(weight)
    for rows in (1, 5, 70):
        h = torch.randn(rows, 37, generator=gen).to(dtype)
        x = torch.randn(rows, 83, generator=gen).to(dtype)
        expected = F.linear(h.float(), weight.float(), bias.float())
        got = gemm.linear(h, packed, 83, bias).float()
        added = gemm.linear_add_(x.clone(), h, packed, bias).float()
        if not (
            torch.allclose(got, expected, **tol)
            and torch.allclose(added, expected + x.float(), **tol)
        ):
            log.warning("the C kernels' %s GEMM disagrees with F.linear; it is not used", dtype)
            return False
    return True


# (the kernels' library path, dtype) -> its GEMM, or None where the check failed
_CHECKED: dict[tuple[str, torch.dtype], KernelGemm | None] = {}


def for_dtype(
    device: torch.device, dtype: torch.dtype, kernels: CpuKernels | None
) -> KernelGemm | None:
    """The GEMM for weights on ``device`` in ``dtype``, on CPUs only and after a passed check:
    bf16 where the kernels have AVX512-BF16 and the CPU no AMX, fp32 where they were built with
    AVX2 and FMA or AVX-512; else None (oneDNN, MKL or ``F.linear``)."""
    if device.type != "cpu" or kernels is None:
        return None
    if dtype == torch.bfloat16:
        if not kernels.gemm_dpbf16 or "AMX-BF16" in bf16_support().features:
            return None
    elif dtype != torch.float32 or not kernels.gemm_f32:
        return None
    key = (str(kernels.path), dtype)
    if key not in _CHECKED:
        gemm = KernelGemm(kernels)
        _CHECKED[key] = gemm if _self_check(gemm, dtype) else None
    return _CHECKED[key]
