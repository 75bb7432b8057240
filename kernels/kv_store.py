"""Write this step's new keys and values into the paged KV cache.

Cache layout per layer: ``[num_blocks, block_size, Hkv, D]`` addressed only through its four
strides, so a view of the shared ``[L, 2, num_blocks, block_size, Hkv, D]`` allocation (or any
permutation of it) works. A token's slot is ``block_id * block_size + offset``; a negative slot
marks a padding token that is skipped.

A quantized cache (int8, float8_e4m3fn) also takes one fp32 scale per (slot, KV head), in
``[num_blocks, block_size, Hkv]`` planes; the store quantizes each token's head row by the rule
of ``reference.quantize_kv_ref`` and writes exactly its bytes and scales.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_launchable, check_same_device

# cache dtype -> (QUANT constexpr: 0 float, 1 int8, 2 fp8 e4m3, QMAX); see reference.QMAX
_QUANT = {torch.int8: (1, 127.0), torch.float8_e4m3fn: (2, 448.0)}
# 1.5 * 2**23: for |y| <= 2**22, (y + _RNE) - _RNE is y rounded half to even in fp32
_RNE = tl.constexpr(12582912.0)


@triton.jit
def _quantize_rows(x, QUANT: tl.constexpr, QMAX: tl.constexpr):
    """x ``[BLOCK_H, BLOCK_D]`` fp32 (0 in masked lanes) -> (q in fp32 values, scale
    ``[BLOCK_H]``) by ``reference.quantize_kv_ref``'s rule, IEEE divisions."""
    scale = tl.math.div_rn(tl.max(tl.abs(x), axis=1), QMAX)  # [BLOCK_H]
    nonzero = scale > 0
    y = tl.math.div_rn(x, tl.where(nonzero, scale, 1.0)[:, None])
    y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
    y = tl.where(nonzero[:, None], y, 0.0)
    if QUANT == 1:
        y = (y + _RNE) - _RNE  # round half to even; |y| <= 127
    else:
        # Round to the e4m3 grid here (half to even), so the cast below is exact (the
        # interpreter's fp32 -> fp8 cast drops the carry of a mantissa that rounds up). A value
        # of exponent E >= -6 has spacing 2^(E-3) (subnormals: 2^-9); adding and subtracting
        # 1.5 * 2^(E+20), whose fp32 ulp is that spacing, rounds |y| to it. The sign is put back
        # by its bit (-0.0 stays -0.0, as torch's cast gives).
        bits = y.to(tl.int32, bitcast=True)
        exp = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)
        magic = (((exp + 20 + 127) << 23) | (1 << 22)).to(tl.float32, bitcast=True)
        r = (tl.abs(y) + magic) - magic
        y = (r.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)
    return y, scale


@triton.jit
def _store_kv_kernel(
    k_ptr,  # [T, Hkv, D]
    v_ptr,  # [T, Hkv, D]
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    slot_ptr,  # [T] int64
    k_scale_ptr,  # [num_blocks, block_size, Hkv] fp32 (QUANT > 0)
    v_scale_ptr,  # [num_blocks, block_size, Hkv] fp32 (QUANT > 0)
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
    stride_ksb,
    stride_kss,
    stride_ksh,
    stride_vsb,
    stride_vss,
    stride_vsh,
    num_kv_heads,
    head_dim,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    BLOCK_H: tl.constexpr,  # heads per program (power of two)
    BLOCK_D: tl.constexpr,  # next_pow2(head_dim)
    QUANT: tl.constexpr,  # 0: float cache (cast); 1: int8; 2: fp8 e4m3, with scales
    QMAX: tl.constexpr,  # 127 or 448 (QUANT > 0)
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
        other=0.0,
    )
    v = tl.load(
        v_ptr + tok * stride_vt + heads64[:, None] * stride_vh + dims64[None, :] * stride_vd,
        mask=mask,
        other=0.0,
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
    if QUANT > 0:
        k, k_scale = _quantize_rows(k.to(tl.float32), QUANT, QMAX)
        v, v_scale = _quantize_rows(v.to(tl.float32), QUANT, QMAX)
        head_valid = heads < num_kv_heads
        ks_off = block * stride_ksb + offset * stride_kss + heads64 * stride_ksh
        vs_off = block * stride_vsb + offset * stride_vss + heads64 * stride_vsh
        tl.store(k_scale_ptr + ks_off, k_scale, mask=head_valid)
        tl.store(v_scale_ptr + vs_off, v_scale, mask=head_valid)
    tl.store(k_cache_ptr + kc_off, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + vc_off, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Scatter ``k[t]`` and ``v[t]`` into cache slot ``slot_mapping[t]`` (in place).

    Args:
        k, v: ``[T, Hkv, D]``, any strides. Cast to a float cache's dtype on store; quantized
            into an int8 / float8_e4m3fn cache (``reference.quantize_kv_ref``'s bytes).
        k_cache, v_cache: ``[num_blocks, block_size, Hkv, D]``, any strides.
        k_scale, v_scale: a quantized cache's fp32 scales ``[num_blocks, block_size, Hkv]``, any
            strides (written); None for a float cache.
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
    quant, qmax = _QUANT.get(k_cache.dtype, (0, 0.0))
    if v_cache.dtype != k_cache.dtype:
        raise ValueError(f"k_cache is {k_cache.dtype} but v_cache is {v_cache.dtype}")
    if quant:
        scale_shape = k_cache.shape[:3]
        for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
            if t is None or t.shape != scale_shape or t.dtype != torch.float32:
                raise ValueError(f"a {k_cache.dtype} cache needs {name} {tuple(scale_shape)} fp32")
    elif k_scale is not None or v_scale is not None:
        raise ValueError(f"scales given for a {k_cache.dtype} cache")
    else:
        k_scale = v_scale = k_cache  # unused placeholders
    assert k_scale is not None and v_scale is not None
    check_same_device(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
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
        k_scale,
        v_scale,
        *k.stride(),
        *v.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        *k_scale.stride()[:3],
        *v_scale.stride()[:3],
        num_kv_heads,
        head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        QUANT=quant,
        QMAX=qmax,
        num_warps=4,
    )
