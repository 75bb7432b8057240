"""How much device memory one engine step needs beyond the weights and the KV cache.

:func:`measure_activation_peak` runs the worst step the engine can schedule (a prefill of
``max_num_batched_tokens`` tokens, then logits and a top-p draw for ``max_num_seqs`` rows) on a
one-block KV cache and reads the allocator's peak. Used on CUDA only, before the KV cache is sized.
"""

from __future__ import annotations

import torch

from batchgen.engine.noise import TORCH_FORMULA
from batchgen.engine.request import SamplingParams
from batchgen.engine.sampler import SamplingBatch, sample
from batchgen.model.attention import AttentionMetadata
from batchgen.model.config import ModelInfo

__all__ = ["measure_activation_peak"]


def _profile_step(num_tokens: int, block_size: int, device: torch.device) -> AttentionMetadata:
    """One sequence of ``num_tokens`` new tokens whose block table points at block 0 for every
    position: the step's shapes without a real cache (the values are meaningless)."""
    num_table = -(-num_tokens // block_size)
    pos = torch.arange(num_tokens, device=device)
    return AttentionMetadata(
        slot_mapping=pos % block_size,  # [T] int64, all in block 0
        block_tables=torch.zeros((1, num_table), dtype=torch.int32, device=device),
        cu_seqlens_q=torch.tensor([0, num_tokens], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=device),
        max_seqlen_q=num_tokens,
        max_seqlen_k=num_tokens,
    )


@torch.inference_mode()
def measure_activation_peak(
    model: torch.nn.Module,
    info: ModelInfo,
    *,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    block_size: int,
    device: torch.device,
    dtype: torch.dtype,
) -> int:
    """Peak bytes the allocator holds during the worst step, above what it held before (CUDA)."""
    num_tokens = max(max_num_batched_tokens, 1)
    num_rows = min(max(max_num_seqs, 1), num_tokens)
    kv_cache = torch.zeros(
        (info.num_layers, 2, 1, block_size, info.num_kv_heads, info.head_dim),
        dtype=dtype,
        device=device,
    )
    meta = _profile_step(num_tokens, block_size, device)
    ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)
    pos = torch.arange(num_tokens, dtype=torch.int64, device=device)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    hidden = model(ids, pos, kv_cache, meta)
    logits = model.compute_logits(hidden[:num_rows])
    params = [SamplingParams(temperature=1.0, top_p=0.9)] * num_rows
    rows = SamplingBatch.from_rows(
        params, list(range(num_rows)), [0] * num_rows, None, None, info.vocab_size, device
    )
    sample(logits, rows, logprobs=True, kernels=TORCH_FORMULA)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del hidden, logits, kv_cache
    return max(0, peak)
