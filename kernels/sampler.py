"""The sampler's noise and exponential race as Triton kernels (one pass instead of ~28 int64
elementwise kernels over ``[S, V]``).

The formula is batchgen.engine.noise's (this package imports nothing of batchgen, so it is
restated here): the noise for vocab id ``i`` of a row with 64-bit state ``s`` is splitmix64's
output function of ``s + (i + 1) * GAMMA`` (unsigned, wrapping), turned into a float32 in (0, 1)
as ``hi * 2**-24 + lo * 2**-48`` (the 24-bit fields at bits 40 and 16), clamped to
``[2**-49, 1 - 2**-24]``. Every step is exact integer arithmetic or a power-of-two scaling
followed by one IEEE add, so the noise is bit-identical to the PyTorch and C versions.

The race draws ``argmax_i exp(s_i - max s) / E_i`` with ``s = logits / temperature`` and
``E_i = -log1p(-u_i)`` (computed in float64 and rounded: within an ulp of float32 ``log1p``),
the first maximum on ties: the token the PyTorch formula picks, up to float rounding in near
ties (the same contract as the C kernel's).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_launchable, check_same_device

_BLOCK = 1024  # vocab entries per tile


@triton.jit
def _uniform(state, ids):
    """Float32 noise in (0, 1) for uint64 row states and int64 vocab ids (broadcasting)."""
    z = (ids.to(tl.uint64, bitcast=True) + 1) * 0x9E3779B97F4A7C15 + state
    z = z ^ (z >> 30)
    z = z * 0xBF58476D1CE4E5B9
    z = z ^ (z >> 27)
    z = z * 0x94D049BB133111EB
    z = z ^ (z >> 31)
    hi = ((z >> 40) & 0xFFFFFF).to(tl.int32).to(tl.float32)
    lo = ((z >> 16) & 0xFFFFFF).to(tl.int32).to(tl.float32)
    u = hi * 5.9604644775390625e-08 + lo * 3.552713678800501e-15  # 2**-24, 2**-48: exact
    return tl.minimum(tl.maximum(u, 1.7763568394002505e-15), 0.99999994039535522)


# The candidate width of filtered rows changes every step: not specialised.
@triton.jit(do_not_specialize=["num_ids", "stride_ids"])
def _uniform_noise_kernel(
    state_ptr,  # [S] int64
    ids_ptr,  # [S, K] or [1, K] int64, unit inner stride
    out_ptr,  # [S, K] float32, contiguous
    num_ids,
    stride_ids,  # 0 when every row shares one row of ids
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < num_ids
    state = tl.load(state_ptr + row).to(tl.uint64, bitcast=True)
    ids = tl.load(ids_ptr + row.to(tl.int64) * stride_ids + cols, mask=mask, other=0)
    u = _uniform(state, ids)
    tl.store(out_ptr + row.to(tl.int64) * num_ids + cols, u, mask=mask)


@triton.jit
def _race_draw_kernel(
    logits_ptr,  # [R, V] float32, unit inner stride
    temperature_ptr,  # [R] float32, > 0
    state_ptr,  # [R] int64
    out_ptr,  # [R] int64
    vocab_size,
    stride_row,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    base = logits_ptr + row.to(tl.int64) * stride_row
    t = tl.load(temperature_ptr + row)
    state = tl.load(state_ptr + row).to(tl.uint64, bitcast=True)
    # Pass 1: the row's largest scaled logit.
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    for start in range(0, vocab_size, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        s = tl.load(base + cols, mask=cols < vocab_size, other=float("-inf")) / t
        m = tl.maximum(m, s)
    row_max = tl.max(m, axis=0)
    # Pass 2: the race; the running best keeps the first maximum (strictly greater replaces).
    best = -1.0
    best_id = 0
    for start in range(0, vocab_size, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        valid = cols < vocab_size
        s = tl.load(base + cols, mask=valid, other=float("-inf")) / t
        u = _uniform(state, cols.to(tl.int64))
        e = (-tl.log(1.0 - u.to(tl.float64))).to(tl.float32)  # -log1p(-u), rounded once
        w = tl.where(valid, tl.exp(s - row_max) / e, -1.0)
        tile_best = tl.max(w, axis=0)
        tile_id = start + tl.argmax(w, axis=0)
        better = tile_best > best
        best_id = tl.where(better, tile_id, best_id)
        best = tl.where(better, tile_best, best)
    tl.store(out_ptr + row, best_id.to(tl.int64))


def uniform_noise(state: torch.Tensor, ids: torch.Tensor, num_ids: int) -> torch.Tensor:
    """``SamplerKernels.uniform_noise``: row states ``[S]`` int64, vocab ids ``[S, K]`` or
    ``[1, K]`` int64 (contiguous rows) -> ``[S, K]`` float32 noise, bit-identical to
    ``batchgen.engine.noise.uniform_at``."""
    if state.dtype != torch.int64 or ids.dtype != torch.int64 or ids.dim() != 2:
        raise ValueError("need state [S] int64 and ids [S, K] or [1, K] int64")
    num_rows = state.shape[0]
    if ids.shape[1] != num_ids or ids.shape[0] not in (1, num_rows):
        raise ValueError(f"ids {tuple(ids.shape)} do not fit {num_rows} rows of {num_ids}")
    ids = ids.contiguous()
    out = torch.empty((num_rows, num_ids), dtype=torch.float32, device=state.device)
    check_same_device(state, ids, out)
    if num_rows == 0 or num_ids == 0:
        return out
    check_launchable(_uniform_noise_kernel, state)
    stride = 0 if ids.shape[0] == 1 else ids.stride(0)
    grid = (num_rows, triton.cdiv(num_ids, _BLOCK))
    _uniform_noise_kernel[grid](state.contiguous(), ids, out, num_ids, stride, BLOCK=_BLOCK)
    return out


def race_draw(logits: torch.Tensor, temperature: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """``SamplerKernels.race_draw``: ``[R, V]`` float32 logits, ``[R]`` float32 temperatures
    (> 0), ``[R]`` int64 row states -> ``[R]`` int64 tokens drawn from softmax(logits / t)."""
    if logits.dim() != 2 or logits.dtype != torch.float32:
        raise ValueError("need [R, V] float32 logits")
    num_rows, vocab_size = logits.shape
    if temperature.shape != (num_rows,) or state.shape != (num_rows,):
        raise ValueError("temperature and state need one entry per row")
    logits = logits if logits.stride(1) == 1 else logits.contiguous()
    out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    check_same_device(logits, temperature, state, out)
    if num_rows == 0:
        return out
    check_launchable(_race_draw_kernel, logits)
    _race_draw_kernel[(num_rows,)](
        logits,
        temperature.to(torch.float32).contiguous(),
        state.contiguous(),
        out,
        vocab_size,
        logits.stride(0),
        BLOCK=_BLOCK,
    )
    return out


__all__ = ["race_draw", "uniform_noise"]
