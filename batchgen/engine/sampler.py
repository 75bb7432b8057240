"""Token sampling: penalties, temperature, top-k / top-p / min-p, and a reproducible draw.

Everything here is a pure function of its inputs and is vectorised over the rows of a step (no
Python loop over rows for the maths), so it runs the same on CPU and CUDA.

Reproducibility. Each sample's noise comes from :mod:`batchgen.engine.noise`: a counter-based hash
of (stream key, position, vocab id), independent of the batch and of earlier steps. The draw is an
exponential race (the Gumbel-max trick in another form): ``argmax_i p_i / E_i`` with independent
``E_i ~ Exp(1)`` picks token ``i`` with probability ``p_i``; it needs no cumulative sum over the
vocabulary, and filtered-out tokens (``p_i = 0``) simply never win.

Filtering without sorting the vocabulary. Top-k, top-p and min-p each keep a prefix of the row in
the order (probability descending, vocab id ascending): a total order, so ties are broken the same
way everywhere. The filtered path ranks only a candidate prefix that provably contains every token
that can survive (``topk`` on a tie-free integer key), and hashes noise only for those candidates.
A native ``SamplerKernels.filtered_draw`` (Triton, on CUDA) finds the same prefixes without
ranking, by searching each cut's probability value (then its vocab id among equal values), and
races over the kept tokens in the same pass as their noise.

Row-wise invariance. A row's result never depends on the other rows: the maths uses elementwise
ops, row kernels (``softmax``, ``log_softmax``), exact reductions (``argmax``, ``amax``, integer
counts), and ``cumsum`` along the row, never a float ``sum``/``logsumexp`` over [S, V] whose
summation order may follow the batch shape. Padding a row to a wider candidate set (because another
row needs more) only appends zeros.
"""

from __future__ import annotations

import itertools
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from batchgen.engine.logprobs import top_k_rows
from batchgen.engine.noise import (
    TORCH_FORMULA,
    SamplerKernels,
    exponential_at,
    row_state,
)
from batchgen.engine.request import SamplingParams
from batchgen.engine.staging import Staging

# ---------------------------------------------------------------------------------------------
# The per-step batch of sampling settings
# ---------------------------------------------------------------------------------------------


def _pad_ids(seqs: Sequence[Sequence[int]], pad: int) -> Tensor:
    """Right-pad token id sequences into [S, L] int64 (CPU) with ``pad``; L >= 1."""
    lengths = [len(s) for s in seqs]
    width = max(lengths, default=0) or 1
    out = torch.full((len(seqs), width), pad, dtype=torch.int64)  # [S, L]
    if sum(lengths):
        # array('q') reads Python ints about twice as fast as torch.tensor(list).
        flat = torch.frombuffer(array("q", itertools.chain.from_iterable(seqs)), dtype=torch.int64)
        filled = torch.arange(width) < torch.tensor(lengths)[:, None]  # [S, L] bool
        out.masked_scatter_(filled, flat)  # row-major: each row's ids in order
    return out


def _index_or_none(rows: list[int], total: int, device: torch.device | str) -> Tensor | None:
    """[R] int64 index tensor for ``rows``, or None when they are all of ``range(total)``."""
    if len(rows) == total:
        return None
    return torch.tensor(rows, dtype=torch.int64).to(device)


