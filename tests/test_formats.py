"""Input formats: JSON Lines, CSV, Arrow IPC and ``datasets`` folders give what Parquet gives,
through ``batchgen run``; a malformed file is one exit-2 line naming the file and line."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.feather as feather
import pyarrow.parquet as pq
import pytest

from batchgen import formats
from batchgen.dataset import InputDataset
from batchgen.errors import InputError
from batchgen.job import InputConfig
from batchgen.tiny_model import make_prompts
from tests.jobkit import invoke, refusal, run_job, write_job_file

PROMPTS = make_prompts(6, seed=3, min_words=2, max_words=10)
SAMPLING = {"temperature": 0.8, "max_tokens": 6, "n": 2, "seed": 5}
MESSAGES = [
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": p}] for p in PROMPTS
]


@pytest.fixture
def model(tiny_model) -> Path:
    return tiny_model("llama", hidden_size=64, vocab_size=512)


def table() -> pa.Table:
    return pa.table(
        {
            "id": list(range(len(PROMPTS))),
            "prompt": PROMPTS,
            "topic": [f"t{i % 3}" for i in range(len(PROMPTS))],
        }
    )


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_stream(path: Path, t: pa.Table) -> Path:
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, t.schema) as writer:
        for batch in t.to_batches(max_chunksize=2):
            writer.write_batch(batch)
    return path


def datasets_folder(path: Path, t: pa.Table) -> tuple[Path, str]:
    """A ``Dataset.save_to_disk`` folder: by ``datasets`` when installed, else its layout (arrow
    stream files listed in state.json, dataset_info.json) built with pyarrow."""
    try:
        import datasets  # noqa: PLC0415
    except ImportError:
        path.mkdir(parents=True)
        halves = [t.slice(0, 3), t.slice(3)]
        names = [f"data-{i:05d}-of-00002.arrow" for i in range(2)]
        for name, half in zip(names, halves, strict=True):
            write_stream(path / name, half)
        state = {"_data_files": [{"filename": n} for n in names], "_fingerprint": "x"}
        (path / "state.json").write_text(json.dumps(state))
        (path / "dataset_info.json").write_text(json.dumps({"features": {}}))
        return path, "layout built with pyarrow (datasets is not installed)"
    datasets.Dataset(t).save_to_disk(str(path), num_shards=2)
    return path, "written by datasets"


def job_for(tmp: Path, model: Path, path: str, out: str, **input_extra) -> Path:
    job = {
        "model": str(model),
        "input": {"path": path, **input_extra},
        "output": {"path": out},
        "sampling": SAMPLING,
        "engine": {"dtype": "float32"},
    }
    return write_job_file(tmp, job, name=f"{out}.yaml")


def comparable(rows: list[dict]) -> list[tuple]:
    return [(r["id"], r["sample_index"], tuple(r["token_ids"]), r.get("topic")) for r in rows]


def test_every_format_gives_the_parquet_results(model: Path, tmp_path: Path) -> None:
    t = table()
    pq.write_table(t, tmp_path / "p.parquet")
    write_jsonl(tmp_path / "p.jsonl", t.to_pylist())
    pcsv.write_csv(t, tmp_path / "p.csv")
    feather.write_feather(t, tmp_path / "p.feather")
    write_stream(tmp_path / "p.arrow", t)
    folder, how = datasets_folder(tmp_path / "saved", t)
    (tmp_path / "lines.txt").write_text((tmp_path / "p.jsonl").read_text())
    keep = {"keep_columns": ["topic"]}
    expected = comparable(run_job(job_for(tmp_path, model, "p.parquet", "o-parquet", **keep)))
    assert len(expected) == 2 * len(PROMPTS)
    cases = {
        "jsonl": ("p.jsonl", {}),
        "csv": ("p.csv", {}),
        "feather": ("p.feather", {}),
        "arrow-stream": ("p.arrow", {}),
        "datasets": ("saved", {}),
        "explicit-format": ("lines.txt", {"format": "jsonl"}),
    }
    for name, (path, extra) in cases.items():
        rows = run_job(job_for(tmp_path, model, path, f"o-{name}", **keep, **extra))
        assert comparable(rows) == expected, (name, how if name == "datasets" else "")


def test_jsonl_messages_and_string_ids(model: Path, tmp_path: Path) -> None:
    ids = [f"q{i}" for i in range(len(PROMPTS))]
    pq.write_table(pa.table({"id": ids, "chat": MESSAGES}), tmp_path / "m.parquet")
    write_jsonl(
        tmp_path / "m.jsonl", [{"id": i, "chat": m} for i, m in zip(ids, MESSAGES, strict=True)]
    )
    chat = {"messages_column": "chat"}
    expected = run_job(job_for(tmp_path, model, "m.parquet", "o-pq", **chat))
    rows = run_job(job_for(tmp_path, model, "m.jsonl", "o-jsonl", **chat))
    assert comparable(rows) == comparable(expected)
    assert {r["id"] for r in rows} == set(ids)
    assert all(r["finish_reason"] != "error" for r in rows)


def test_folder_of_jsonl_files_and_unknown_extension(model: Path, tmp_path: Path) -> None:
    rows = table().to_pylist()
    write_jsonl(tmp_path / "d" / "a.jsonl", rows[:4])
    write_jsonl(tmp_path / "d" / "b.jsonl", rows[4:])
    (tmp_path / "d" / "_notes.jsonl").write_text("not read\n")
    got = run_job(job_for(tmp_path, model, "d", "o-d"))
    assert sorted({r["id"] for r in got}) == list(range(len(PROMPTS)))

    (tmp_path / "x.txt").write_text("{}\n")
    line = refusal(invoke("run", job_for(tmp_path, model, "x.txt", "o-x"), "--quiet"))
    assert "x.txt" in line and "set input.format" in line
    assert not (tmp_path / "o-x").exists()

    pq.write_table(table(), tmp_path / "d" / "c.parquet")
    line = refusal(invoke("run", job_for(tmp_path, model, "d", "o-mixed"), "--quiet"))
    assert "several formats (jsonl, parquet)" in line


def bad_jsonl(tmp_path: Path, bad_line: int, text: str) -> Path:
    m = [{"role": "user", "content": "hi"}]
    lines = [json.dumps({"id": i, "prompt": f"p{i}", "m": m}) for i in range(60)]
    lines.insert(10, "")  # blank lines are skipped, and counted
    lines[bad_line - 1] = text
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("chunk", [64, 1 << 20])  # many chunks, one chunk
@pytest.mark.parametrize(
    ("bad_line", "text", "needle"),
    [
        (37, '{"id": 36, "prompt": "p", oops}', "is not valid JSON"),
        (50, '{"id": "fifty", "prompt": "p"}', "field 'id' is a JSON string, but a number"),
        (2, "[1, 2]", "is not a JSON object"),
        (44, '{"id": 43, "prompt": ["a"]}', "field 'prompt' is a JSON array, but a string"),
        (
            45,
            '{"id": 44, "prompt": "p", "m": [{"role": "user", "content": [1]}]}',
            "field 'm[].content' is a JSON array, but a string",
        ),
    ],
)
def test_malformed_jsonl_line_is_named(
    model: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    chunk: int,
    bad_line: int,
    text: str,
    needle: str,
) -> None:
    monkeypatch.setattr(formats, "_JSON_CHUNK_BYTES", chunk)
    path = bad_jsonl(tmp_path, bad_line, text)
    line = refusal(invoke("run", job_for(tmp_path, model, "bad.jsonl", "out"), "--quiet"))
    assert f"input file {path} line {bad_line}" in line and needle in line, line
    assert not (tmp_path / "out").exists()


def test_int_then_float_widens_across_chunks(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(formats, "_JSON_CHUNK_BYTES", 64)
    rows = [{"id": i, "prompt": f"p{i}", "t": 1} for i in range(30)]
    rows[25]["t"] = 0.5
    rows[3]["t"] = None
    path = write_jsonl(tmp_path / "w.jsonl", rows)
    data = InputDataset(InputConfig(path=str(path), keep_columns=["t"]))
    assert data.num_rows == 30 and data.keep_fields[0].type == pa.float64()
    got = [r for w in data.iter_windows(7, skip_ids={0, 29}) for r in w]
    assert [r.id for r in got] == list(range(1, 29))
    assert got[24].keep == {"t": 0.5} and got[2].keep == {"t": None} and got[0].keep == {"t": 1.0}


def test_csv_types_come_from_the_whole_file(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(formats, "_CSV_BLOCK_BYTES", 64)
    lines = ["id,prompt,n,flag,x"] + [f"{i},{i},{1 + i % 2},{i % 3 == 0},{i}" for i in range(40)]
    lines[35] = 'x34,"two\nlines",2,,0.5'
    path = tmp_path / "t.csv"
    path.write_text("\n".join(lines) + "\n")
    data = InputDataset(InputConfig(path=str(path), keep_columns=["n", "flag", "x"]))
    assert data.id_type == pa.string()  # one id is not a number: all ids are strings
    assert [f.type for f in data.keep_fields] == [pa.int64(), pa.bool_(), pa.float64()]
    rows = [r for w in data.iter_windows(100) for r in w]
    assert [r.prompt for r in rows[:2]] == ["0", "1"]  # prompts stay text
    assert rows[34].id == "x34" and rows[34].prompt == "two\nlines"
    assert rows[34].keep == {"n": 2, "flag": None, "x": 0.5}
    assert rows[3].keep == {"n": 2, "flag": True, "x": 3.0}


def test_malformed_csv_line_is_named(model: Path, tmp_path: Path) -> None:
    lines = ["id,prompt"] + [f'{i},"p{i}"' for i in range(20)]
    lines[5] = '4,"a prompt\nover two lines"'  # line 6-7 of the file
    lines[12] = "11,p,extra"  # line 14: the quoted newline above counts
    path = tmp_path / "bad.csv"
    path.write_text("\n".join(lines) + "\n")
    line = refusal(invoke("run", job_for(tmp_path, model, "bad.csv", "out"), "--quiet"))
    assert f"input file {path} line 14: 3 fields, the header has 2" in line, line


def test_datasets_dict_folder_is_refused(tmp_path: Path) -> None:
    datasets_folder(tmp_path / "dd" / "train", table())
    (tmp_path / "dd" / "dataset_dict.json").write_text('{"splits": ["train"]}')
    with pytest.raises(InputError, match=r"DatasetDict \(splits: train\).*one split"):
        InputDataset(InputConfig(path=str(tmp_path / "dd")))


def test_format_and_sampling_columns_in_the_fingerprint(model: Path, tmp_path: Path) -> None:
    """``format: auto`` and the format it resolves to are one job; sampling_columns is input."""
    write_jsonl(tmp_path / "p.jsonl", [{**r, "t": 0.0} for r in table().to_pylist()])
    run_job(job_for(tmp_path, model, "p.jsonl", "out"))
    result = invoke("run", job_for(tmp_path, model, "p.jsonl", "out", format="jsonl"), "--quiet")
    assert result.exit_code == 0 and "nothing to do" in result.stderr
    per_row = job_for(tmp_path, model, "p.jsonl", "out", sampling_columns={"temperature": "t"})
    line = refusal(invoke("run", per_row, "--quiet"))
    assert "holds a different job: input differs" in line
