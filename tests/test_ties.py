"""The near-tie comparison of tests/ties.py: its reference ranks tokens as batchgen's sampler
does, it exempts a flip between the top two only within ``eps``, never a token outside them, and
it fails on real differences."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

from batchgen.engine.noise import rng_key
from batchgen.tiny_model import make_prompts
from tests.jobkit import run_job, write_job
from tests.ties import STATS, TIE_EPS, _reference, _scores, compare_samples


def reference_scores(
    model: Path, prompt: str, sampling: dict[str, Any], row: dict[str, Any], p: int
) -> torch.Tensor:
    """[V] the reference's scores for output position ``p`` of ``row`` (teacher-forced)."""
    hf, tokenizer = _reference(str(model))
    context = list(tokenizer(prompt, add_special_tokens=True)["input_ids"]) + row["token_ids"][:p]
    with torch.no_grad():
        logits = hf(torch.tensor([context])).logits[0, -1].float()
    key = rng_key(sampling["seed"], row["id"], row["sample_index"])
    return _scores(logits, sampling, key, len(context))


def tie_scale(scores: torch.Tensor) -> float:
    """What compare_samples multiplies ``eps`` by for these scores."""
    return max(1.0, float(torch.topk(scores, 2).values.abs().max()))


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_compare_samples_accepts_equal_and_rejects_changed_tokens(
    tiny_model, tmp_path, temperature, monkeypatch
) -> None:
    # The session's exemption rate is about real runs: what this test feeds in is left out.
    for field in ("samples", "exempt", "positions"):
        monkeypatch.setattr(STATS, field, getattr(STATS, field))
    model = tiny_model("llama")
    prompts = make_prompts(3, seed=0, min_words=3, max_words=8)
    sampling = {"temperature": temperature, "n": 2, "max_tokens": 6, "seed": 0, "ignore_eos": True}
    rows = run_job(write_job(tmp_path, model, prompts, sampling=sampling))
    by_id = dict(enumerate(prompts))
    before = STATS.samples
    stats = compare_samples(rows, rows, model=model, prompts=by_id, sampling=sampling)
    assert (stats.samples, stats.exempt, stats.positions) == (6, 0, 36)
    assert STATS.samples == before + 6

    # The reference ranks as the sampler chose: batchgen's token is the reference's first, or
    # a near-tie with it. Remember, per (row, position), the lead of the first over the second.
    leads: dict[tuple[int, int], tuple[float, torch.Tensor]] = {}
    for i, row in enumerate(rows):
        for p, token in enumerate(row["token_ids"]):
            scores = reference_scores(model, by_id[row["id"]], sampling, row, p)
            top = torch.topk(scores, 2)
            gap = float(top.values[0] - top.values[1])
            if token == int(top.indices[0]):
                leads[(i, p)] = (gap / tie_scale(scores), scores)
            else:
                assert token == int(top.indices[1]), (i, p, token, top.indices.tolist())
                assert gap <= TIE_EPS * tie_scale(scores), (i, p, gap)
    # Change the token where the model was surest: no rounding could have flipped it.
    (i, p), (lead, scores) = max(leads.items(), key=lambda kv: kv[1][0])
    assert lead > 10 * TIE_EPS
    runner_up = int(torch.topk(scores, 2).indices[1])
    last = int(scores.argmin())

    def changed_to(token: int) -> list[dict[str, Any]]:
        out = copy.deepcopy(rows)
        out[i]["token_ids"][p] = token
        return out

    def compare(got: list[dict[str, Any]], **kwargs: Any) -> Any:
        return compare_samples(got, rows, model=model, prompts=by_id, sampling=sampling, **kwargs)

    counted = STATS.samples
    where = f"id {rows[i]['id']!r} sample {rows[i]['sample_index']} at output position {p}"
    with pytest.raises(AssertionError, match=f"differ beyond a near-tie: {where}"):
        compare(changed_to(runner_up))
    with pytest.raises(AssertionError, match="differ beyond a near-tie"):
        compare(changed_to(last))
    # Only within eps is a flip between the top two a near-tie: then it is exempt and counted,
    # up to max_share of the samples (1 of 6 is more than the default 5%).
    wide = 1.01 * lead
    stats = compare(changed_to(runner_up), eps=wide, max_share=1.0)
    assert (stats.samples, stats.exempt, stats.positions) == (6, 1, 36 - (6 - p))
    with pytest.raises(AssertionError, match=r"1 of 6 samples differ after a near-tie"):
        compare(changed_to(runner_up), eps=wide)
    # A token outside the top two is never a near-tie, however wide eps is.
    with pytest.raises(AssertionError, match="differ beyond a near-tie"):
        compare(changed_to(last), eps=1e9, max_share=1.0)
    assert STATS.samples == counted + 6  # only the comparison that passed counts

    short = copy.deepcopy(rows)
    short[1]["token_ids"] = short[1]["token_ids"][:3]
    with pytest.raises(AssertionError, match="ends early"):
        compare_samples(short, rows, model=model, prompts=by_id, sampling=sampling)

    with pytest.raises(AssertionError, match="different samples"):
        compare_samples(rows[1:], rows, model=model, prompts=by_id, sampling=sampling)
