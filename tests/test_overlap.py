"""``engine.overlap``: a step is launched before the previous step's tokens are read back.

The contract: the same tokens, finish reasons and texts with overlap on and off (logprobs equal
up to float rounding), on real tiny models on the CPU (``on`` works there too). Every case runs
both ways with the block accounting checked after every step, and asserts the overlap really
happened (steps launched ahead, tokens discarded after unforeseen finishes) where it must.
"""

from __future__ import annotations

import json
import math

import pyarrow as pa
import pytest
import torch
from transformers import AutoTokenizer

from batchgen.engine.request import FinishReason, SamplingParams
from batchgen.tiny_model import make_prompts
from tests.hf_reference import ARCHS
from tests.jobkit import invoke, run_job, write_job
from tests.test_engine import make_engine, random_prompts, run_requests

LOGPROB_ATOL = 2e-4  # batch shapes differ a little (discarded rows, rows that wait a step)


def _model(tiny_model):
    return tiny_model("llama", **ARCHS["llama"])


def both(model, requests, **engine_kw) -> tuple[dict, dict, object, object]:
    """Run ``requests`` with overlap off and on; assert identical outputs."""
    off = make_engine(model, overlap=False, **engine_kw)
    on = make_engine(model, overlap=True, **engine_kw)
    want, got = run_requests(off, requests), run_requests(on, requests)
    assert got.keys() == want.keys()
    for key, w in want.items():
        g = got[key]
        assert (g.token_ids, g.finish_reason, g.text) == (w.token_ids, w.finish_reason, w.text), key
        if w.token_logprobs is not None:
            assert g.token_logprobs is not None
            worst = max(
                map(abs, (a - b for a, b in zip(g.token_logprobs, w.token_logprobs, strict=True)))
            )
            assert worst <= LOGPROB_ATOL, key
    assert off.stats.overlapped_steps == 0 and off.stats.discarded_tokens == 0
    assert on.stats.overlapped_steps > 0
    # The same tokens were kept: what on discarded it drew after a sample had ended.
    assert on.stats.sampled_tokens == off.stats.sampled_tokens
    return want, got, off, on