@dataclass
class SamplingBatch:
    """Sampling settings for the S samples drawn in one step, one row each; build with from_rows.

    The Python flags let the common cases skip work (no ranking when no row filters, no noise
    when every row is greedy, no penalty tensors when no row has a penalty). Flags about filtering
    consider the non-greedy rows only: greedy rows ignore top-k/top-p/min-p.
    """

    temperature: Tensor  # [S] float32, 0 = greedy
    top_p: Tensor  # [S] float32
    top_k: Tensor  # [S] int64, 0 = off
    min_p: Tensor  # [S] float32
    repetition_penalty: Tensor  # [S] float32
    presence_penalty: Tensor  # [S] float32
    frequency_penalty: Tensor  # [S] float32
    rng_key: Tensor  # [S] int64, the sample's stream key
    position: Tensor  # [S] int64, index (in prompt + output) of the token being drawn
    prompt_ids: Tensor | None  # [S, Lp] int64 padded with vocab_size; set iff any_repetition
    output_ids: Tensor | None  # [S, Lo] int64 padded with vocab_size; set iff any_penalty
    vocab_size: int
    all_greedy: bool
    any_greedy: bool
    any_penalty: bool
    any_repetition: bool  # some row has repetition_penalty != 1
    any_additive_penalty: bool  # some row has a presence or frequency penalty != 0
    any_top_k: bool  # some non-greedy row has 0 < top_k < vocab_size
    any_top_p: bool  # some non-greedy row has top_p < 1
    any_min_p: bool  # some non-greedy row has min_p > 0
    # Row partitions, made on the host so that no device sync is needed. Indices are None when
    # the part is every row of its parent (no gather needed).
    random_rows: Tensor | None  # [R] rows of the batch that are not greedy
    filtered_rows: Tensor | None  # [Q] rows of the random part using top-k, top-p or min-p
    plain_rows: Tensor | None  # [R - Q] rows of the random part that only use temperature
    any_filtered: bool
    any_plain: bool
    # Candidates per filtered row when every filtered row has a top-k (the largest such k); None
    # when some row's candidate count depends on its probabilities (one host sync per step).
    candidate_width: int | None

    @property
    def num_rows(self) -> int:
        return self.temperature.shape[0]

    @classmethod
    def from_rows(
        cls,
        params: list[SamplingParams],
        rng_keys: list[int],
        positions: list[int],
        prompt_ids: list[Sequence[int]] | None,
        output_ids: list[Sequence[int]] | None,
        vocab_size: int,
        device: torch.device | str = "cpu",
        staging: Staging | None = None,
    ) -> SamplingBatch:
        """Pack per-sample settings into tensors on ``device`` (a few host-to-device copies;
        with ``staging``, the engine's, two packed asynchronous ones, and the penalties' ids).

        ``prompt_ids`` / ``output_ids`` (the sample's prompt and its tokens so far) are read only
        when some row has a penalty; they may be None otherwise.
        """
        n = len(params)
        if not (len(rng_keys) == len(positions) == n):
            raise ValueError("params, rng_keys and positions must have one entry per row")
        if n == 0:
            raise ValueError("a sampling batch needs at least one row")

        # A step's rows mostly share one SamplingParams (a job's settings): then each setting is
        # read once and repeated (reading it per row was about half of this method's time).
        one = params[0] if all(p is params[0] for p in params) else None

        def per_row(
            get: Callable[[SamplingParams], Any], rows: Sequence[int] | None = None
        ) -> list:
            """get(params[i]) for every i in rows (default: every row)."""
            if one is not None:
                return [get(one)] * (n if rows is None else len(rows))
            return [get(params[i]) for i in (range(n) if rows is None else rows)]

        greedy = per_row(lambda p: p.temperature == 0.0)
        random_rows = [i for i, g in enumerate(greedy) if not g]
        uses_top_k = per_row(lambda p: 0 < p.top_k < vocab_size, random_rows)
        uses_top_p = per_row(lambda p: p.top_p < 1.0, random_rows)
        uses_min_p = per_row(lambda p: p.min_p > 0.0, random_rows)
        filtered = [any(u) for u in zip(uses_top_k, uses_top_p, uses_min_p, strict=True)]
        distinct = params if one is None else [one]
        any_repetition = any(p.repetition_penalty != 1.0 for p in distinct)
        any_additive = any(
            p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p in distinct
        )
        any_penalty = any(p.needs_history for p in distinct)

        float_rows = [
            per_row(lambda p: p.temperature),
            per_row(lambda p: p.top_p),
            per_row(lambda p: p.min_p),
            per_row(lambda p: p.repetition_penalty),
            per_row(lambda p: p.presence_penalty),
            per_row(lambda p: p.frequency_penalty),
        ]
        int_rows = [per_row(lambda p: p.top_k), list(rng_keys), list(positions)]
        filtered_sub = [j for j, f in enumerate(filtered) if f]
        plain_sub = [j for j, f in enumerate(filtered) if not f]
        # Row partitions: None when the part is every row of its parent.
        parts = [
            (random_rows, n),
            (filtered_sub, len(random_rows)),
            (plain_sub, len(random_rows)),
        ]
        if staging is not None:
            chain = itertools.chain.from_iterable
            (floats,) = staging.upload(torch.float32, [list(chain(float_rows))])
            floats = floats.view(len(float_rows), n)  # [6, S]
            indexed = [rows for rows, total in parts if len(rows) != total]
            ints, *index_t = staging.upload(torch.int64, [list(chain(int_rows)), *indexed])
            ints = ints.view(len(int_rows), n)  # [3, S]
            row_sets = [index_t.pop(0) if len(rows) != total else None for rows, total in parts]
        else:
            floats = torch.tensor(float_rows, dtype=torch.float32).to(device)  # [6, S]
            ints = torch.tensor(int_rows, dtype=torch.int64).to(device)  # [3, S]
            row_sets = [_index_or_none(rows, total, device) for rows, total in parts]

        prompt_t = output_t = None
        if any_penalty:
            if output_ids is None or (any_repetition and prompt_ids is None):
                raise ValueError("penalties need the rows' prompt_ids and output_ids")
            if len(output_ids) != n or (any_repetition and len(prompt_ids) != n):
                raise ValueError("prompt_ids and output_ids must have one entry per row")
            output_t = _pad_ids(output_ids, vocab_size).to(device)
            if any_repetition:
                prompt_t = _pad_ids(prompt_ids, vocab_size).to(device)

        width = None
        if all(uses_top_k[j] for j in filtered_sub):
            tops = per_row(lambda p: p.top_k, [random_rows[j] for j in filtered_sub])
            width = max(tops, default=None)
        return cls(
            temperature=floats[0],
            top_p=floats[1],
            top_k=ints[0],
            min_p=floats[2],
            repetition_penalty=floats[3],
            presence_penalty=floats[4],
            frequency_penalty=floats[5],
            rng_key=ints[1],
            position=ints[2],
            prompt_ids=prompt_t,
            output_ids=output_t,
            vocab_size=vocab_size,
            all_greedy=not random_rows,
            any_greedy=len(random_rows) < n,
            any_penalty=any_penalty,
            any_repetition=any_repetition,
            any_additive_penalty=any_additive,
            any_top_k=any(uses_top_k),
            any_top_p=any(uses_top_p),
            any_min_p=any(uses_min_p),
            random_rows=row_sets[0],
            filtered_rows=row_sets[1],
            plain_rows=row_sets[2],
            any_filtered=bool(filtered_sub),
            any_plain=bool(plain_sub),
            candidate_width=width,
        )


