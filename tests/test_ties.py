"""The near-tie comparison of tests/ties.py fails on real differences."""

from __future__ import annotations

import copy

import pytest

from batchgen.tiny_model import make_prompts
from tests.jobkit import run_job, write_job
from tests.ties import STATS, compare_samples


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_compare_samples_accepts_equal_and_rejects_changed_tokens(
    tiny_model, tmp_path, temperature
) -> None:
    model = tiny_model("llama")
    prompts = make_prompts(3, seed=2, min_words=3, max_words=8)
    sampling = {"temperature": temperature, "n": 2, "max_tokens": 6, "seed": 1, "ignore_eos": True}
    rows = run_job(write_job(tmp_path, model, prompts, sampling=sampling))
    by_id = dict(enumerate(prompts))
    before = STATS.samples
    stats = compare_samples(rows, rows, model=model, prompts=by_id, sampling=sampling)
    assert (stats.samples, stats.exempt, stats.positions) == (6, 0, 36)
    assert STATS.samples == before + 6

    changed = copy.deepcopy(rows)
    first = changed[0]["token_ids"]
    first[2] = (first[2] + 7) % 100 + 10  # a token the model did not choose
    with pytest.raises(AssertionError, match="differ beyond a near-tie"):
        compare_samples(changed, rows, model=model, prompts=by_id, sampling=sampling)

    short = copy.deepcopy(rows)
    short[1]["token_ids"] = short[1]["token_ids"][:3]
    with pytest.raises(AssertionError, match="ends early"):
        compare_samples(short, rows, model=model, prompts=by_id, sampling=sampling)

    with pytest.raises(AssertionError, match="different samples"):
        compare_samples(rows[1:], rows, model=model, prompts=by_id, sampling=sampling)
