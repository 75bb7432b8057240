"""Mixture-of-experts expert compute: a grouped GEMM over (token, slot) pairs sorted by expert.

``fused_moe(x, w13, w2, ids)`` returns every (token, slot) pair's expert output, unweighted, in
(token, slot) order: ``out[t * k + j] = down_e(silu(gate_e(x[t])) * up_e(x[t]))`` with
``e = ids[t, j]``. Weighting and summing a token's slots is left to the caller (one pass).

How: the pairs are sorted by expert (stably) and each expert's run padded to a multiple of the
row tile ``BLOCK_M`` (:func:`align_by_expert`, PyTorch ops, no host sync), so every row tile
belongs to one expert. One launch computes every tile of the gate-up GEMM (rows of x gathered by
pair), SwiGLU runs on the ``[P, 2I]`` result, a second launch computes the down GEMM and writes
each row to its pair's place. Experts without pairs have no tiles; a tile reads its expert's
weights once for all its rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ._common import check_launchable, check_same_device, is_interpreted

__all__ = ["align_by_expert", "fused_moe"]


@triton.jit
def _grouped_gemm_kernel(
    a_ptr,  # [rows of a, K]: row of pair p is p // A_ROW_DIV
    w_ptr,  # [E, N, K]
    c_ptr,  # [P, N]: row p is pair p's output
    pairs_ptr,  # [num_tiles * BLOCK_M] int32: pair ids sorted by expert; num_pairs = padding
    tile_expert_ptr,  # [num_tiles] int32: each row tile's expert; num_experts = no work
    num_pairs,
    num_experts,
    N,
    K,
    a_row_div,
    stride_am,
    stride_ak,
    stride_we,
    stride_wn,
    stride_wk,
    stride_cm,
    stride_cn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FP32_DOT: tl.constexpr,  # dot in fp32 (IEEE): fp32 inputs, or bf16/fp16 under the interpreter
):
    # Grid: (num_tiles, cdiv(N, BLOCK_N)). One program: C[pairs of tile, cols] = A[rows] @ W[e].T
    # accumulated in fp32 over K in BLOCK_K steps, rounded once to C's dtype.
    tile = tl.program_id(0)
    col_block = tl.program_id(1)
    e = tl.load(tile_expert_ptr + tile)
    if e >= num_experts:
        return
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(pairs_ptr + rows)  # [BLOCK_M]; always in bounds (padded allocation)
    valid = pair < num_pairs
    a_row = (pair // a_row_div).to(tl.int64)
    cols = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    w_base = w_ptr + e.to(tl.int64) * stride_we
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(
            a_ptr + a_row[:, None] * stride_am + ks[None, :] * stride_ak,
            mask=valid[:, None] & k_ok[None, :],
            other=0.0,
        )  # [BLOCK_M, BLOCK_K]
        w = tl.load(
            w_base + cols[None, :].to(tl.int64) * stride_wn + ks[:, None] * stride_wk,
            mask=col_ok[None, :] & k_ok[:, None],
            other=0.0,
        )  # [BLOCK_K, BLOCK_N]: W[e].T's tile
        if FP32_DOT:
            acc = tl.dot(a.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w, acc)
    out = c_ptr + pair.to(tl.int64)[:, None] * stride_cm + cols[None, :] * stride_cn
    tl.store(out, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & col_ok[None, :])


def align_by_expert(
    ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert ids ``[T, k]`` -> ``pairs [num_tiles * block_m]`` int32 (pair ids ``t * k + j``
    sorted by expert, stably, each expert's run padded to a multiple of ``block_m`` with the
    value ``P = T * k``) and ``tile_expert [num_tiles]`` int32 (each tile's expert;
    ``num_experts`` for tiles past the last expert's run). ``num_tiles`` is an upper bound known
    without reading ``ids`` on the host: ``cdiv(P + min(P, E) * (block_m - 1), block_m)``."""
    flat = ids.reshape(-1).to(torch.int64)
    p = flat.numel()
    device = flat.device
    order = torch.argsort(flat, stable=True)  # [P]
    sorted_e = flat[order]
    # [E] pairs per expert; a scatter, not torch.bincount, which syncs with the host on CUDA
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    start = torch.cumsum(counts, 0) - counts  # first sorted position of each expert
    rank = torch.arange(p, device=device) - start[sorted_e]  # position within its expert
    dest = (padded_end - padded)[sorted_e] + rank  # [P] slot in the padded layout
    num_tiles = triton.cdiv(p + min(p, num_experts) * (block_m - 1), block_m)
    pairs = torch.full((num_tiles * block_m,), p, dtype=torch.int32, device=device)
    pairs[dest] = order.to(torch.int32)
    tile_start = torch.arange(num_tiles, device=device) * block_m
    tile_expert = torch.searchsorted(padded_end, tile_start, right=True).to(torch.int32)
    return pairs, tile_expert