@dataclass
class SampleOutput:
    tokens: Tensor  # [S] int64
    logprobs: Tensor | None  # [S] float32: log_softmax of the raw logits (before penalties) at
    #                          the token; None when sample() was asked not to compute them
    # with top_logprobs=K > 0: the K most likely tokens of the same distribution, most likely
    # first (ties: lower id first is not promised; topk's order)
    top_ids: Tensor | None = None  # [S, K] int64
    top_logprobs: Tensor | None = None  # [S, K] float32


# ---------------------------------------------------------------------------------------------
# Penalties
# ---------------------------------------------------------------------------------------------


def _counts(ids: Tensor, vocab_size: int) -> Tensor:
    """Occurrences of each vocab id per row: [S, V] float32 from [S, L] ids padded with V."""
    counts = torch.zeros(ids.shape[0], vocab_size + 1, dtype=torch.float32, device=ids.device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))  # [S, V + 1]
    return counts[:, :vocab_size]


def apply_penalties(logits: Tensor, batch: SamplingBatch) -> Tensor:
    """Repetition, then frequency and presence penalties; returns new [S, V] logits.

    - repetition (HF / vLLM): for tokens seen in prompt or output, positive logits are divided by
      the penalty and negative ones multiplied by it;
    - frequency and presence (OpenAI): over output tokens only, subtract
      ``frequency * count + presence * (count > 0)``.
    Rows whose penalties are neutral (1, 0, 0) come out bit-identical: x / 1, x * 1 and x - 0 are
    exact, so a row's result never depends on its neighbours' settings.
    """
    if not batch.any_penalty:
        return logits
    vocab_size = logits.shape[1]
    assert batch.output_ids is not None, "SamplingBatch built without output_ids"
    out_counts = _counts(batch.output_ids, vocab_size)  # [S, V]
    out_seen = out_counts > 0  # [S, V] bool
    if batch.any_repetition:
        assert batch.prompt_ids is not None, "SamplingBatch built without prompt_ids"
        seen = torch.zeros(
            logits.shape[0], vocab_size + 1, dtype=torch.bool, device=logits.device
        ).scatter_(1, batch.prompt_ids, True)[:, :vocab_size]  # [S, V]
        seen |= out_seen
        r = batch.repetition_penalty[:, None]  # [S, 1]
        penalised = torch.where(logits > 0, logits / r, logits * r)  # [S, V]
        logits = torch.where(seen, penalised, logits)
    if batch.any_additive_penalty:
        logits = logits - batch.frequency_penalty[:, None] * out_counts
        logits = logits - batch.presence_penalty[:, None] * out_seen.to(logits.dtype)
    return logits


