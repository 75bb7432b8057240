"""Structured outputs (sampling.structured, input.schema_column) on the tiny test models.

A random model's outputs are as far from the constraints as outputs get: every sample that ends
with ``stop`` must still parse and validate, for several seeds at temperature 0.8.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time

import jsonschema
import pyarrow as pa
import pytest
import torch

from batchgen.engine.grammar import JSON_GAP_MAX_CHARS
from batchgen.tiny_model import make_prompts
from tests.jobkit import (
    committed_rows,
    invoke,
    read_results,
    refusal,
    run_cli,
    run_job,
    write_job,
)

SCHEMA = {
    "type": "object",
    "properties": {
        "label": {"enum": ["positive", "negative", "neutral"]},
        "ok": {"type": "boolean"},
        "score": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["label", "ok", "score", "tags"],
    "additionalProperties": False,
}
PROMPTS = make_prompts(12, seed=1, min_words=2, max_words=20)
BASE = {"temperature": 0.8, "max_tokens": 64, "n": 2}


def _model(tiny_model):
    return tiny_model("llama", hidden_size=64, vocab_size=512)


def _report(out) -> dict:
    return json.loads((out / ".batchgen" / "report.json").read_text())


def json_gaps(text: str) -> list[str]:
    """The whitespace runs of JSON text outside its strings (the layout's gaps)."""
    gaps, run, in_string, escaped = [], "", False, False
    for ch in text:
        if in_string:
            in_string = escaped or ch != '"'
            escaped = not escaped and ch == "\\"
        elif ch in " \t\r\n":
            run += ch
            continue
        else:
            in_string = ch == '"'
        if run:
            gaps.append(run)
            run = ""
    return gaps + ([run] if run else [])


def test_json_gaps() -> None:
    text = '{ "a b" :\n  "x\\" y",\t"c":[1,  2]}'
    assert json_gaps(text) == [" ", " ", "\n  ", "\t", "  "]


# A random model finds whitespace tokens wherever a gap allows them, so in the auto layout its
# samples need room for JSON_GAP_MAX_CHARS whitespace characters in most gaps.
@pytest.mark.parametrize("layout, max_tokens", [("auto", 192), ("compact", 64)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_json_schema_outputs_validate(tiny_model, tmp_path, seed, layout, max_tokens) -> None:
    structured = {"json_schema": SCHEMA, "json_layout": layout}
    sampling = {**BASE, "seed": seed, "max_tokens": max_tokens, "structured": structured}
    rows = run_job(write_job(tmp_path, _model(tiny_model), PROMPTS, sampling=sampling))
    assert len(rows) == 2 * len(PROMPTS)
    stopped = [r for r in rows if r["finish_reason"] == "stop"]
    assert len(stopped) >= len(rows) // 2, [r["text"] for r in rows]
    bound = JSON_GAP_MAX_CHARS if layout == "auto" else 0
    for r in rows:
        assert r["text"] == r["text"].lstrip()  # no whitespace before the value
        assert all(len(gap) <= bound for gap in json_gaps(r["text"])), r["text"]
    for r in stopped:
        assert r["text"] == r["text"].rstrip()  # nor after it
        jsonschema.validate(json.loads(r["text"]), SCHEMA)
    if layout == "auto":  # the random model does use the room it has
        assert max(len(g) for r in rows for g in json_gaps(r["text"])) == bound
    report = _report(tmp_path / "out")["structured"]
    assert report["constrained_samples"] == len(rows)
    assert report["complete_samples"] == len(stopped)
    assert report["compile_s"] > 0 and 0 <= report["mask_share"] < 1


NESTED_SCHEMA = {
    "type": "object",
    "properties": {
        "people": {"type": "array", "items": SCHEMA, "minItems": 2, "maxItems": 2},
        "note": {"type": "string", "maxLength": 8},
    },
    "required": ["people", "note"],
    "additionalProperties": False,
}


def whitespace_loving_decode(model_dir, layout: str, schema: dict) -> tuple[str, bool]:
    """Greedy decoding under the grammar with rigged logits: random ones, plus 100 on every
    token that is all whitespace (so the mask alone must end each gap). Returns the text and
    whether the grammar accepted it when EOS came."""
    from batchgen.engine.grammar import GrammarCompiler, apply_masks
    from batchgen.model.loader import load_tokenizer
    from batchgen.model.registry import read_model_info

    tokenizer, info = load_tokenizer(model_dir), read_model_info(model_dir)
    vocab = info.vocab_size
    spaces = [i for i in range(len(tokenizer)) if (t := tokenizer.decode([i])) and t.isspace()]
    assert len(spaces) >= 4, "a vocabulary with whitespace tokens"
    bias = torch.zeros(vocab)
    bias[spaces] = 100.0
    matcher = GrammarCompiler(tokenizer, vocab, info.eos_token_ids).json_schema(
        json.dumps(schema), layout
    ).start()
    generator = torch.Generator().manual_seed(0)
    ids: list[int] = []
    for _ in range(2000):
        logits = torch.randn(1, vocab, generator=generator) + bias
        apply_masks(logits, [matcher])
        token = int(logits.argmax())
        if token in info.eos_token_ids:
            return tokenizer.decode(ids), matcher.accepting
        matcher.consume(token)
        ids.append(token)
    raise AssertionError(f"no EOS after {len(ids)} tokens: {tokenizer.decode(ids)!r}")


@pytest.mark.parametrize("layout", ["auto", "compact"])
@pytest.mark.parametrize("model", ["tiny", "real"])
def test_whitespace_loving_model_ends_within_the_bound(tiny_model, model, layout) -> None:
    """No runaway: a model that always prefers whitespace writes at most JSON_GAP_MAX_CHARS
    whitespace characters per gap (auto) or none (compact), and its JSON validates."""
    from tests import real_model

    model_dir = _model(tiny_model) if model == "tiny" else real_model.gguf()
    text, accepted = whitespace_loving_decode(model_dir, layout, NESTED_SCHEMA)
    assert accepted, text
    jsonschema.validate(json.loads(text), NESTED_SCHEMA)
    assert text == text.strip()
    gaps = [len(g) for g in json_gaps(text)]
    if layout == "compact":
        assert gaps == [], text
    else:  # the bias fills gaps to the bound, and the mask ends each one there
        assert max(gaps) == JSON_GAP_MAX_CHARS, text


def allowed_tokens(matcher, vocab: int) -> set[int]:
    """The token ids a matcher allows next."""
    words = torch.empty((vocab + 31) // 32, dtype=torch.int32)
    matcher.fill_mask(words)
    bits = ((words[:, None] >> torch.arange(32, dtype=torch.int32)) & 1).reshape(-1)[:vocab]
    return set(bits.nonzero().flatten().tolist())


@pytest.mark.parametrize("model", ["tiny", "real"])
@pytest.mark.parametrize(
    "choices", [["positive", "negative", "neutral"], [" positive", " negative", " neutral"]]
)
def test_choice_starts_with_its_own_first_token(tiny_model, model, choices) -> None:
    """A choice's first token is that of its own tokenization (so no bare " " before a word);
    the rest may be spelled in any tokenization; and a sample ends only on a whole choice."""
    from batchgen.engine.grammar import GrammarCompiler
    from batchgen.model.loader import load_tokenizer
    from batchgen.model.registry import read_model_info
    from tests import real_model

    model_dir = _model(tiny_model) if model == "tiny" else real_model.gguf()
    tokenizer, info = load_tokenizer(model_dir), read_model_info(model_dir)
    compiled = GrammarCompiler(tokenizer, info.vocab_size, info.eos_token_ids).choice(choices)
    canonical = {c: tokenizer.encode(c, add_special_tokens=False) for c in choices}
    first = allowed_tokens(compiled.start(), info.vocab_size)
    assert first == {ids[0] for ids in canonical.values()}, [tokenizer.decode([i]) for i in first]
    assert not any(tokenizer.decode([i]).isspace() for i in first)
    for choice, ids in canonical.items():
        matcher = compiled.start()
        matcher.consume(ids[0])
        rest = choice[len(tokenizer.decode(ids[:1])) :]
        if not rest:
            assert matcher.accepting
            continue
        assert not matcher.accepting
        # the rest's first character alone is allowed, though the tokenizer merges it
        single = tokenizer.encode(rest[0], add_special_tokens=False)
        assert len(single) == 1 and single[0] in allowed_tokens(matcher, info.vocab_size)


@pytest.mark.parametrize("seed", [0, 3])
def test_choice_regex_and_grammar(tiny_model, tmp_path, seed) -> None:
    model = _model(tiny_model)
    choices = ["positive", "negative", 'a "quoted" one', "pos"]
    cases = {
        "choice": ({"choice": choices}, lambda t: t in choices),
        "regex": ({"regex": r"[a-c]{2,4}-\d{2}"}, re.compile(r"[a-c]{2,4}-\d{2}").fullmatch),
        "grammar": (
            {"grammar": 'start: "x=" NUM ("," NUM)*\nNUM: /[0-9]{1,3}/\n'},
            re.compile(r"x=[0-9]{1,3}(,[0-9]{1,3})*").fullmatch,
        ),
    }
    for name, (structured, valid) in cases.items():
        sampling = {**BASE, "seed": seed, "structured": structured}
        rows = run_job(write_job(tmp_path / name, model, PROMPTS, sampling=sampling))
        stopped = [r for r in rows if r["finish_reason"] == "stop"]
        assert len(stopped) >= len(rows) // 2, (name, [r["text"] for r in rows])
        for r in stopped:
            assert valid(r["text"]), (name, r["text"])
        if name == "choice":
            assert len(stopped) == len(rows)


def test_stop_strings_and_stop_tokens_still_apply(tiny_model, tmp_path) -> None:
    """A stop string inside an allowed output cuts it (``stop``); a stop token the grammar allows
    ends the sample there."""
    from transformers import AutoTokenizer

    model = _model(tiny_model)
    choices = ["alpha", "beta", "gamma"]
    sampling = {**BASE, "seed": 3, "structured": {"choice": choices}, "stop": ["mm"]}
    rows = run_job(write_job(tmp_path / "strings", model, PROMPTS, sampling=sampling))
    assert all(r["finish_reason"] == "stop" for r in rows), rows
    assert {r["text"] for r in rows} <= {"alpha", "beta", "ga"}
    assert "ga" in {r["text"] for r in rows}, "no sample chose gamma: pick another seed"

    # the tokens of the choices as spelled alone are stop tokens: a sample ends at the first
    # of them it samples (the grammar may spell a choice with other tokens too)
    tok = AutoTokenizer.from_pretrained(model)
    stops = sorted({t for c in choices for t in tok(c, add_special_tokens=False)["input_ids"]})
    sampling = {**BASE, "seed": 3, "structured": {"choice": choices}, "stop_token_ids": stops}
    rows = run_job(write_job(tmp_path / "tokens", model, PROMPTS, sampling=sampling))
    cut = 0
    for r in rows:
        ids = r["token_ids"]
        assert r["finish_reason"] == "stop", r
        assert not set(ids[:-1]) & set(stops), r
        cut += ids[-1] in stops and r["text"] not in choices
    assert cut > 0, "no sample was cut by a stop token: pick another seed"


def test_cut_by_max_tokens_is_length(tiny_model, tmp_path) -> None:
    sampling = {**BASE, "max_tokens": 3, "structured": {"json_schema": SCHEMA}}
    rows = run_job(write_job(tmp_path, _model(tiny_model), PROMPTS, sampling=sampling))
    assert {r["finish_reason"] for r in rows} == {"length"}
    assert all(r["num_output_tokens"] == 3 for r in rows)


def test_per_row_schemas(tiny_model, tmp_path) -> None:
    shapes = [
        SCHEMA,
        {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 4},
        {"enum": ["red", "green", "blue"]},
        {"type": "integer", "minimum": -50, "maximum": 50},
        {"type": "object", "properties": {"k": {"const": 7}}, "required": ["k"]},
    ]
    texts: list[str | None] = [json.dumps(s) for s in shapes]
    texts += ['{"type": "wrong"}', "{not json", None]
    prompts = PROMPTS[: len(texts)]
    table = pa.table({"id": list(range(len(texts))), "prompt": prompts, "schema": texts})
    sampling = {**BASE, "seed": 5}
    job = write_job(
        tmp_path, _model(tiny_model), table=table, sampling=sampling,
        input_extra={"schema_column": "schema"},
    )  # fmt: skip
    rows = run_job(job)
    assert len(rows) == 2 * len(texts)
    for r in rows:
        i = r["id"]
        if i < len(shapes):
            assert r["finish_reason"] in ("stop", "length"), r
            if r["finish_reason"] == "stop":
                jsonschema.validate(json.loads(r["text"]), shapes[i])
        elif texts[i] is None:  # no schema of its own, no job-level one: free text
            assert r["finish_reason"] in ("stop", "length") and r["error"] is None
        else:
            assert r["finish_reason"] == "error" and r["error"].startswith("schema:"), r
    stopped = sum(r["finish_reason"] == "stop" for r in rows if r["id"] < len(shapes))
    assert stopped >= len(shapes), [r["text"] for r in rows]


def test_row_schemas_follow_json_layout(tiny_model, tmp_path) -> None:
    """``structured: {json_layout: ...}`` alone sets the layout of the rows' own schemas."""
    texts = [json.dumps(SCHEMA)] * 6
    table = pa.table({"id": list(range(6)), "prompt": PROMPTS[:6], "schema": texts})
    gaps = {}
    for layout in ("auto", "compact"):
        sampling = {**BASE, "seed": 5, "max_tokens": 32, "structured": {"json_layout": layout}}
        job = write_job(
            tmp_path / layout, _model(tiny_model), table=table, sampling=sampling,
            input_extra={"schema_column": "schema"},
        )  # fmt: skip
        gaps[layout] = [len(g) for r in run_job(job) for g in json_gaps(r["text"])]
    assert gaps["compact"] == []
    assert 0 < max(gaps["auto"]) <= JSON_GAP_MAX_CHARS


def test_invalid_job_schema_exits_2_before_the_output_folder(tiny_model, tmp_path) -> None:
    model = _model(tiny_model)
    cases = [
        ({"json_schema": {"type": "wrong"}}, "sampling.structured.json_schema"),
        ({"regex": "(ab"}, "sampling.structured.regex"),
        ({"grammar": "start: nothing_here"}, "sampling.structured.grammar"),
        ({"json_schema_file": "missing.json"}, "json_schema_file"),
        ({"json": True, "json_layout": "tight"}, "sampling.structured.json_layout: must be"),
        ({"choice": ["a", "b"], "json_layout": "compact"}, "json_layout applies to JSON"),
        ({"json_layout": "compact"}, "sampling.structured.json_layout: there is no JSON"),
    ]
    for i, (structured, needle) in enumerate(cases):
        job = write_job(tmp_path / str(i), model, PROMPTS, sampling={"structured": structured})
        line = refusal(invoke("run", job, "--quiet"))
        assert needle in line, line
        assert not (tmp_path / str(i) / "out").exists()


def test_schema_file_and_json_object(tiny_model, tmp_path) -> None:
    model = _model(tiny_model)
    (tmp_path / "s.json").write_text(json.dumps(SCHEMA))
    for structured, schema in [({"json_schema_file": "s.json"}, SCHEMA), ({"json": True}, None)]:
        sampling = {**BASE, "max_tokens": 48, "structured": structured}
        job = write_job(tmp_path, model, PROMPTS[:6], sampling=sampling)
        run_cli("run", job, "--quiet", "--fresh")
        for r in read_results(tmp_path / "out"):
            if r["finish_reason"] == "stop":
                value = json.loads(r["text"])
                if schema is None:
                    assert isinstance(value, dict)
                else:
                    jsonschema.validate(value, schema)


# --------------------------------------------------------------------------- the contracts hold

INVARIANCE_SAMPLING = {
    "temperature": 0.8,
    "max_tokens": 192,  # room for the auto layout's gaps (see test_json_schema_outputs_validate)
    "n": 3,
    "seed": 11,
    "structured": {"json_schema": SCHEMA},
}


def _tokens(rows: list[dict]) -> dict[tuple, tuple]:
    return {(r["id"], r["sample_index"]): (r["token_ids"], r["finish_reason"]) for r in rows}


@pytest.mark.parametrize(
    "engine, reverse",
    [
        ({"max_num_seqs": 1, "max_num_batched_tokens": 64}, False),  # one sample per step
        pytest.param(  # preemptions by recompute
            {"block_size": 8, "kv_cache_blocks": 24, "max_num_seqs": 16},
            False,
            marks=pytest.mark.slow,
        ),
        ({}, True),  # input order reversed
    ],
    ids=["batch-limits", "preemption", "input-order"],
)
def test_constrained_samples_do_not_depend_on_the_batch(tiny_model, tmp_path, engine, reverse):
    """Masks depend only on the row's own tokens: forks (n=3) copy the grammar state, a
    preempted sequence keeps its state with its tokens, so every engine setting gives the same
    samples (float32 on the tiny model: no near-tie flips on these prompts)."""
    model = _model(tiny_model)
    prompts = PROMPTS[:8]
    ref = run_job(write_job(tmp_path / "ref", model, prompts, sampling=INVARIANCE_SAMPLING))
    ids = list(range(len(prompts)))
    if reverse:
        ids.reverse()
    table = pa.table({"id": ids, "prompt": [prompts[i] for i in ids]})
    job = write_job(
        tmp_path / "got", model, table=table, sampling=INVARIANCE_SAMPLING, engine=engine
    )
    got = run_job(job)
    assert _tokens(got) == _tokens(ref)
    if "kv_cache_blocks" in engine:
        assert _report(tmp_path / "got" / "out")["preemptions"] > 0
    assert any(r["finish_reason"] == "stop" for r in ref)


@pytest.mark.slow
def test_interrupted_constrained_job_resumes_to_the_same_samples(tiny_model, tmp_path) -> None:
    """SIGINT after the first commit, then resume: the folder equals one uninterrupted run (a
    resumed row starts again from its prompt, its grammar state from the start)."""
    model = _model(tiny_model)
    prompts = make_prompts(96, seed=4, min_words=2, max_words=20)
    sampling = {**INVARIANCE_SAMPLING, "n": 2}
    ref = run_job(write_job(tmp_path / "ref", model, prompts, sampling=sampling))
    job = write_job(tmp_path / "got", model, prompts, sampling=sampling, engine={"max_num_seqs": 4})
    out = tmp_path / "got" / "out"
    fast = ("--set", "output.commit_rows=2", "--set", "output.commit_seconds=0.05")
    proc = subprocess.Popen(
        [sys.executable, "-m", "batchgen.cli", "run", str(job), "--quiet", *fast],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 240
    while proc.poll() is None and committed_rows(out) == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 130 and "interrupted" in err, err
    assert 0 < committed_rows(out) < len(prompts)
    got = run_job(job)
    assert _tokens(got) == _tokens(ref)


@pytest.mark.slow
def test_ray_workers_constrain_rows_and_report_it(tiny_model, tmp_path) -> None:
    """Row schemas travel to Ray workers: the same samples as the local executor, and the report
    sums the workers' structured figures."""
    pytest.importorskip("ray")
    schemas = [SCHEMA, {"enum": ["red", "green", "blue"]}, {"type": "integer"}]
    texts = [json.dumps(schemas[i % 3]) for i in range(6)]
    table = pa.table({"id": list(range(6)), "prompt": PROMPTS[:6], "schema": texts})
    sampling = {**BASE, "seed": 11}
    outs = {}
    for kind in ("local", "ray"):
        job = write_job(
            tmp_path / kind, _model(tiny_model), table=table, sampling=sampling,
            input_extra={"schema_column": "schema"},
        )  # fmt: skip
        extra = ("--set", "executor.kind=ray", "--set", "executor.num_workers=1")
        run_cli("run", str(job), "--quiet", *(extra if kind == "ray" else ()))
        outs[kind] = tmp_path / kind / "out"
    rows = {
        k: sorted(read_results(o), key=lambda r: (r["id"], r["sample_index"]))
        for k, o in outs.items()
    }
    assert [r["token_ids"] for r in rows["ray"]] == [r["token_ids"] for r in rows["local"]]
    report = _report(outs["ray"])
    assert report["executor"] == "ray"
    structured = report["structured"]
    assert structured["constrained_samples"] == 12
    assert structured["complete_samples"] == sum(r["finish_reason"] == "stop" for r in rows["ray"])
    assert structured["mask_s"] > 0 and 0 < structured["mask_share"] < 1
