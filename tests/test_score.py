"""Score jobs, top-K logprobs and prompt logprobs through the CLI, against transformers."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.dataset as ds
import pytest
import torch
import yaml
from transformers import AutoTokenizer

from batchgen.model.loader import load_tokenizer
from tests.hf_reference import hf_logits
from tests.jobkit import invoke, refusal, run_cli, write_job


def score_job(tmp: Path, model: Path, table: pa.Table, **input_extra) -> Path:
    job = write_job(
        tmp, model, table=table, input_extra=input_extra or {"choices_column": "choices"}
    )
    raw = yaml.safe_load(job.read_text())
    raw.pop("sampling")
    job.write_text(yaml.safe_dump({"task": "score", **raw}, sort_keys=False))
    return job


def rows_of(out: Path) -> dict:
    return {r["id"]: r for r in ds.dataset(out, format="parquet").to_table().to_pylist()}


def reference_scores(
    model: Path, prompt: str, choices: list[str], hf: Any = None
) -> list[tuple[float, int]]:
    """(sum of transformers' log-softmax over the continuation's tokens, their count): the
    continuation's tokens are those of tokenize(prompt + continuation) after the prompt's. The
    tokenizer is transformers' (for a GGUF file, its conversion of the file's); ``hf``: the
    model already read by ``hf_model`` (default: read here)."""
    tok = load_tokenizer(model)
    n = len(tok(prompt)["input_ids"])
    seqs = [tok(prompt + c)["input_ids"] for c in choices]
    out = []
    for ids, logits in zip(seqs, hf_logits(model if hf is None else hf, seqs), strict=True):
        lp = torch.log_softmax(logits, dim=-1)
        out.append((math.fsum(lp[p - 1, ids[p]].item() for p in range(n, len(ids))), len(ids) - n))
    return out


def test_score_job_equals_transformers_with_error_rows_and_resume(tmp_path, tiny_model):
    model = tiny_model()
    prompts = ["the cat sat on", "the cat sat on", "hello there", None, "why"]
    choices = [[" the mat", " a dog", "x y"], [" up"], None, [" a"], [" so", " so"]]
    table = pa.table({"id": [0, 1, 2, 3, 4], "prompt": prompts, "choices": choices,
                      "topic": ["a", "b", "c", "d", "e"]})  # fmt: skip
    job = score_job(tmp_path, model, table, choices_column="choices", keep_columns=["topic"])
    run_cli("run", job, "--quiet")
    rows = rows_of(tmp_path / "out")
    schema = ds.dataset(tmp_path / "out", format="parquet").schema
    assert schema.names == ["id", "choice_logprobs", "choice_num_tokens", "best_choice", "error",
                            "num_prompt_tokens", "num_cached_tokens", "topic"]  # fmt: skip
    assert schema.field("choice_logprobs").type == pa.list_(pa.float64())
    assert schema.field("choice_num_tokens").type == pa.list_(pa.int32())
    assert schema.field("best_choice").type == pa.int32()
    for i in (0, 1, 4):
        ref = reference_scores(model, prompts[i], choices[i])
        row = rows[i]
        assert row["error"] is None and row["topic"] == "abcde"[i]
        assert row["choice_num_tokens"] == [n for _, n in ref]
        for got, (want, _) in zip(row["choice_logprobs"], ref, strict=True):
            assert abs(got - want) <= 1e-4
        assert row["best_choice"] == max(range(len(ref)), key=lambda k: (ref[k][0], -k))
    assert rows[4]["best_choice"] == 0  # a tie goes to the lowest index
    assert rows[2]["error"] == "choices is null" and rows[2]["choice_logprobs"] is None
    assert rows[3]["error"] == "prompt is null"
    report = json.loads((tmp_path / "out/.batchgen/report.json").read_text())
    assert report["rows"] == 5 and report["errors"] == 2
    # exactly once: a second run has nothing to do; status and validate read the folder
    again = invoke("run", job, "--quiet")
    assert again.exit_code == 0 and "nothing to do" in again.stderr
    assert "5 of 5 rows" in invoke("status", tmp_path / "out").stdout
    plan = invoke("validate", job)
    assert plan.exit_code == 0 and "resumes: 5 of 5" in plan.stdout and "scores:" in plan.stdout


def test_completion_column_and_refusals(tmp_path, tiny_model):
    model = tiny_model()
    table = pa.table({"id": [0, 1], "prompt": ["one two", "three"], "completion": [" four", ""]})
    job = score_job(tmp_path, model, table, completion_column="completion")
    run_cli("run", job, "--quiet")
    rows = rows_of(tmp_path / "out")
    ((want, n),) = reference_scores(model, "one two", [" four"])
    assert rows[0]["choice_num_tokens"] == [n] and abs(rows[0]["choice_logprobs"][0] - want) <= 1e-4
    assert rows[1]["error"] == "completion is empty"
    # a sampling section, even empty, is refused with one line; so is a missing continuation key
    raw = yaml.safe_load(job.read_text())
    job.write_text(yaml.safe_dump({**raw, "sampling": {"temperature": 0}}))
    assert "sampling: a score job" in refusal(invoke("validate", job))
    raw["input"].pop("completion_column")
    job.write_text(yaml.safe_dump(raw))
    assert "task: score needs input.choices_column" in refusal(invoke("run", job))
    # another output folder's job (a generation job) is refused as a different job
    gen = write_job(tmp_path, model, ["x"], output="out", name="gen.yaml")
    assert "differ" in refusal(invoke("run", gen, "--quiet"))


def test_shared_contexts_are_computed_once(tmp_path, tiny_model):
    model = tiny_model(max_position_embeddings=1024)
    tok = AutoTokenizer.from_pretrained(model)
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()
    contexts = [" ".join(words[(i * k) % 10] for i in range(260)) for k in (1, 3)]
    prompts = [contexts[0], contexts[1], contexts[0]]  # the first context serves two questions
    choices = [
        [f" {w} {v}" for w, v in zip(words[j : j + 4], words[3:7], strict=True)] for j in range(3)
    ]
    table = pa.table({"id": [0, 1, 2], "prompt": prompts, "choices": choices})
    job = score_job(tmp_path, model, table)
    run_cli("run", job, "--quiet")
    report = json.loads((tmp_path / "out/.batchgen/report.json").read_text())
    lengths = [len(tok(c)["input_ids"]) for c in contexts]
    assert min(lengths) >= 500
    conts = sum(len(tok(p + c)["input_ids"]) - len(tok(p)["input_ids"])
                for p, cs in zip(prompts, choices, strict=True) for c in cs)  # fmt: skip
    ideal = sum(lengths) + conts
    assert ideal <= report["computed_prompt_tokens"] <= 1.05 * ideal, (report, ideal)


def test_top_logprobs_and_prompt_logprobs_equal_transformers(tmp_path, tiny_model):
    model = tiny_model()
    sampling = {"temperature": 0, "max_tokens": 4, "logprobs": 3, "prompt_logprobs": 2,
                "ignore_eos": True}  # fmt: skip
    job = write_job(tmp_path, model, ["the cat sat", "hello"], sampling=sampling)
    run_cli("run", job, "--quiet")
    out = tmp_path / "out"
    schema = ds.dataset(out, format="parquet").schema
    top = pa.struct([("token_id", pa.int32()), ("logprob", pa.float32())])
    assert schema.field("top_logprobs").type == pa.list_(pa.list_(top))
    prompt_entry = pa.struct([("token_id", pa.int32()), ("logprob", pa.float32()),
                              ("top", pa.list_(top))])  # fmt: skip
    assert schema.field("prompt_logprobs").type == pa.list_(prompt_entry)
    tok = AutoTokenizer.from_pretrained(model)
    for row in ds.dataset(out, format="parquet").to_table().to_pylist():
        prompt = tok(["the cat sat", "hello"][row["id"]])["input_ids"]
        (logits,) = hf_logits(model, [prompt + row["token_ids"]])
        lp = torch.log_softmax(logits, dim=-1)
        assert len(row["top_logprobs"]) == len(row["token_ids"]) == 4
        for i, alts in enumerate(row["top_logprobs"]):
            values, ids = lp[len(prompt) - 1 + i].topk(3)
            assert [a["token_id"] for a in alts] == ids.tolist()
            assert all(
                abs(a["logprob"] - v) <= 1e-4 for a, v in zip(alts, values.tolist(), strict=True)
            )
        entries = row["prompt_logprobs"]
        assert entries[0] is None and len(entries) == len(prompt)
        for p, e in enumerate(entries[1:], start=1):
            assert e["token_id"] == prompt[p]
            assert abs(e["logprob"] - lp[p - 1, prompt[p]].item()) <= 1e-4
            assert [t["token_id"] for t in e["top"]] == lp[p - 1].topk(2).indices.tolist()


@pytest.mark.parametrize("value", [True, 0])
def test_logprobs_true_and_zero_add_no_top_column(tmp_path, tiny_model, value):
    job = write_job(tmp_path, tiny_model(), ["x y"], sampling={"max_tokens": 2, "logprobs": value})
    run_cli("run", job, "--quiet")
    names = ds.dataset(tmp_path / "out", format="parquet").schema.names
    assert "token_logprobs" in names and "top_logprobs" not in names


def test_a_merge_across_the_boundary_and_a_bad_column_type(tmp_path, tiny_model):
    model = tiny_model()
    tok = AutoTokenizer.from_pretrained(model)
    prompt, choices = "the ca", ["t sat on", "t"]
    n = len(tok(prompt)["input_ids"])
    whole = [tok(prompt + c)["input_ids"] for c in choices]
    assert whole[0][:n] != tok(prompt)["input_ids"]  # "ca" + "t" merge: the context differs
    table = pa.table({"id": [0, 1], "prompt": [prompt, prompt], "choices": [choices[:1], choices]})
    job = score_job(tmp_path, model, table)
    run_cli("run", job, "--quiet")
    rows = rows_of(tmp_path / "out")
    ((want, count),) = reference_scores(model, prompt, choices[:1])
    assert (
        rows[0]["choice_num_tokens"] == [count]
        and abs(rows[0]["choice_logprobs"][0] - want) <= 1e-4
    )
    if len(whole[1]) <= n:  # "t" merged whole into the prompt's last token: no token of its own
        assert rows[1]["error"].startswith("choices[1] adds no token after the prompt's")
    # a choices column that is not list<string>: exit 2, one line naming it
    bad = pa.table({"id": [0], "prompt": ["x"], "choices": [3]})
    job = score_job(tmp_path / "bad", model, bad)
    assert "input.choices_column" in refusal(invoke("run", job)) and "list<string>" in refusal(
        invoke("validate", job)
    )


def test_messages_are_scored_after_the_rendered_template(tmp_path, tiny_model):
    model = tiny_model()
    tok = AutoTokenizer.from_pretrained(model)
    messages = [{"role": "user", "content": "pick one"}]
    table = pa.table({"id": [0], "messages": [messages], "choices": [[" yes", " no"]]})
    job = score_job(tmp_path, model, table, messages_column="messages", choices_column="choices")
    run_cli("run", job, "--quiet")
    (row,) = rows_of(tmp_path / "out").values()
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    n = len(tok(text, add_special_tokens=False)["input_ids"])
    seqs = [tok(text + c, add_special_tokens=False)["input_ids"] for c in (" yes", " no")]
    for got, ids, logits in zip(row["choice_logprobs"], seqs, hf_logits(model, seqs), strict=True):
        lp = torch.log_softmax(logits, dim=-1)
        assert abs(got - math.fsum(lp[p - 1, ids[p]].item() for p in range(n, len(ids)))) <= 1e-4