# ---------------------------------------------------------------------------------------------
# Drawing
# ---------------------------------------------------------------------------------------------


def _take(x: Tensor, rows: Tensor | None) -> Tensor:
    """Rows ``rows`` of ``x`` (all of it when None)."""
    return x if rows is None else x.index_select(0, rows)


_ID_BITS = 31  # vocab ids (and vocab sizes) below 2**31
_ID_MASK = (1 << _ID_BITS) - 1


def _draw_plain(
    logits: Tensor,
    temperature: Tensor,
    rng_key: Tensor,
    position: Tensor,
    kernels: SamplerKernels,
) -> Tensor:
    """Draw from softmax(logits / temperature) over the whole vocabulary: [R, V] -> [R] int64."""
    if (
        logits.device.type == kernels.device_type
        and logits.dtype == torch.float32
        and kernels.race_draw is not None
    ):
        # One fused native pass: the same race on unnormalised weights exp(s - max s) (the
        # argmax is scale-invariant), so it picks the same token up to float rounding in ties.
        state = row_state(rng_key, position)  # [R]
        return kernels.race_draw(logits.contiguous(), temperature.contiguous(), state)
    probs = torch.softmax(logits / temperature[:, None], dim=-1)  # [R, V]
    ids = torch.arange(logits.shape[1], dtype=torch.int64, device=logits.device)[None, :]  # [1, V]
    return probs.div_(exponential_at(rng_key, position, ids, kernels)).argmax(dim=-1)  # [R]


def _candidate_limits(
    probs: Tensor,
    p_max: Tensor,
    top_k: Tensor,
    top_p: Tensor,
    min_p: Tensor,
    use_top_k: bool,
    use_top_p: bool,
    use_min_p: bool,
) -> tuple[Tensor, Tensor]:
    """How many leading tokens (in the ranking) each row must examine, and which rows use top-k.

    probs: [R, V]; p_max, top_k, top_p, min_p: [R]. Returns (limit [R] int64, k_on [R] bool).

    - top-k rows: exactly k candidates (top-p, if any, renormalises over their mass).
    - top-p rows without top-k: the tokens with ``p >= t``, ``t = (1 - top_p) * p_max / (2V)``.
      The tokens below ``t`` weigh less than ``V * t <= (1 - top_p) / 2``, so the tokens at or
      above it already hold more than ``top_p`` and contain the whole nucleus (the margin, at
      least ``(1 - top_p) / 2``, absorbs rounding in the cumulative sum).
    - min-p rows (unless top-k and top-p both apply): at most the ``p >= min_p * p_max`` tokens.
    Counts of a boolean mask are exact, so limits do not depend on the batch.
    """
    vocab_size = probs.shape[1]
    limit = torch.full_like(top_k, vocab_size)  # [R] int64
    k_on = (
        (top_k > 0) & (top_k < vocab_size)
        if use_top_k
        else torch.zeros_like(top_p, dtype=torch.bool)
    )
    if use_top_k:
        limit = torch.where(k_on, top_k, limit)
    if use_top_p:
        floor = (1.0 - top_p) * p_max / (2.0 * vocab_size)  # [R]
        nucleus_bound = (probs >= floor[:, None]).sum(dim=-1)  # [R]
        limit = torch.where(~k_on & (top_p < 1.0), nucleus_bound, limit)
    if use_min_p:
        kept = (probs >= (min_p * p_max)[:, None]).sum(dim=-1)  # [R]
        shrink = (min_p > 0.0) & ~(k_on & (top_p < 1.0))
        limit = torch.where(shrink, torch.minimum(limit, kept), limit)
    return limit, k_on