def test_greedy_eos_prefixes_and_max_tokens(tiny_model) -> None:
    """Greedy, stop tokens that end samples unforeseen (the token drawn after is discarded),
    prompts sharing a prefix, and a max_tokens per row (foreseen: nothing discarded for it)."""
    model = _model(tiny_model)
    template = random_prompts([11], seed=1)[0]
    prompts = [template + p[1:] for p in random_prompts([1, 4, 9, 6], seed=2)]
    prompts += random_prompts([1, 3, 7, 13, 20], seed=3)
    plain = [
        SamplingParams(temperature=0.0, max_tokens=4 + 3 * (i % 4)) for i in range(len(prompts))
    ]
    # Stop tokens: tokens the free-running outputs draw in their middle.
    ref = run_requests(make_engine(model), list(zip(prompts, plain, strict=True)))
    stops = tuple(
        {r.token_ids[len(r.token_ids) // 2] for r in ref.values() if len(r.token_ids) > 2}
    )
    params = [
        SamplingParams(temperature=0.0, max_tokens=p.max_tokens, stop_token_ids=stops[:3])
        for p in plain
    ]
    want, _, _, on = both(model, list(zip(prompts, params, strict=True)))
    assert any(r.finish_reason == FinishReason.STOP for r in want.values())
    assert any(r.finish_reason == FinishReason.LENGTH for r in want.values())
    assert on.stats.discarded_tokens > 0


@pytest.mark.parametrize(
    "engine_kw",
    [
        {},
        {"num_blocks": 14, "max_num_seqs": 6},  # tight KV memory: preemptions
        {"max_num_batched_tokens": 7},  # chunked prefill
    ],
    ids=["plain", "preemption", "chunked"],
)
def test_seeded_forks_with_logprobs(tiny_model, engine_kw) -> None:
    """Seeded sampling with top-p, n=3 forks, logprobs and stop tokens, under plain, tight and
    chunked settings."""
    model = _model(tiny_model)
    template = random_prompts([9], seed=4)[0]
    prompts = [template + p[1:] for p in random_prompts([2, 6], seed=5)]
    prompts += random_prompts([3, 12, 17], seed=6)
    params = SamplingParams(
        temperature=0.9, top_p=0.9, n=3, seed=7, max_tokens=14, logprobs=True,
        stop_token_ids=(40, 41, 42, 43, 44, 45, 46, 47),
    )  # fmt: skip
    want, _, off, on = both(model, [(p, params) for p in prompts], **engine_kw)
    assert len(want) == 3 * len(prompts)
    if "num_blocks" in engine_kw:
        assert off.scheduler.num_preemptions > 0 and on.scheduler.num_preemptions > 0


def test_penalty_rows_wait_for_their_token(tiny_model) -> None:
    """Rows with penalties sample from the tokens so far: they never run ahead of an in-flight
    token (every other step), next to plain rows that do."""
    model = _model(tiny_model)
    prompts = random_prompts([3, 5, 8, 10], seed=8)
    penal = SamplingParams(temperature=0.7, repetition_penalty=1.3, presence_penalty=0.5,
                           frequency_penalty=0.2, max_tokens=10, seed=1)  # fmt: skip
    plain = SamplingParams(temperature=0.7, max_tokens=10, seed=1)
    requests = [(p, penal if i % 2 else plain) for i, p in enumerate(prompts)]
    engine = make_engine(model, overlap=True)
    seen = []
    schedule = engine.scheduler.schedule

    def recording():
        batch = schedule()
        seen.extend(c.seq.num_in_flight for c in batch.chunks if c.seq.params is penal)
        return batch

    engine.scheduler.schedule = recording
    got = run_requests(engine, requests)
    assert seen and not any(seen)  # penalty rows were scheduled, never with a token in flight
    want = run_requests(make_engine(model, overlap=False), requests)
    assert {k: r.token_ids for k, r in got.items()} == {k: r.token_ids for k, r in want.items()}


def test_stop_strings(tiny_model) -> None:
    """Stop strings found a step late cost a discarded token, never a different text."""
    model = _model(tiny_model)
    tok = AutoTokenizer.from_pretrained(model)

    def decode(ids: list[int]) -> str:
        return tok.decode(ids, skip_special_tokens=True)

    prompts = random_prompts([4, 7, 10, 13, 16], seed=9)
    free = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    ref = run_requests(make_engine(model), [(p, free) for p in prompts])
    # a stop string from the middle of each output's text
    stops = []
    for row in range(len(prompts)):
        text = decode(ref[(row, 0)].token_ids)
        mid = len(text) // 2
        if text[mid : mid + 2].strip():
            stops.append(text[mid : mid + 2])
    assert stops
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, stop=tuple(stops))
    want, _, _, on = both(model, [(p, params) for p in prompts], detokenize=decode)
    assert any(r.text is not None for r in want.values())
    assert on.stats.discarded_tokens > 0


SCHEMA = {
    "type": "object",
    "properties": {"label": {"enum": ["yes", "no"]}, "n": {"type": "integer"}},
    "required": ["label", "n"],
    "additionalProperties": False,
}


def test_jobs_with_grammar_rows(tiny_model, tmp_path) -> None:
    """Whole jobs, ``engine.overlap: on`` against ``off``: constrained rows (json schema, n=2)
    and plain rows of the same job, seeded; the same output rows."""
    model = tiny_model("llama", hidden_size=64, vocab_size=512)
    prompts = make_prompts(6, seed=3, min_words=2, max_words=12)
    schemas = [SCHEMA if i % 2 else None for i in range(len(prompts))]
    table = pa.table({
        "id": list(range(len(prompts))),
        "prompt": prompts,
        "schema": [json.dumps(s) if s else None for s in schemas],
    })  # fmt: skip
    sampling = {"temperature": 0.8, "max_tokens": 24, "n": 2, "seed": 5, "logprobs": True}
    rows, reports = {}, {}
    for mode in ("off", "on"):
        job = write_job(tmp_path / mode, model, table=table, sampling=sampling,
                        engine={"overlap": mode}, input_extra={"schema_column": "schema"})  # fmt: skip
        plan = invoke("validate", job)
        assert plan.exit_code == 0 and f"overlap {mode}" in plan.stdout
        rows[mode] = {(r["id"], r["sample_index"]): r for r in run_job(job)}
        reports[mode] = json.loads((tmp_path / mode / "out" / ".batchgen" / "report.json").read_text())
    assert reports["off"]["overlapped_steps"] == 0 and reports["on"]["overlapped_steps"] > 0
    assert rows["on"].keys() == rows["off"].keys()
    for key, want in rows["off"].items():
        got = rows["on"][key]
        for col in ("token_ids", "finish_reason", "text"):
            assert got[col] == want[col], (key, col)
        assert math.isclose(got["cumulative_logprob"], want["cumulative_logprob"], abs_tol=1e-3)
    assert any(r["finish_reason"] == "stop" for r in rows["off"].values())


def test_fill_pending_puts_in_flight_tokens_in_place() -> None:
    from batchgen.engine.batch import StepTensors

    step = StepTensors(
        input_ids=torch.tensor([5, 0, 7, 0]),
        positions=torch.arange(4),
        meta=None,  # type: ignore[arg-type]
        logits_indices=torch.tensor([0]),
        fill_rows=torch.tensor([1, 3]),
        fill_src=torch.tensor([2, 0]),
    )
    step.fill_pending(torch.tensor([11, 12, 13]))
    assert step.input_ids.tolist() == [5, 13, 7, 11]