def _grouped_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    pairs: torch.Tensor,
    tile_expert: torch.Tensor,
    num_pairs: int,
    a_row_div: int,
    block_m: int,
) -> torch.Tensor:
    """``c[p] = a[p // a_row_div] @ w[e(p)].T`` for every pair ``p < num_pairs`` -> ``[P, N]``."""
    num_experts, n, k = w.shape
    c = torch.empty(num_pairs, n, dtype=a.dtype, device=a.device)
    block_n = 64 if n >= 64 else max(16, triton.next_power_of_2(n))
    block_k = 64 if k >= 64 else max(16, triton.next_power_of_2(k))
    fp32_dot = a.dtype == torch.float32 or is_interpreted(_grouped_gemm_kernel)
    grid = (tile_expert.shape[0], triton.cdiv(n, block_n))
    _grouped_gemm_kernel[grid](
        a,
        w,
        c,
        pairs,
        tile_expert,
        num_pairs,
        num_experts,
        n,
        k,
        a_row_div,
        *a.stride(),
        *w.stride(),
        *c.stride(),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        FP32_DOT=fp32_dot,
        num_warps=4,
    )
    return c


def fused_moe(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """Every (token, slot) pair's expert SwiGLU output, unweighted.

    Args:
        x: ``[T, H]`` tokens (fp32, bf16 or fp16; any strides).
        w13: ``[E, 2I, H]``: expert e's gate rows ``w13[e, :I]``, then its up rows.
        w2: ``[E, H, I]``: expert e's down projection.
        ids: ``[T, k]`` integer expert ids in ``[0, E)`` (not checked: a host sync).

    Returns ``[T * k, H]`` in x's dtype, row ``t * k + j`` for ``(t, ids[t, j])``; the GEMMs
    accumulate in fp32 and round once; SwiGLU runs on the rounded gate-up output.
    """
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3 or ids.dim() != 2:
        raise ValueError(
            f"expected x [T, H], w13 [E, 2I, H], w2 [E, H, I], ids [T, k]; got {tuple(x.shape)}, "
            f"{tuple(w13.shape)}, {tuple(w2.shape)}, {tuple(ids.shape)}"
        )
    num_experts, two_i, hidden = w13.shape
    if (
        x.shape[0] != ids.shape[0]
        or x.shape[1] != hidden
        or w2.shape != (num_experts, hidden, two_i // 2)
    ):
        raise ValueError(
            f"shapes disagree: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}, "
            f"ids {tuple(ids.shape)}"
        )
    if ids.dtype.is_floating_point:
        raise ValueError("ids must be an integer tensor")
    check_same_device(x, w13, w2, ids)
    t, top_k = ids.shape
    num_pairs = t * top_k
    if num_pairs == 0:
        return x.new_empty(0, hidden)
    check_launchable(_grouped_gemm_kernel, x)
    # row tile: 16 rows when experts get few pairs each (decode), 64 for long prefills
    block_m = 16 if num_pairs <= 16 * num_experts else 64
    pairs, tile_expert = align_by_expert(ids, num_experts, block_m)
    h = _grouped_gemm(x, w13, pairs, tile_expert, num_pairs, top_k, block_m)  # [P, 2I]
    inter = two_i // 2
    act = F.silu(h[:, :inter]) * h[:, inter:]  # [P, I]
    return _grouped_gemm(act, w2, pairs, tile_expert, num_pairs, 1, block_m)  # [P, H]
