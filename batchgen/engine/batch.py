"""Turn a scheduled Batch (plain ints) into the tensors of one forward pass."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from batchgen.engine.scheduler import Batch
from batchgen.engine.staging import Staging
from batchgen.model.attention import AttentionMetadata


@dataclass
class StepTensors:
    input_ids: torch.Tensor  # [T] int64: the new tokens of every chunk, concatenated
    positions: torch.Tensor  # [T] int64: their positions in their sequences
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # [S] int64: row of hidden states to sample, once per target
    # The rows the forward pass need compute in full (see the model's ``forward(keep=...)``):
    # ``keep [K]`` int64, the distinct rows of ``logits_indices`` in order, and ``kept_indices
    # [S]`` int64, each of those rows' place in ``keep``. None when every row is wanted (a step
    # of decodes alone) or when a chunk scores its prompt (prompt logprobs read every row).
    keep: torch.Tensor | None = None
    kept_indices: torch.Tensor | None = None
    # Rows of ``input_ids`` whose token is in flight (sampled by the previous step, not known to
    # the host: a placeholder 0 until ``fill_pending``) and, for each, its row in that step's
    # sampled tokens. [F] int64 each; None when no token is in flight.
    fill_rows: torch.Tensor | None = None
    fill_src: torch.Tensor | None = None
    # Row of ``input_ids`` holding each chunk's first new token, in the order of
    # ``batch.chunks`` (host ints: prompt logprobs gather the rows they score).
    first_rows: tuple[int, ...] = ()

    def fill_pending(self, prev_tokens: torch.Tensor) -> None:
        """Put the in-flight tokens in place, on the device: ``prev_tokens`` [S'] int64 are the
        previous step's sampled tokens (queued before this, so stream order makes them ready)."""
        if self.fill_rows is not None:
            assert self.fill_src is not None
            self.input_ids[self.fill_rows] = prev_tokens[self.fill_src]


def build_step(
    batch: Batch,
    block_size: int,
    device: torch.device,
    staging: Staging | None = None,
    in_flight: Mapping[int, int] | None = None,
) -> StepTensors:
    """The step's tensors. Sequences are laid out decodes (one new token) first, so attention
    can launch them apart (``meta.num_decodes``); ``logits_indices`` stays in the order of
    ``batch.chunks``, which is the order the sampler's rows follow. With ``staging`` the
    integer tensors are uploaded packed, two copies in all (the engine's way); without, one by
    one (the same values). ``in_flight`` maps ``id(seq)`` to the row of the previous step's
    sampled tokens for every sequence whose newest token is in flight (see ``fill_pending``)."""
    input_ids: list[int] = []
    positions: list[int] = []
    seq_lens: list[int] = []
    cu_seqlens = [0]
    tables: list[list[int]] = []
    decodes = [i for i, c in enumerate(batch.chunks) if c.num_tokens == 1]
    layout = decodes + [i for i, c in enumerate(batch.chunks) if c.num_tokens != 1]
    last_row = [0] * len(batch.chunks)  # chunk index -> row of its last new token
    fill_rows: list[int] = []
    fill_src: list[int] = []
    for i in layout:
        chunk = batch.chunks[i]
        seq = chunk.seq
        end = chunk.start + chunk.num_tokens
        if end > len(seq.token_ids):  # a decode of the in-flight token (Scheduler.check)
            assert in_flight is not None and chunk.start == len(seq.token_ids) == end - 1
            fill_rows.append(len(input_ids))
            fill_src.append(in_flight[id(seq)])
            input_ids.append(0)
        else:
            input_ids.extend(seq.token_ids[chunk.start : end])
        positions.extend(range(chunk.start, end))
        seq_lens.append(end)
        cu_seqlens.append(cu_seqlens[-1] + chunk.num_tokens)
        tables.append(seq.block_table)
        last_row[i] = cu_seqlens[-1] - 1
    first_rows = tuple(last_row[i] - c.num_tokens + 1 for i, c in enumerate(batch.chunks))
    logits_indices: list[int] = []
    for i, chunk in enumerate(batch.chunks):
        if chunk.samples:
            logits_indices.extend([last_row[i]] * len(chunk.seq.targets))
    keep, kept_indices = _kept_rows(batch, logits_indices, len(input_ids))

    max_blocks = max(len(t) for t in tables)
    padded = [t + [0] * (max_blocks - len(t)) for t in tables]
    if staging is not None:
        return _staged(staging, input_ids, positions, padded, cu_seqlens, seq_lens,
                       logits_indices, layout, batch, block_size, max_blocks,
                       fill_rows, fill_src, first_rows, keep, kept_indices)  # fmt: skip
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
    fills = (None, None)
    if fill_rows:
        fills = tuple(
            torch.tensor(x, dtype=torch.int64, device=device) for x in (fill_rows, fill_src)
        )
    kept = (None, None)
    if keep is not None:
        assert kept_indices is not None
        kept = tuple(
            torch.tensor(x, dtype=torch.int64, device=device) for x in (keep, kept_indices)
        )
    return StepTensors(
        input_ids=torch.tensor(input_ids, dtype=torch.int64, device=device),
        positions=pos.to(device),
        meta=meta,
        logits_indices=torch.tensor(logits_indices, dtype=torch.int64, device=device),
        fill_rows=fills[0],
        fill_src=fills[1],
        first_rows=first_rows,
        keep=kept[0],
        kept_indices=kept[1],
    )


def _kept_rows(
    batch: Batch, logits_indices: list[int], num_rows: int
) -> tuple[list[int] | None, list[int] | None]:
    """``keep`` and ``kept_indices`` of :class:`StepTensors` as host lists (None, None when
    every row is wanted)."""
    if any(c.seq.prompt_logprobs is not None for c in batch.chunks):
        return None, None
    keep = sorted(set(logits_indices))
    if len(keep) == num_rows:
        return None, None
    place = {row: j for j, row in enumerate(keep)}
    return keep, [place[row] for row in logits_indices]


def _staged(
    staging: Staging,
    input_ids: list[int],
    positions: list[int],
    padded: list[list[int]],
    cu_seqlens: list[int],
    seq_lens: list[int],
    logits_indices: list[int],
    layout: list[int],
    batch: Batch,
    block_size: int,
    max_blocks: int,
    fill_rows: list[int],
    fill_src: list[int],
    first_rows: tuple[int, ...],
    keep: list[int] | None,
    kept_indices: list[int] | None,
) -> StepTensors:
    """``build_step`` through ``staging``: slots computed on the host, one int64 and one int32
    upload."""
    slots: list[int] = []
    for i, row in zip(layout, padded, strict=True):
        chunk = batch.chunks[i]
        for p in range(chunk.start, chunk.start + chunk.num_tokens):
            slots.append(row[p // block_size] * block_size + p % block_size)
    ids_t, pos_t, slots_t, logits_t, fill_rows_t, fill_src_t, keep_t, kept_t = staging.upload(
        torch.int64,
        [input_ids, positions, slots, logits_indices, fill_rows, fill_src,
         keep or [], kept_indices or []],
    )  # fmt: skip
    tables_t, cu_t, lens_t = staging.upload(
        torch.int32, [[b for row in padded for b in row], cu_seqlens, seq_lens]
    )
    q_lens = [batch.chunks[i].num_tokens for i in layout]
    meta = AttentionMetadata(
        slot_mapping=slots_t,
        block_tables=tables_t.view(len(padded), max_blocks),
        cu_seqlens_q=cu_t,
        seq_lens=lens_t,
        max_seqlen_q=max(q_lens),
        max_seqlen_k=max(seq_lens),
        num_decodes=sum(n == 1 for n in q_lens),
    )
    return StepTensors(
        input_ids=ids_t,
        positions=pos_t,
        meta=meta,
        logits_indices=logits_t,
        fill_rows=fill_rows_t if fill_rows else None,
        fill_src=fill_src_t if fill_rows else None,
        first_rows=first_rows,
        keep=keep_t if keep is not None else None,
        kept_indices=kept_t if keep is not None else None,
    )
