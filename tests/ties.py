"""Compare two sets of generated samples, exempting (and counting) near-tie flips.

docs/job-file.md allows the tokens of ``(id, sample_index)`` to differ between runs only "where
floating-point differences between batch shapes flip a near-tie". This module makes that
allowance measurable instead of hiding it behind a seed chosen to avoid ties:

- Equal token lists are equal.
- Otherwise, at the first position where the two lists differ, an independent reference
  (Hugging Face transformers in float32, teacher-forced on the prompt and the common prefix)
  scores every token the way the sampler ranks them: the logit for greedy samples, the race score
  ``log p_i - log E_i`` for random ones (``E_i``: the sample's own exponential noise at that
  position, from :func:`batchgen.engine.noise.uniform_noise`). The divergence is a near-tie iff
  both tokens are the reference's top two and their scores are within ``eps`` (relative to the
  larger magnitude, at least 1). Anything else fails the comparison.
- The exempt share of samples must stay below ``max_share``.

Every comparison adds its counts to :data:`STATS`; ``tests/conftest.py`` prints the totals at the
end of the session (the near-tie exemption rate).

Only what the tests use is supported: no repetition/presence/frequency penalties, no stop strings
(a sample that ends earlier than the other is a failure, not a tie), and filters (top-k, top-p,
min-p) are checked for the two tokens only: a flip at a filter boundary whose cumulative mass is
within ``eps`` of ``top_p`` also counts as a near-tie.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

TIE_EPS = 1e-3  # relative difference of two float32 scores that batch-shape rounding can flip
MAX_SHARE = 0.05  # at most this share of the samples compared may be exempt


@dataclass
class TieStats:
    samples: int = 0  # samples compared
    exempt: int = 0  # samples whose tokens differ after a near-tie
    positions: int = 0  # tokens compared (up to the first divergence, or the whole sample)

    def add(self, other: TieStats) -> None:
        self.samples += other.samples
        self.exempt += other.exempt
        self.positions += other.positions


STATS = TieStats()  # summed over the session, printed by conftest


@functools.lru_cache(maxsize=4)
def _reference(model_dir: str) -> tuple[Any, Any]:
    from batchgen.model.loader import load_tokenizer
    from tests.hf_reference import hf_model

    return hf_model(model_dir), load_tokenizer(model_dir)


def _scores(
    logits: torch.Tensor, sampling: Mapping[str, Any], key: int, position: int
) -> torch.Tensor:
    """[V] scores whose argmax is the sampler's choice (before filtering)."""
    from batchgen.engine.noise import uniform_noise

    temperature = float(sampling.get("temperature", 1.0))
    if temperature == 0.0:
        return logits
    logp = torch.log_softmax(logits / temperature, dim=-1)
    u = uniform_noise(
        torch.tensor([key], dtype=torch.int64),
        torch.tensor([position], dtype=torch.int64),
        logits.shape[-1],
    )[0]
    exponential = u.neg().log1p_().neg_()  # the sampler's E = -log(1 - u), in float32
    return logp - exponential.log()


def _at_filter_boundary(
    logits: torch.Tensor, sampling: Mapping[str, Any], tokens: Sequence[int], eps: float
) -> bool:
    """Whether top-p could keep or drop one of ``tokens`` depending on rounding: the mass
    before it (in the probability ranking) is within ``eps`` of ``top_p``."""
    top_p = float(sampling.get("top_p", 1.0))
    temperature = float(sampling.get("temperature", 1.0))
    if top_p >= 1.0 or temperature == 0.0:
        return False
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    order = torch.argsort(probs, descending=True, stable=True)
    before = torch.cumsum(probs[order], 0) - probs[order]
    rank = {int(t): i for i, t in enumerate(order.tolist())}
    return any(abs(float(before[rank[t]]) - top_p) <= eps for t in tokens)


def compare_samples(
    got: Sequence[Mapping[str, Any]],
    ref: Sequence[Mapping[str, Any]],
    *,
    model: str | Path,
    prompts: Mapping[Any, str],
    sampling: Mapping[str, Any],
    eps: float = TIE_EPS,
    max_share: float = MAX_SHARE,
) -> TieStats:
    """Assert that ``got`` and ``ref`` (result rows: ``id``, ``sample_index``, ``token_ids``)
    hold the same samples with the same tokens, up to near-tie flips; return the counts.

    ``prompts``: id -> prompt text (tokenized as batchgen does); ``sampling``: the job's
    ``sampling`` section (``seed``, ``temperature``, ``top_p`` ...).
    """
    from batchgen.engine.noise import rng_key

    for key in ("repetition_penalty", "presence_penalty", "frequency_penalty"):
        assert sampling.get(key) in (None, 0.0, 1.0), f"compare_samples does not model {key}"
    got_by = {(r["id"], r["sample_index"]): list(r["token_ids"]) for r in got}
    ref_by = {(r["id"], r["sample_index"]): list(r["token_ids"]) for r in ref}
    assert len(got_by) == len(got) and len(ref_by) == len(ref), "a sample appears twice"
    assert got_by.keys() == ref_by.keys(), (
        f"different samples: {sorted(got_by.keys() ^ ref_by.keys(), key=str)[:5]}"
    )
    stats = TieStats(samples=len(ref_by))
    failures: list[str] = []
    for (row_id, k), want in sorted(ref_by.items(), key=lambda kv: str(kv[0])):
        have = got_by[(row_id, k)]
        if have == want:
            stats.positions += len(want)
            continue
        p = next(
            (i for i, (a, b) in enumerate(zip(have, want, strict=False)) if a != b),
            min(len(have), len(want)),
        )
        stats.positions += p
        where = f"id {row_id!r} sample {k} at output position {p}"
        if p == min(len(have), len(want)):
            failures.append(f"{where}: one sample ends early ({len(have)} vs {len(want)} tokens)")
            continue
        hf, tokenizer = _reference(str(model))
        prompt_ids = list(tokenizer(prompts[row_id], add_special_tokens=True)["input_ids"])
        context = prompt_ids + want[:p]
        with torch.no_grad():
            logits = hf(torch.tensor([context])).logits[0, -1].float()  # [V]
        key = rng_key(int(sampling.get("seed", 0)), row_id, k)
        scores = _scores(logits, sampling, key, len(context))
        top2 = torch.topk(scores, 2)
        pair = {have[p], want[p]}
        tied = set(top2.indices.tolist()) == pair and float(
            top2.values[0] - top2.values[1]
        ) <= eps * max(1.0, float(top2.values.abs().max()))
        if tied or _at_filter_boundary(logits, sampling, sorted(pair), eps):
            stats.exempt += 1
        else:
            s_have, s_want = float(scores[have[p]]), float(scores[want[p]])
            failures.append(
                f"{where}: {have[p]} vs {want[p]} with reference scores {s_have:.6g} vs "
                f"{s_want:.6g} (top two: {top2.indices.tolist()}, {top2.values.tolist()})"
            )
    assert not failures, f"{len(failures)} samples differ beyond a near-tie: " + "; ".join(
        failures[:5]
    )
    assert stats.exempt <= max_share * stats.samples, (
        f"{stats.exempt} of {stats.samples} samples differ after a near-tie "
        f"(more than {max_share:.0%})"
    )
    STATS.add(stats)  # only comparisons that passed count towards the session's rate
    return stats