def _filtered_candidates(
    scaled: Tensor,
    top_k: Tensor,
    top_p: Tensor,
    min_p: Tensor,
    use_top_k: bool,
    use_top_p: bool,
    use_min_p: bool,
    width: int | None,
) -> tuple[Tensor, Tensor]:
    """Top-k, then top-p, then min-p: [R, V] scaled logits -> (ids [R, W] int64, probabilities
    [R, W] float32), the ranked candidates with the filtered-out ones at probability 0.

    Tokens are ranked by (probability desc, vocab id asc) through one int64 key per token,
    ``prob_bits << 31 | (V - 1 - id)`` (the bits of a non-negative float32 order like the float):
    keys are distinct, so ``topk`` has no ties to break and returns the exact ranking prefix, and
    probability and id are decoded from the key without a gather. Only the first ``W`` ranks are
    examined (W = ``width`` or the largest row limit: one host sync); ranks past a row's own limit
    are zeroed, so the result does not depend on ``W``.
    """
    vocab_size = scaled.shape[1]
    assert vocab_size <= _ID_MASK, "vocabulary too large for the ranking key"
    probs = torch.softmax(scaled, dim=-1)  # [R, V]
    p_max = probs.amax(dim=-1)  # [R], exact
    limit, k_on = _candidate_limits(
        probs, p_max, top_k, top_p, min_p, use_top_k, use_top_p, use_min_p
    )  # [R], [R]
    if width is None:
        width = int(limit.max())  # the only host sync of a step
    width = max(1, min(width, vocab_size))

    ids = torch.arange(vocab_size, dtype=torch.int64, device=scaled.device)  # [V]
    key = probs.view(torch.int32).to(torch.int64)  # [R, V], probs >= 0 so bits >= 0
    key.bitwise_left_shift_(_ID_BITS).add_(vocab_size - 1 - ids)  # [R, V]
    ranked = key.topk(width, dim=-1, sorted=True).values  # [R, W], descending
    cand_ids = (vocab_size - 1) - (ranked & _ID_MASK)  # [R, W] int64
    cand_p = (ranked >> _ID_BITS).to(torch.int32).view(torch.float32)  # [R, W], descending
    rank = torch.arange(width, device=scaled.device)  # [W]
    cand_p = cand_p.masked_fill(rank[None, :] >= limit[:, None], 0.0)  # top-k and bounds

    if use_top_p:
        cum = cand_p.cumsum(dim=-1)  # [R, W], along the row only
        # Top-p renormalises over what top-k kept; without top-k the whole row (mass 1).
        mass = torch.where(k_on, cum[:, -1], 1.0)  # [R]
        before = torch.nn.functional.pad(cum[:, :-1], (1, 0))  # [R, W] exclusive cumsum
        # The smallest prefix reaching top_p: keep a token iff the mass before it is short of
        # top_p (the top token has 0 before it: always kept); top_p >= 1 keeps everything.
        short = (before < (top_p * mass)[:, None]) | (top_p >= 1.0)[:, None]  # [R, W]
        cand_p = cand_p.masked_fill(~short, 0.0)
    if use_min_p:
        cand_p = cand_p.masked_fill(cand_p < (min_p * p_max)[:, None], 0.0)
    return cand_ids, cand_p


def _draw_filtered(
    logits: Tensor,
    temperature: Tensor,
    top_k: Tensor,
    top_p: Tensor,
    min_p: Tensor,
    rng_key: Tensor,
    position: Tensor,
    use_top_k: bool,
    use_top_p: bool,
    use_min_p: bool,
    width: int | None,
    kernels: SamplerKernels,
) -> Tensor:
    """Draw from softmax(logits / temperature) filtered by top-k, top-p and min-p:
    [R, V] -> [R] int64."""
    if (
        logits.device.type == kernels.device_type
        and logits.dtype == torch.float32
        and kernels.filtered_draw is not None
    ):
        # One native kernel per row: the same kept set found by searching probability values
        # instead of ranking, and the same race over it (equal up to float rounding in near ties).
        state = row_state(rng_key, position)  # [R]
        return kernels.filtered_draw(logits, temperature, top_k, top_p, min_p, state)
    scaled = logits / temperature[:, None]  # [R, V]
    cand_ids, cand_p = _filtered_candidates(
        scaled, top_k, top_p, min_p, use_top_k, use_top_p, use_min_p, width
    )  # [R, W], [R, W]
    # Filtered probabilities need no renormalisation: the race's argmax is scale-invariant.
    race = cand_p.div_(exponential_at(rng_key, position, cand_ids, kernels))  # [R, W]
    return cand_ids.gather(1, race.argmax(dim=-1, keepdim=True)).squeeze(1)  # [R]


