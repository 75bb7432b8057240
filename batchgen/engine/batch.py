"""Turn a scheduled Batch (plain ints) into the tensors of one forward pass."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchgen.engine.scheduler import Batch
from batchgen.model.attention import AttentionMetadata


@dataclass
class StepTensors:
    input_ids: torch.Tensor  # [T] int64: the new tokens of every chunk, concatenated
    positions: torch.Tensor  # [T] int64: their positions in their sequences
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # [S] int64: row of hidden states to sample, once per target


def build_step(batch: Batch, block_size: int, device: torch.device) -> StepTensors:
    """The step's tensors. Sequences are laid out decodes (one new token) first, so attention
    can launch them apart (``meta.num_decodes``); ``logits_indices`` stays in the order of
    ``batch.chunks``, which is the order the sampler's rows follow."""
    input_ids: list[int] = []
    positions: list[int] = []
    seq_lens: list[int] = []
    cu_seqlens = [0]
    tables: list[list[int]] = []
    decodes = [i for i, c in enumerate(batch.chunks) if c.num_tokens == 1]
    layout = decodes + [i for i, c in enumerate(batch.chunks) if c.num_tokens != 1]
    last_row = [0] * len(batch.chunks)  # chunk index -> row of its last new token
    for i in layout:
        chunk = batch.chunks[i]
        seq = chunk.seq
        end = chunk.start + chunk.num_tokens
        input_ids.extend(seq.token_ids[chunk.start : end])
        positions.extend(range(chunk.start, end))
        seq_lens.append(end)
        cu_seqlens.append(cu_seqlens[-1] + chunk.num_tokens)
        tables.append(seq.block_table)
        last_row[i] = cu_seqlens[-1] - 1
    logits_indices: list[int] = []
    for i, chunk in enumerate(batch.chunks):
        if chunk.samples:
            logits_indices.extend([last_row[i]] * len(chunk.seq.targets))

    max_blocks = max(len(t) for t in tables)
    padded = [t + [0] * (max_blocks - len(t)) for t in tables]
    block_tables = torch.tensor(padded, dtype=torch.int32)  # [B, max_blocks]
    pos = torch.tensor(positions, dtype=torch.int64)  # [T]
    q_lens = torch.tensor([batch.chunks[i].num_tokens for i in layout], dtype=torch.int64)
    seq_of_token = torch.repeat_interleave(torch.arange(len(layout)), q_lens)  # [T]
    slot_mapping = (
        block_tables[seq_of_token, pos // block_size].to(torch.int64) * block_size
        + pos % block_size
    )  # [T]
    meta = AttentionMetadata(
        slot_mapping=slot_mapping.to(device),
        block_tables=block_tables.to(device),
        cu_seqlens_q=torch.tensor(cu_seqlens, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        max_seqlen_q=int(q_lens.max()),
        max_seqlen_k=max(seq_lens),
        num_decodes=len(decodes),
    )
    return StepTensors(
        input_ids=torch.tensor(input_ids, dtype=torch.int64, device=device),
        positions=pos.to(device),
        meta=meta,
        logits_indices=torch.tensor(logits_indices, dtype=torch.int64, device=device),
    )
