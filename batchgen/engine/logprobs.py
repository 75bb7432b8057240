"""Logprobs of given tokens (prompt logprobs, score jobs), computed in chunks of positions.

A prompt of P scored positions over a vocabulary of V tokens would need ``P * V`` float32 logits
at once (4k positions x 152k tokens: 2.3 GiB). The vocabulary projection runs here on
``rows_per_chunk(V)`` positions at a time instead: each chunk holds its float32 logits and
their log-softmax, ``2 * CHUNK_BYTES`` (plus, for a bf16 or fp16 model, the half-precision
logits before their cast: at most ``CHUNK_BYTES / 2`` more), whatever the prompt's length. Only
the scored positions are projected: the hidden states of the others are never multiplied by the
LM head.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

# float32 logits per chunk of positions; the peak is about 2.5x this (see the module docstring)
CHUNK_BYTES = 32 * 1024 * 1024


def rows_per_chunk(vocab_size: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Positions projected together: as many as ``chunk_bytes`` of float32 logits hold (>= 1)."""
    return max(1, chunk_bytes // (4 * vocab_size))


def peak_bytes(vocab_size: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """The most bytes of logits :func:`token_logprobs` holds at once (float32 logits, their
    log-softmax, and half-precision logits before the cast)."""
    return int(2.5 * rows_per_chunk(vocab_size, chunk_bytes) * vocab_size * 4)


def token_logprobs(
    compute_logits: Callable[[Tensor], Tensor],
    hidden: Tensor,
    targets: Tensor,
    vocab_size: int,
    top_k: int = 0,
    chunk_bytes: int = CHUNK_BYTES,
) -> tuple[list[float], list[list[tuple[int, float]]]]:
    """The logprob of ``targets[i]`` under the logits of ``hidden[i]``, and the ``top_k`` most
    likely tokens there as (token id, logprob), most likely first.

    ``compute_logits``: the model's LM head (``[R, hidden] -> [R, vocab_size]``); ``hidden``
    ``[P, hidden]``; ``targets`` ``[P]`` int64 on the same device. Returns host lists of length
    P; the LM head sees at most :func:`rows_per_chunk` rows per call.
    """
    lps: list[float] = []
    tops: list[list[tuple[int, float]]] = []
    step = rows_per_chunk(vocab_size, chunk_bytes)
    for start in range(0, hidden.shape[0], step):
        logits = compute_logits(hidden[start : start + step])
        _collect(logits, targets[start : start + step], top_k, lps, tops)
        del logits
    return lps, tops


def _collect(
    logits: Tensor,
    targets: Tensor,
    top_k: int,
    lps: list[float],
    tops: list[list[tuple[int, float]]],
) -> None:
    """Append the rows' logprobs of ``targets`` (and top K) to ``lps`` and ``tops``."""
    full = torch.log_softmax(logits.float(), dim=-1)  # [R, V]; a row kernel
    lps.extend(full.gather(1, targets[:, None]).squeeze(1).tolist())
    if top_k > 0:
        values, ids = full.topk(min(top_k, full.shape[-1]), dim=-1)
        for id_row, value_row in zip(ids.tolist(), values.tolist(), strict=True):
            tops.append(list(zip(id_row, value_row, strict=True)))
    else:
        tops.extend([] for _ in range(targets.shape[0]))
