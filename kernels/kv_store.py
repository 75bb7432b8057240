"""Write this step's new keys and values into the paged KV cache.

Cache layout per layer: ``[num_blocks, block_size, Hkv, D]`` addressed only through its four
strides, so a view of the shared ``[L, 2, num_blocks, block_size, Hkv, D]`` allocation (or any
permutation of it) works. A token's slot is ``block_id * block_size + offset``; a negative slot
marks a padding token that is skipped.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_launchable, check_same_device


@triton.jit
def _store_kv_kernel(
    k_ptr,  # [T, Hkv, D]
    v_ptr,  # [T, Hkv, D]
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    slot_ptr,  # [T] int64
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_kcd,
    stride_vcb,
    stride_vcs,
    stride_vch,
    stride_vcd,
    num_kv_heads,
    head_dim,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    BLOCK_H: tl.constexpr,  # heads per program (power of two)
    BLOCK_D: tl.constexpr,  # next_pow2(head_dim)
):
    # Grid: (T, cdiv(Hkv, BLOCK_H)). One program copies a [BLOCK_H, BLOCK_D] tile of one token.
    tok = tl.program_id(0).to(tl.int64)
    head_block = tl.program_id(1)

    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot < 0:
        return  # padding token
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE

    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    dims = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    mask = (heads[:, None] < num_kv_heads) & (dims[None, :] < head_dim)

    heads64 = heads.to(tl.int64)
    dims64 = dims.to(tl.int64)
    k = tl.load(
        k_ptr + tok * stride_kt + heads64[:, None] * stride_kh + dims64[None, :] * stride_kd,
        mask=mask,
    )
    v = tl.load(
        v_ptr + tok * stride_vt + heads64[:, None] * stride_vh + dims64[None, :] * stride_vd,
        mask=mask,
    )
    kc_off = (
        block * stride_kcb
        + offset * stride_kcs
        + heads64[:, None] * stride_kch
        + dims64[None, :] * stride_kcd
    )
    vc_off = (
        block * stride_vcb
        + offset * stride_vcs
        + heads64[:, None] * stride_vch
        + dims64[None, :] * stride_vcd
    )
    tl.store(k_cache_ptr + kc_off, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + vc_off, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter ``k[t]`` and ``v[t]`` into cache slot ``slot_mapping[t]`` (in place).

    Args:
        k, v: ``[T, Hkv, D]``, any strides. Cast to the cache dtype on store.
        k_cache, v_cache: ``[num_blocks, block_size, Hkv, D]``, any strides.
        slot_mapping: ``[T]`` integer (int64 expected); ``slot = block_id * block_size + offset``.
            Negative slots are padding and are skipped. Two tokens must not share a slot.
    """
    if k.dim() != 3 or v.shape != k.shape:
        raise ValueError(f"k and v must be [T, Hkv, D] of one shape, got {k.shape} and {v.shape}")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"caches must be [num_blocks, block_size, Hkv, D], got {k_cache.shape}, {v_cache.shape}"
        )
    num_tokens, num_kv_heads, head_dim = k.shape
    _, block_size, cache_heads, cache_dim = k_cache.shape
    if (cache_heads, cache_dim) != (num_kv_heads, head_dim):
        raise ValueError(f"k is {k.shape} but the cache is {k_cache.shape}")
    if slot_mapping.shape != (num_tokens,) or slot_mapping.dtype.is_floating_point:
        raise ValueError(f"slot_mapping must be an integer [T={num_tokens}] tensor")
    check_same_device(k, v, k_cache, v_cache, slot_mapping)
    if num_tokens == 0:
        return
    check_launchable(_store_kv_kernel, k)
    slot_mapping = slot_mapping.contiguous()  # indexed with a unit stride

    block_d = triton.next_power_of_2(head_dim)
    # Keep a tile at <= 2048 elements; heads beyond that go to the second grid axis.
    block_h = min(triton.next_power_of_2(num_kv_heads), max(1, 2048 // block_d))
    grid = (num_tokens, triton.cdiv(num_kv_heads, block_h))
    _store_kv_kernel[grid](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        *k.stride(),
        *v.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        num_kv_heads,
        head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        num_warps=4,
    )