def _draw(logits: Tensor, batch: SamplingBatch, kernels: SamplerKernels) -> Tensor:
    """Tokens for the non-greedy rows: [R, V] penalised logits -> [R] int64."""
    rows = batch.random_rows
    temperature = _take(batch.temperature, rows)  # [R]
    top_k, top_p = _take(batch.top_k, rows), _take(batch.top_p, rows)
    min_p = _take(batch.min_p, rows)
    key, pos = _take(batch.rng_key, rows), _take(batch.position, rows)
    if not batch.any_filtered:
        return _draw_plain(logits, temperature, key, pos, kernels)
    flags = (batch.any_top_k, batch.any_top_p, batch.any_min_p, batch.candidate_width, kernels)
    if not batch.any_plain:
        return _draw_filtered(logits, temperature, top_k, top_p, min_p, key, pos, *flags)
    # Mixed: rank only the rows that filter; put both parts back in place.
    f, p = batch.filtered_rows, batch.plain_rows
    tokens = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)  # [R]
    tokens[f] = _draw_filtered(
        _take(logits, f), _take(temperature, f), _take(top_k, f), _take(top_p, f),
        _take(min_p, f), _take(key, f), _take(pos, f), *flags,
    )  # fmt: skip
    tokens[p] = _draw_plain(
        _take(logits, p), _take(temperature, p), _take(key, p), _take(pos, p), kernels
    )
    return tokens


def sample(
    logits: Tensor,
    batch: SamplingBatch,
    logprobs: bool = True,
    kernels: SamplerKernels = TORCH_FORMULA,
    top_logprobs: int = 0,
) -> SampleOutput:
    """Draw one token per row.

    logits: [S, V] raw model logits (cast to float32). Penalties apply to every row, greedy ones
    included; greedy rows then take the first maximum. Other rows: divide by temperature, softmax,
    top-k, top-p (smallest set with mass >= top_p, the top token always kept), min-p (keep
    ``p >= min_p * p_max``), then the exponential race ``argmax p / E`` with ``E`` hashed from
    (rng_key, position, vocab id). ``logprobs`` are those of the raw logits (vLLM's default);
    ``logprobs=False`` skips them (a pass over [S, V]) and leaves ``SampleOutput.logprobs`` None.
    ``top_logprobs=K`` (with ``logprobs``) adds the K most likely tokens of that distribution.
    ``kernels``: native versions of the noise and the plain draw (default: the PyTorch formula).
    """
    raw = logits.float()  # [S, V]
    logits = apply_penalties(raw, batch)  # [S, V]
    if batch.all_greedy:
        tokens = logits.argmax(dim=-1)  # [S]
    elif not batch.any_greedy:
        tokens = _draw(logits, batch, kernels)  # [S]
    else:
        tokens = logits.argmax(dim=-1)  # [S]; the random rows are overwritten
        tokens[batch.random_rows] = _draw(_take(logits, batch.random_rows), batch, kernels)
    # log_softmax is a row kernel (a row's value does not depend on the batch shape), unlike
    # logsumexp; the [S, V] intermediate costs one pass.
    if not logprobs:
        return SampleOutput(tokens=tokens, logprobs=None)
    full = torch.log_softmax(raw, dim=-1)  # [S, V]
    lp = full.gather(1, tokens[:, None]).squeeze(1)  # [S]
    if top_logprobs <= 0:
        return SampleOutput(tokens=tokens, logprobs=lp)
    values, ids = top_k_rows(full, top_logprobs)  # [S, K]
    return SampleOutput(tokens=tokens, logprobs=lp, top_ids=ids, top_logprobs=values)
