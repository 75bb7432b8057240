"""Plain PyTorch twins of the Triton kernels, with the same signatures.

Written to be obviously correct rather than fast (Python loops over tokens and sequences); they
are the tests' reference and document the kernels' semantics.
"""

from __future__ import annotations

import torch


def store_kv_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Reference ``store_kv``: ``cache[slot // block_size, slot % block_size] = k[t]``.

    k, v ``[T, Hkv, D]``; caches ``[num_blocks, block_size, Hkv, D]``; slot_mapping ``[T]``,
    negative slots are skipped.
    """
    block_size = k_cache.shape[1]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        block, offset = divmod(slot, block_size)
        k_cache[block, offset] = k[t].to(k_cache.dtype)
        v_cache[block, offset] = v[t].to(v_cache.dtype)


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seqlen_q: int,
    max_seqlen_k: int,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference ``paged_attention``: per sequence, gather its keys and run masked softmax in fp32
    (``window``: keys ``p-W+1 .. p``; ``softcap``: scores capped by ``c * tanh(s / c)``;
    ``sinks [Hq]``: one more softmax term per head, without a value).

    ``max_seqlen_q``, ``max_seqlen_k`` and ``num_splits`` only steer the kernel's launch and are
    ignored here.
    """
    del max_seqlen_q, max_seqlen_k, num_splits
    num_heads = q.shape[1]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(q)
    cu = cu_seqlens_q.tolist()
    for b, seq_len in enumerate(seq_lens.tolist()):
        q_start, q_end = cu[b], cu[b + 1]
        q_len = q_end - q_start
        context_len = seq_len - q_len
        num_blocks = -(-seq_len // block_size)
        blocks = block_tables[b, :num_blocks].long()
        # [num_blocks, block_size, Hkv, D] -> [seq_len, Hkv, D] -> [Hq, seq_len, D]
        keys = k_cache[blocks].flatten(0, 1)[:seq_len].float()
        values = v_cache[blocks].flatten(0, 1)[:seq_len].float()
        keys = keys.repeat_interleave(group, dim=1).transpose(0, 1)
        values = values.repeat_interleave(group, dim=1).transpose(0, 1)
        queries = q[q_start:q_end].float().transpose(0, 1)  # [Hq, q_len, D]

        scores = queries @ keys.transpose(1, 2) * scale  # [Hq, q_len, seq_len]
        q_pos = torch.arange(q_len, device=q.device)[:, None] + context_len
        k_pos = torch.arange(seq_len, device=q.device)[None, :]
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        hidden = k_pos > q_pos
        if window:
            hidden |= k_pos <= q_pos - window
        scores = scores.masked_fill(hidden, float("-inf"))
        if sinks is not None:  # a column of sink logits, dropped after the softmax
            sink = sinks.float()[:, None, None].expand(-1, q_len, 1)
            probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        out[q_start:q_end] = (probs @ values).transpose(0, 1).to(out.dtype)  # [q_len, Hq, D]
    return out


def copy_blocks_ref(kv_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Reference ``copy_blocks``: ``kv_cache[:, :, dst[i]] = kv_cache[:, :, src[i]]`` for each i.

    kv_cache ``[L, 2, num_blocks, block_size, Hkv, D]``. Asserts the kernel's preconditions
    (distinct destinations, none of them a source), under which copy order does not matter.
    """
    src_ids, dst_ids = src.tolist(), dst.tolist()
    assert len(set(dst_ids)) == len(dst_ids), "dst block ids must be distinct"
    assert not set(src_ids) & set(dst_ids), "a block may not be both a source and a destination"
    for s, d in zip(src_ids, dst_ids, strict=True):
        kv_cache[:, :, d] = kv_cache[:, :, s]


# Quantized KV cache (int8, fp8 e4m3): one fp32 scale per (token, KV head), computed from that
# token's own K or V when it is written. Every kernel that stores into a quantized cache must give
# exactly these bytes and scales:
#   xf = x in fp32 (bf16/fp16 widened exactly); amax = max |xf| over D; scale = amax / QMAX
#   (one IEEE fp32 division); y = clamp(xf / scale, -QMAX, QMAX) (IEEE fp32 division);
#   int8: q = round-half-to-even(y); fp8: q = y cast to float8_e4m3fn (round to nearest even);
#   where scale == 0 (an all-zero row, or amax so small it underflows), q = 0.
# Reading dequantizes as q (widened to fp32) * scale, in fp32.
QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


def quantize_kv_ref(x: torch.Tensor, cache_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize x ``[..., D]`` per row of D: returns (q ``[..., D]`` cache_dtype, scale ``[...]``
    fp32) by the rule above. The element error ``|q * scale - x|`` is at most ``amax / 254``
    for int8."""
    qmax = QMAX[cache_dtype]
    xf = x.float()
    scale = xf.abs().amax(dim=-1) / qmax
    nonzero = scale > 0
    divisor = torch.where(nonzero, scale, torch.ones_like(scale))
    y = (xf / divisor[..., None]).clamp(-qmax, qmax)
    y = torch.where(nonzero[..., None], y, torch.zeros_like(y))
    q = torch.round(y).to(torch.int8) if cache_dtype == torch.int8 else y.to(cache_dtype)
    return q, scale


def dequantize_kv_ref(
    q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``q * scale`` in fp32 (q ``[..., D]``, scale ``[...]``), then cast to dtype."""
    return (q.float() * scale[..., None].float()).to(dtype)


def fused_moe_ref(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """Reference ``fused_moe``: pair by pair, ``out[t * k + j] = w2[e] @ (silu(g) * u)`` with
    ``[g; u] = w13[e] @ x[t]`` and ``e = ids[t, j]``. x ``[T, H]``, w13 ``[E, 2I, H]``, w2
    ``[E, H, I]``, ids ``[T, k]`` -> ``[T * k, H]`` in x's dtype; each GEMM accumulates in fp32
    and rounds once to x's dtype, SwiGLU runs on the rounded gate-up output (in x's dtype)."""
    t, k = ids.shape
    inter = w2.shape[2]
    out = torch.empty(t * k, x.shape[1], dtype=x.dtype, device=x.device)
    for i in range(t):
        for j in range(k):
            e = int(ids[i, j])
            h = (w13[e].float() @ x[i].float()).to(x.dtype)  # [2I]
            act = torch.nn.functional.silu(h[:inter]) * h[inter:]  # [I]
            out[i * k + j] = (w2[e].float() @ act.float()).to(x.dtype)
    return out
