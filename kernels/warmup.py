"""Compile every attention variant an engine can launch before its first step.

``NUM_SPLITS``, the launch configuration (decode, prefill up to 64 query tokens, longer
prefill) and the dtypes are what select a binary (per-step integers are not specialised, see
``attention._PER_STEP_INTS``), so a handful of tiny launches over the engine's own cache planes
compiles them all up front instead of mid-run.
"""

from __future__ import annotations

import torch

from .attention import paged_attention, split_buckets


def attention_warmup_shapes() -> list[tuple[int, int | None]]:
    """(query tokens of the one sequence, forced num_splits) per launch: decode with each split
    bucket, a short prefill (<= 64 query tokens) and a long one (> 64)."""
    return [(1, s) for s in split_buckets()] + [(2, 1), (65, 1)]


def warm_up_attention(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    num_heads: int,
    q_dtype: torch.dtype | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> int:
    """Launch paged attention once per variant on ``k_cache``/``v_cache`` (one layer's planes
    ``[num_blocks, block_size, Hkv, D]``; read only) with queries of ``q_dtype`` (default: the
    cache's; a quantized cache needs it and its scales ``[num_blocks, block_size, Hkv]``).
    Returns the number of launches."""
    _, block_size, _, head_dim = k_cache.shape
    device, dtype = k_cache.device, q_dtype or k_cache.dtype
    launches = 0
    for q_len, splits in attention_warmup_shapes():
        seq_len = q_len + 16  # splits past the keys are empty: still the same binary
        table_width = -(-seq_len // block_size)
        q = torch.zeros(q_len, num_heads, head_dim, dtype=dtype, device=device)
        paged_attention(
            q,
            k_cache,
            v_cache,
            torch.zeros((1, table_width), dtype=torch.int32, device=device),  # all block 0
            torch.tensor([0, q_len], dtype=torch.int32, device=device),
            torch.tensor([seq_len], dtype=torch.int32, device=device),
            head_dim**-0.5,
            q_len,
            seq_len,
            num_splits=splits,
            k_scale=k_scale,
            v_scale=v_scale,
        )
        launches += 1
    return launches


__all__ = ["attention_warmup_shapes", "warm_up_attention"]
