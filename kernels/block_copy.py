"""Copy whole KV-cache blocks (copy-on-write of a shared, partially filled block).

The cache is the single allocation ``kv_cache[L, 2, num_blocks, block_size, Hkv, D]``; one call
copies block ``src[i]`` to block ``dst[i]`` in every layer, for both K and V.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_launchable, check_same_device


@triton.jit
def _copy_blocks_kernel(
    cache_ptr,  # [L, 2, num_blocks, block_size, Hkv, D]
    src_ptr,  # [P] integer block ids
    dst_ptr,  # [P] integer block ids
    stride_l,
    stride_kv,
    stride_b,
    stride_s,
    stride_h,
    stride_d,
    num_kv_heads,
    head_dim,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    BLOCK_H: tl.constexpr,  # heads per program (power of two)
    BLOCK_D: tl.constexpr,  # next_pow2(head_dim)
):
    # Grid: (P, L * 2, cdiv(Hkv, BLOCK_H)). One program copies the [block_size, BLOCK_H, D] slab
    # of one block pair in one (layer, K-or-V) plane, one token row per loop iteration.
    pair = tl.program_id(0)
    plane = tl.program_id(1)  # layer * 2 + (0 for K, 1 for V)
    head_block = tl.program_id(2)

    src = tl.load(src_ptr + pair).to(tl.int64)
    dst = tl.load(dst_ptr + pair).to(tl.int64)
    layer = (plane // 2).to(tl.int64)
    kv = (plane % 2).to(tl.int64)
    base = layer * stride_l + kv * stride_kv

    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    dims = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    mask = (heads[:, None] < num_kv_heads) & (dims[None, :] < head_dim)
    inner = heads.to(tl.int64)[:, None] * stride_h + dims.to(tl.int64)[None, :] * stride_d

    for s in range(BLOCK_SIZE):
        row = base + s * stride_s + inner  # [BLOCK_H, BLOCK_D]
        x = tl.load(cache_ptr + src * stride_b + row, mask=mask)
        tl.store(cache_ptr + dst * stride_b + row, x, mask=mask)


def copy_blocks(kv_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy block ``src[i]`` to block ``dst[i]`` in every layer, K and V (in place).

    Args:
        kv_cache: ``[L, 2, num_blocks, block_size, Hkv, D]``, any strides, or a quantized
            cache's scales ``[L, 2, num_blocks, block_size, Hkv]`` (copied as ``D = 1``).
        src, dst: ``[P]`` integer block ids (int64 expected). Preconditions, not checked here
            because checking needs a device-to-host sync: ids are in range, ``dst`` ids are
            distinct and no ``dst`` id is also a ``src`` id (copies run in parallel).
    """
    if kv_cache.dim() == 5:  # scales: one value per (token, KV head)
        kv_cache = kv_cache.unsqueeze(-1)
    if kv_cache.dim() != 6 or kv_cache.shape[1] != 2:
        raise ValueError(
            f"kv_cache must be [L, 2, num_blocks, block_size, Hkv, D], got {kv_cache.shape}"
        )
    if src.dim() != 1 or src.shape != dst.shape:
        raise ValueError(f"src and dst must be [P] of one shape, got {src.shape} and {dst.shape}")
    if src.dtype.is_floating_point or dst.dtype.is_floating_point:
        raise ValueError("src and dst must be integer tensors")
    check_same_device(kv_cache, src, dst)
    num_pairs = src.shape[0]
    num_layers, _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    if num_pairs == 0 or num_layers == 0:
        return
    check_launchable(_copy_blocks_kernel, kv_cache)
    src, dst = src.contiguous(), dst.contiguous()  # indexed with a unit stride

    block_d = triton.next_power_of_2(head_dim)
    block_h = min(triton.next_power_of_2(num_kv_heads), max(1, 4096 // block_d))
    grid = (num_pairs, num_layers * 2, triton.cdiv(num_kv_heads, block_h))
    _copy_blocks_kernel[grid](
        kv_cache,
        src,
        dst,
        *kv_cache.stride(),
        num_kv_heads,
        head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        num_warps=4,
    )
