"""OpenAI batch files (``input.format: openai_batch``, ``batchgen run-batch``) and per-row
sampling settings (``input.sampling_columns``): what each line asks for, the batch output JSONL,
error lines, and resumes (also with a per-row ``n``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchgen import runner
from batchgen.signals import GracefulStop
from batchgen.tiny_model import make_prompts
from tests.jobkit import (
    invoke,
    manifest_of,
    read_results,
    refusal,
    run_cli,
    run_job,
    write_job,
    write_job_file,
)

PROMPTS = make_prompts(8, seed=7, min_words=2, max_words=12)
CHAT = "/v1/chat/completions"
TEXT = "/v1/completions"
SCHEMA = {
    "type": "object",
    "properties": {"label": {"enum": ["yes", "no"]}, "score": {"type": "integer"}},
    "required": ["label", "score"],
    "additionalProperties": False,
}


@pytest.fixture
def model(tiny_model) -> Path:
    return tiny_model("llama", hidden_size=64, vocab_size=512)


def request(cid: str, url: str, **body: Any) -> dict[str, Any]:
    return {"custom_id": cid, "method": "POST", "url": url, "body": {"model": "m", **body}}


def chat(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def write_lines(path: Path, lines: list[Any]) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def batch_job(tmp: Path, model: Path, inp: str, out: str = "out", **sampling: Any) -> Path:
    job = {
        "model": str(model),
        "input": {"path": inp, "format": "openai_batch"},
        "output": {"path": out, "commit_rows": 1},
        "sampling": {"max_tokens": 8, **sampling},
        "engine": {"dtype": "float32"},
    }
    return write_job_file(tmp, job, name=f"{out}.yaml")


GOOD = [
    request("c-greedy", CHAT, messages=chat(PROMPTS[0]), temperature=0, max_tokens=5),
    request("c-n3", CHAT, messages=chat(PROMPTS[1]), n=3, temperature=0.9, seed=11, stop=["\n"]),
    request("t-n2", TEXT, prompt=PROMPTS[2], n=2, temperature=1.0, seed=3, max_tokens=6),
    request(
        "c-parts",
        CHAT,
        messages=[{"role": "user", "content": [{"type": "text", "text": PROMPTS[3]}]}],
        max_completion_tokens=4,
        user="someone",
        stream=False,
    ),
    request("t-plain", TEXT, prompt=PROMPTS[4]),
]
BAD = [
    (request("e-url", "/v1/embeddings", input="x"), "url '/v1/embeddings' is not supported"),
    (request("e-temp", TEXT, prompt="x", temperature=-1), "body.temperature: must be greater"),
    (request("e-n", TEXT, prompt="x", n=0), "body.n: must be greater than or equal to 1"),
    (request("e-tools", CHAT, messages=chat("x"), tools=[]), "body.tools is not supported"),
    (request("e-logprobs", TEXT, prompt="x", logprobs=True), "body.logprobs: True is not"),
    (request("e-prompt", TEXT, prompt=["a", "b"]), "body.prompt is not a string"),
    (
        request("e-image", CHAT, messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
        "image_url part; only text parts",
    ),
    (request("e-seed", TEXT, prompt="x", seed="one"), "body.seed: must be a valid integer"),
]


def test_chat_completions_and_error_lines(model: Path, tmp_path: Path) -> None:
    lines = [GOOD[0], BAD[0][0], *GOOD[1:], *(b for b, _ in BAD[1:])]
    write_lines(tmp_path / "in.jsonl", lines)
    run_cli("run", batch_job(tmp_path, model, "in.jsonl"), "--quiet")
    out = read_jsonl(tmp_path / "out" / ".batchgen" / "batch_output.jsonl")
    assert [o["custom_id"] for o in out] == [x["custom_id"] for x in lines]  # input order
    by_id = {o["custom_id"]: o for o in out}
    n_of = {"c-greedy": 1, "c-n3": 3, "t-n2": 2, "c-parts": 1, "t-plain": 1}
    results = read_results(tmp_path / "out")
    for cid, n in n_of.items():
        o = by_id[cid]
        assert o["error"] is None and o["id"].startswith("batch_req_")
        response = o["response"]
        assert response["status_code"] == 200 and response["request_id"]
        body = response["body"]
        is_chat = cid.startswith("c-")
        assert body["object"] == ("chat.completion" if is_chat else "text_completion")
        assert body["id"].startswith("chatcmpl-" if is_chat else "cmpl-")
        assert body["model"] == model.name and isinstance(body["created"], int)
        assert [c["index"] for c in body["choices"]] == list(range(n))
        mine = [r for r in results if r["id"] == cid]
        assert len(mine) == n
        for choice, row in zip(body["choices"], mine, strict=True):
            text = choice["message"]["content"] if is_chat else choice["text"]
            assert text == row["text"] and choice["finish_reason"] == row["finish_reason"]
            if is_chat:
                assert choice["message"]["role"] == "assistant"
        usage = body["usage"]
        assert usage["prompt_tokens"] == mine[0]["num_prompt_tokens"] > 0
        assert usage["completion_tokens"] == sum(r["num_output_tokens"] for r in mine)
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert by_id["c-greedy"]["response"]["body"]["usage"]["completion_tokens"] <= 5
    assert all(r["num_output_tokens"] <= 4 for r in results if r["id"] == "c-parts")
    assert all(r["num_output_tokens"] <= 6 for r in results if r["id"] == "t-n2")
    for line, needle in BAD:
        o = by_id[line["custom_id"]]
        assert o["response"] is None and o["error"]["code"] == "invalid_request"
        assert needle in o["error"]["message"], (needle, o["error"])
    report = json.loads((tmp_path / "out" / ".batchgen" / "report.json").read_text())
    assert report["rows"] == len(lines) and report["samples"] == 8 + len(BAD)


def test_body_settings_are_the_rows_sampling(model: Path, tmp_path: Path) -> None:
    """A line's samples are those of a job whose ``sampling:`` holds the body's settings (the
    determinism contract per row), whatever else is in the file."""
    settings = {"n": 2, "temperature": 0.9, "top_p": 0.8, "seed": 42, "max_tokens": 6}
    lines = [
        request("a", TEXT, prompt=PROMPTS[5], **settings),
        request("b", TEXT, prompt=PROMPTS[5], temperature=0),  # same prompt, not folded with a
        request("c", TEXT, prompt=PROMPTS[5], **{**settings, "seed": 43}),
    ]
    write_lines(tmp_path / "in.jsonl", lines)
    run_cli("run", batch_job(tmp_path, model, "in.jsonl"), "--quiet")
    got = read_results(tmp_path / "out")
    table = pa.table({"id": ["a"], "prompt": [PROMPTS[5]]})
    ref = run_job(write_job(tmp_path / "ref", model, table=table, sampling=settings))
    assert [r["token_ids"] for r in got if r["id"] == "a"] == [r["token_ids"] for r in ref]
    greedy = run_job(
        write_job(
            tmp_path / "greedy",
            model,
            table=pa.table({"id": ["b"], "prompt": [PROMPTS[5]]}),
            sampling={"temperature": 0, "max_tokens": 8},
        )
    )
    assert [r["token_ids"] for r in got if r["id"] == "b"] == [r["token_ids"] for r in greedy]
    seeds = {r["id"]: r["token_ids"] for r in got if r["sample_index"] == 0}
    assert seeds["a"] != seeds["c"]  # another seed, other samples


def test_response_format_is_structured_output(model: Path, tmp_path: Path) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "v", "schema": SCHEMA, "strict": True}}
    lines = [
        request(f"s{i}", CHAT, messages=chat(p), response_format=fmt, temperature=0.8, seed=i)
        for i, p in enumerate(PROMPTS[:4])
    ]
    lines += [
        request("o", CHAT, messages=chat(PROMPTS[4]), response_format={"type": "json_object"}),
        request("t", CHAT, messages=chat(PROMPTS[5]), response_format={"type": "text"}),
        request("x", CHAT, messages=chat("x"), response_format={"type": "xml"}),
    ]
    write_lines(tmp_path / "in.jsonl", lines)
    run_cli("run", batch_job(tmp_path, model, "in.jsonl", max_tokens=64), "--quiet")
    out = {o["custom_id"]: o for o in read_jsonl(tmp_path / "out" / ".batchgen" / "batch_output.jsonl")}
    complete = 0
    for i in range(4):
        choice = out[f"s{i}"]["response"]["body"]["choices"][0]
        if choice["finish_reason"] == "stop":
            jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)
            complete += 1
    assert complete >= 2
    choice = out["o"]["response"]["body"]["choices"][0]
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(choice["message"]["content"]), dict)
    assert out["t"]["error"] is None
    assert "response_format type 'xml' is not supported" in out["x"]["error"]["message"]


@pytest.mark.parametrize(
    ("line", "needle"),
    [
        ('{"custom_id": "a", "body": }', "line 3 is not valid JSON"),
        ('{"url": "/v1/completions", "body": {"prompt": "x"}}', "line 3: custom_id is missing"),
        (json.dumps(request("k0", TEXT, prompt="x")), "line 3: custom_id 'k0' repeats line 1"),
    ],
)
def test_malformed_file_exits_2_naming_the_line(
    model: Path, tmp_path: Path, line: str, needle: str
) -> None:
    lines = [request("k0", TEXT, prompt="a"), "", line, request("k1", TEXT, prompt="b")]
    path = write_lines(tmp_path / "in.jsonl", lines)
    message = refusal(invoke("run", batch_job(tmp_path, model, "in.jsonl"), "--quiet"))
    assert f"input file {path} {needle}" in message, message


def test_column_keys_do_not_apply(model: Path, tmp_path: Path) -> None:
    job = {
        "model": str(model),
        "input": {"path": "in.jsonl", "format": "openai_batch", "id_column": "x"},
        "output": {"path": "out"},
    }
    line = refusal(invoke("run", write_job_file(tmp_path, job), "--quiet"))
    assert "input.id_column does not apply to format openai_batch" in line


def interrupt_after(monkeypatch: pytest.MonkeyPatch, rows: int) -> None:
    """Stop the next run as a first SIGINT would, once ``rows`` input rows have finished."""
    stops: list[GracefulStop] = []

    class Stop(GracefulStop):
        def __enter__(self) -> GracefulStop:
            stops.append(self)
            return super().__enter__()

    add = runner.JobRun._add

    def add_then_stop(self: runner.JobRun, group: list) -> None:
        add(self, group)
        if self.totals.rows >= rows:
            stops[-1].stop = True

    monkeypatch.setattr(runner, "GracefulStop", Stop)
    monkeypatch.setattr(runner.JobRun, "_add", add_then_stop)


def without_created(lines: list[dict]) -> list[dict]:
    for o in lines:
        if o["response"]:
            o["response"]["body"].pop("created")
    return lines


def test_resume_gives_the_same_output(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lines = [
        request(
            f"r{i}",
            CHAT if i % 2 else TEXT,
            **({"messages": chat(p)} if i % 2 else {"prompt": p}),
            n=1 + i % 3,
            seed=i,
            temperature=0.9,
            max_tokens=2 + i,  # rows finish one after another
        )
        for i, p in enumerate(PROMPTS)
    ]
    lines.append(BAD[1][0])
    write_lines(tmp_path / "in.jsonl", lines)
    run_cli("run", batch_job(tmp_path, model, "in.jsonl", "whole"), "--quiet")
    whole = read_jsonl(tmp_path / "whole" / ".batchgen" / "batch_output.jsonl")

    job = batch_job(tmp_path, model, "in.jsonl", "parts")
    out = tmp_path / "parts" / ".batchgen" / "batch_output.jsonl"
    for stop_at in (3, 2):  # rows finished in each run
        with monkeypatch.context() as m:
            interrupt_after(m, stop_at)
            assert invoke("run", job, "--quiet").exit_code == 130
        assert not out.exists()  # written only when every request ran
    assert 0 < manifest_of(tmp_path / "parts")["totals"]["rows"] < len(lines)
    run_cli("run", job, "--quiet")
    first = out.read_text()
    assert without_created(read_jsonl(out)) == without_created(whole)
    rows = read_results(tmp_path / "parts")
    keys = [(r["id"], r["sample_index"]) for r in rows]
    assert len(keys) == len(set(keys)) == sum(1 + i % 3 for i in range(len(PROMPTS))) + 1
    # A run with nothing left to do writes the same file again.
    out.unlink()
    run_cli("run", job, "--quiet")
    assert out.read_text() == first


def test_run_batch_command(model: Path, tmp_path: Path, monkeypatch) -> None:
    write_lines(tmp_path / "in.jsonl", GOOD[:3])
    monkeypatch.chdir(tmp_path)
    args = ("run-batch", "in.jsonl", "res.jsonl", "--model", str(model))
    run_cli(*args, "--set", "engine.dtype=float32", "--set", "sampling.max_tokens=4", "-q")
    out = read_jsonl(tmp_path / "res.jsonl")
    assert [o["custom_id"] for o in out] == ["c-greedy", "c-n3", "t-n2"]
    assert len(read_results(tmp_path / "res.parts")) == 1 + 3 + 2
    before = (tmp_path / "res.jsonl").read_text()
    result = run_cli(*args, "--set", "engine.dtype=float32", "--set", "sampling.max_tokens=4")
    assert "nothing to do" in result.stderr
    assert (tmp_path / "res.jsonl").read_text() == before
    line = refusal(invoke(*args, "--set", "sampling.max_tokens=5", "--set", "engine.dtype=float32"))
    assert "res.parts holds a different job: sampling differs" in line
    assert refusal(invoke("run-batch", "nope.jsonl", "r.jsonl", "--model", str(model))).startswith(
        "error: input.path"
    )


# --------------------------------------------------------------------------- sampling_columns


def per_row_table() -> pa.Table:
    return pa.table(
        {
            "id": list(range(8)),
            "prompt": [PROMPTS[0]] * 4 + PROMPTS[1:5],
            "temp": [0.0, 1.0, None, 0.0, 0.7, 1.0, 0.0, 0.5],
            "n": [1, 3, 2, None, 4, 1, 2, 3],
            "seed": [None, 9, None, None, 1, 2, 3, 4],
            "max": [2, 3, 4, 5, None, 6, 7, 8],  # rows finish one after another
        }
    )


PER_ROW = {"temperature": "temp", "n": "n", "seed": "seed", "max_tokens": "max"}


def test_sampling_columns_override_per_row(model: Path, tmp_path: Path) -> None:
    t = per_row_table()
    sampling = {"n": 2, "temperature": 0.8, "max_tokens": 6, "seed": 5}
    rows = run_job(
        write_job(
            tmp_path, model, table=t, sampling=sampling, input_extra={"sampling_columns": PER_ROW}
        )
    )
    n_of: dict[int, int] = {}
    for r in rows:
        n_of[r["id"]] = n_of.get(r["id"], 0) + 1
    assert n_of == {0: 1, 1: 3, 2: 2, 3: 2, 4: 4, 5: 1, 6: 2, 7: 3}
    for i in range(8):  # each row as a job of its own, its settings in sampling:
        row = t.slice(i, 1).to_pylist()[0]
        own = {**sampling, **{k: row[c] for k, c in PER_ROW.items() if row[c] is not None}}
        ref = run_job(
            write_job(
                tmp_path / f"r{i}",
                model,
                table=t.slice(i, 1).select(["id", "prompt"]),
                sampling=own,
            )
        )
        assert [r["token_ids"] for r in rows if r["id"] == i] == [r["token_ids"] for r in ref], i


def test_bad_per_row_values_are_error_rows(model: Path, tmp_path: Path) -> None:
    t = pa.table(
        {
            "id": [0, 1, 2, 3],
            "prompt": PROMPTS[:4],
            "temp": [0.5, -1.0, 0.5, 0.5],
            "n": [2, 2, 0, 3],
            "stop": ["x", "y", "z", ""],
        }
    )
    per_row = {"temperature": "temp", "n": "n", "stop": "stop"}
    rows = run_job(
        write_job(
            tmp_path,
            model,
            table=t,
            sampling={"max_tokens": 4},
            input_extra={"sampling_columns": per_row},
        )
    )
    by_id: dict[int, list[dict]] = {}
    for r in rows:
        by_id.setdefault(r["id"], []).append(r)
    assert [r["finish_reason"] != "error" for r in by_id[0]] == [True, True]
    assert len(by_id[1]) == 2 and all(r["finish_reason"] == "error" for r in by_id[1])
    assert by_id[1][0]["error"] == (
        "input column 'temp' (sampling.temperature): must be greater than or equal to 0 (got -1.0)"
    )
    # a bad n: the job's n error rows (1)
    assert len(by_id[2]) == 1 and "input column 'n' (sampling.n)" in by_id[2][0]["error"]
    stop = by_id[3][0]["error"]  # a bad stop string: the row's (good) n error rows
    assert "input column 'stop' (sampling.stop): must have at least 1 char" in stop
    assert len(by_id[3]) == 3


def test_unknown_sampling_key_is_refused(model: Path, tmp_path: Path) -> None:
    job = write_job(
        tmp_path, model, PROMPTS[:2], input_extra={"sampling_columns": {"logprobs": "x"}}
    )
    line = refusal(invoke("run", job, "--quiet"))
    assert "sampling_columns: 'logprobs' cannot be set per row" in line
    job = write_job(tmp_path, model, PROMPTS[:2], input_extra={"sampling_columns": {"n": "nope"}})
    line = refusal(invoke("run", job, "--quiet"))
    assert "has no column 'nope' (input.sampling_columns.n)" in line


def test_resume_with_per_row_n(model: Path, tmp_path: Path, monkeypatch) -> None:
    t = per_row_table()
    job = write_job(
        tmp_path,
        model,
        table=t,
        sampling={"n": 2, "temperature": 0.8, "max_tokens": 6},
        input_extra={"sampling_columns": PER_ROW},
    )
    whole = run_job(job)
    with monkeypatch.context() as m:
        interrupt_after(m, 3)
        assert (
            invoke(
                "run", job, "--set", "output.path=parts", "--set", "output.commit_rows=1", "--quiet"
            ).exit_code
            == 130
        )
    done = manifest_of(tmp_path / "parts")["totals"]
    assert 0 < done["rows"] < 8
    run_cli("run", job, "--set", "output.path=parts", "--quiet")
    again = read_results(tmp_path / "parts")
    assert [(r["id"], r["sample_index"], r["token_ids"]) for r in again] == [
        (r["id"], r["sample_index"], r["token_ids"]) for r in whole
    ]
    totals = manifest_of(tmp_path / "parts")["totals"]
    assert totals["rows"] == 8 and totals["samples"] == len(whole) == 18
    status = run_cli("status", tmp_path / "parts").stdout
    assert "8 of 8 rows" in status and "samples:       18" in status
    pq.read_table(tmp_path / "parts")  # the folder reads as one table


@pytest.mark.slow
def test_ray_workers_follow_per_row_sampling(model: Path, tmp_path: Path) -> None:
    """Per-row settings travel with the rows to Ray workers: an OpenAI batch file gives the
    local executor's output there (fp32 on CPU: no near-tie flips were ever seen here)."""
    ray = pytest.importorskip("ray")
    lines = [
        request(f"r{i}", TEXT, prompt=p, n=1 + i % 3, seed=i, temperature=0.9, max_tokens=2 + i)
        for i, p in enumerate(PROMPTS)
    ]
    lines.append(BAD[2][0])
    write_lines(tmp_path / "in.jsonl", lines)
    run_cli("run", batch_job(tmp_path, model, "in.jsonl", "local"), "--quiet")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="WARNING")
    try:
        ray_job = batch_job(tmp_path, model, "in.jsonl", "ray")
        run_cli("run", ray_job, "--set", "executor.kind=ray", "--set", "executor.num_workers=2")
    finally:
        ray.shutdown()
    local = read_jsonl(tmp_path / "local" / ".batchgen" / "batch_output.jsonl")
    remote = read_jsonl(tmp_path / "ray" / ".batchgen" / "batch_output.jsonl")
    assert without_created(remote) == without_created(local)
    assert [len(o["response"]["body"]["choices"]) for o in remote[:-1]] == [
        1 + i % 3 for i in range(len(PROMPTS))
    ]
