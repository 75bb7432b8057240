"""Logprobs of given tokens (prompt logprobs, score jobs), computed in chunks of positions.

A prompt of P scored positions over a vocabulary of V tokens would need ``P * V`` float32 logits
at once (4k positions x 152k tokens: 2.3 GiB, twice that with their log-softmax). The
vocabulary projection runs here on ``rows_per_chunk(V)`` positions at a time instead (27 of a
152k vocabulary): a chunk holds ``CHUNK_BYTES`` of float32 logits, as much again for their
log-softmax, at most as much for ``topk``'s temporaries, and on a GPU half as much for the
half-precision logits before their cast: :data:`LOGITS_PEAK_BYTES` (56 MiB) whatever the prompt's
length. Measured on a CPU (a 4k-token prompt, 152,064 tokens, top 5), a job's peak memory grows
by 85 to 135 MiB over the same job without prompt logprobs: the chunks, the results themselves
(4k entries as Python objects, then Arrow) and what the CPU's malloc keeps of freed chunks
(:mod:`batchgen.host_memory`). Only the scored positions are projected: the hidden states of the
others never meet the LM head.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

# float32 logits per chunk of positions, and what a chunk holds at most in all
CHUNK_BYTES = 16 * 1024 * 1024
LOGITS_PEAK_BYTES = CHUNK_BYTES * 7 // 2


def rows_per_chunk(vocab_size: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Positions projected together: as many as ``chunk_bytes`` of float32 logits hold (>= 1)."""
    return max(1, chunk_bytes // (4 * vocab_size))


def token_logprobs(
    compute_logits: Callable[[Tensor], Tensor],
    hidden: Tensor,
    targets: Tensor,
    vocab_size: int,
    top_k: int = 0,
    chunk_bytes: int | None = None,
) -> tuple[list[float], list[list[tuple[int, float]]]]:
    """The logprob of ``targets[i]`` under the logits of ``hidden[i]``, and the ``top_k`` most
    likely tokens there as (token id, logprob), most likely first.

    ``compute_logits``: the model's LM head (``[R, hidden] -> [R, vocab_size]``); ``hidden``
    ``[P, hidden]``; ``targets`` ``[P]`` int64 on the same device. Returns host lists of length
    P; the LM head sees at most :func:`rows_per_chunk` rows per call (``chunk_bytes``
    default: :data:`CHUNK_BYTES`).
    """
    lps: list[float] = []
    tops: list[list[tuple[int, float]]] = []
    chunk_bytes = CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    step = rows_per_chunk(vocab_size, chunk_bytes)
    for start in range(0, hidden.shape[0], step):
        logits = compute_logits(hidden[start : start + step])
        _collect(logits, targets[start : start + step], top_k, lps, tops, chunk_bytes)
        del logits
    return lps, tops


def _collect(
    logits: Tensor,
    targets: Tensor,
    top_k: int,
    lps: list[float],
    tops: list[list[tuple[int, float]]],
    chunk_bytes: int,
) -> None:
    """Append the rows' logprobs of ``targets`` (and top K) to ``lps`` and ``tops``."""
    full = torch.log_softmax(logits.float(), dim=-1)  # [R, V]; a row kernel
    lps.extend(full.gather(1, targets[:, None]).squeeze(1).tolist())
    if top_k <= 0:
        tops.extend([] for _ in range(targets.shape[0]))
        return
    values, ids = top_k_rows(full, top_k, chunk_bytes)
    for id_row, value_row in zip(ids.tolist(), values.tolist(), strict=True):
        tops.append(list(zip(id_row, value_row, strict=True)))


def top_k_rows(full: Tensor, k: int, chunk_bytes: int | None = None) -> tuple[Tensor, Tensor]:
    """``full.topk(k, dim=-1)`` (values, ids; ``k`` capped at the row width), on as many rows at
    a time as ``chunk_bytes`` of (value, index) pairs hold: a CPU's ``topk`` copies each row as
    pairs of 16 bytes a token (256 rows of a 152k vocabulary at once would be 620 MiB)."""
    chunk_bytes = CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    k = min(k, full.shape[-1])
    step = max(1, chunk_bytes // (16 * full.shape[-1]))
    parts = [full[i : i + step].topk(k, dim=-1) for i in range(0, full.shape[0], step)]
    if len(parts) == 1:
        return parts[0].values, parts[0].indices
    return torch.cat([p.values for p in parts]), torch.cat([p.indices for p in parts])
