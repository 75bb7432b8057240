"""Parquet out: schema, the commit protocol, the manifest, resume, --fresh, crashes at each step."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.parquet as pq
import pytest

import batchgen.results.local as results_local
from batchgen.errors import JobError, OutputFullError
from batchgen.results import (
    COMMIT_STEPS,
    MANIFEST_NAME,
    REPORT_NAME,
    OutputFolder,
)
from batchgen.schema import output_schema
from batchgen.status import read_status

FP = {"model": "m1", "input": "i1", "sampling": "s1"}
SCHEMA = output_schema(pa.int64(), [pa.field("topic", pa.string())], logprobs=False)


def samples(row_id: int, n: int = 2, error: bool = False) -> list[dict]:
    """The n output rows of one input row."""
    return [
        {
            "id": row_id,
            "sample_index": k,
            "text": None if error else f"text {row_id}.{k}",
            "token_ids": [] if error else [1, 2, 3],
            "finish_reason": "error" if error else "stop",
            "error": "prompt is null" if error else None,
            "num_prompt_tokens": 10,
            "num_cached_tokens": 4,
            "num_output_tokens": 0 if error else 3,
            "topic": f"t{row_id}",
        }
        for k in range(n)
    ]


def read_back(path: Path) -> pa.Table:
    """What a Parquet reader sees in the output folder."""
    return pads.dataset(path, format="parquet").to_table()


def keys_of(table: pa.Table) -> list[tuple[int, int]]:
    return list(
        zip(table.column("id").to_pylist(), table.column("sample_index").to_pylist(), strict=True)
    )


def visible(path: Path) -> list[str]:
    return sorted(n for n in os.listdir(path) if not n.startswith((".", "_")))


def hidden(path: Path) -> list[str]:
    """The files under the output folder's ``.batchgen/``, relative to it."""
    root = path / ".batchgen"
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


# --------------------------------------------------------------------------- schema


def test_output_schema_order_and_types() -> None:
    schema = output_schema(pa.string(), [pa.field("topic", pa.string())], logprobs=False)
    assert schema.names == [
        "id",
        "sample_index",
        "text",
        "token_ids",
        "finish_reason",
        "error",
        "num_prompt_tokens",
        "num_cached_tokens",
        "num_output_tokens",
        "topic",
    ]
    assert schema.field("id").type == pa.string()
    assert schema.field("sample_index").type == pa.int32()
    assert schema.field("token_ids").type == pa.list_(pa.int32())
    for name in ("num_prompt_tokens", "num_cached_tokens", "num_output_tokens"):
        assert schema.field(name).type == pa.int32()
    with_lp = output_schema(pa.int64(), [], logprobs=True)
    assert with_lp.names[-2:] == ["cumulative_logprob", "token_logprobs"]
    assert with_lp.field("cumulative_logprob").type == pa.float64()
    assert with_lp.field("token_logprobs").type == pa.list_(pa.float32())
    with pytest.raises(ValueError):
        output_schema(pa.int64(), [pa.field("text", pa.string())], logprobs=False)


# --------------------------------------------------------------------------- commit, resume


def test_commit_writes_part_then_manifest(tmp_path: Path) -> None:
    out = tmp_path / "out" / "run"
    with OutputFolder.open(out, FP, fresh=False) as folder:
        manifest = json.loads((out / MANIFEST_NAME).read_text())
        assert manifest["fingerprint"] == FP and manifest["parts"] == []
        writer = folder.writer(SCHEMA, commit_rows=100, commit_seconds=1e9)
        writer.add_row_group(samples(0))
        writer.add_row_group(samples(1, error=True))
        assert visible(out) == []
        writer.commit()
        writer.commit()  # nothing buffered: no empty part
        assert visible(out) == ["part-00000.parquet"]
        assert folder.completed_ids() == {0, 1}
        assert folder.counts() == {
            "rows": 2,
            "samples": 4,
            "prompt_tokens": 40,
            "cached_prompt_tokens": 16,
            "output_tokens": 6,
            "errors": 2,
            "parts": 1,
        }
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    assert manifest["parts"][0]["name"] == "part-00000.parquet"
    assert (manifest["parts"][0]["first_id"], manifest["parts"][0]["last_id"]) == (0, 1)
    assert manifest["last_commit_at"] is not None
    table = read_back(out)
    assert table.schema.names == SCHEMA.names
    assert keys_of(table) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert table.column("topic").to_pylist() == ["t0", "t0", "t1", "t1"]


def test_maybe_commit_by_rows_never_splits_an_input_row(tmp_path: Path) -> None:
    with OutputFolder.open(tmp_path / "o", FP) as folder:
        writer = folder.writer(SCHEMA, commit_rows=3, commit_seconds=1e9)
        committed = []
        for row_id in range(5):
            writer.add_row_group(samples(row_id, n=2))
            committed.append(writer.maybe_commit())
        assert committed == [False, True, False, True, False]
        assert folder.counts()["rows"] == 4  # the fifth row waits in the buffer, whole
        writer.commit()
        for part in folder.part_paths():
            ids = pq.read_table(part).column("id").to_pylist()
            assert all(ids.count(i) == 2 for i in ids)  # both samples of a row, in one part
        assert folder.counts()["parts"] == 3


def test_maybe_commit_by_time(tmp_path: Path) -> None:
    now = [100.0]
    with OutputFolder.open(tmp_path / "o", FP) as folder:
        writer = folder.writer(SCHEMA, commit_rows=1000, commit_seconds=5.0, clock=lambda: now[0])
        assert writer.maybe_commit() is False  # nothing buffered
        writer.add_row_group(samples(0))
        now[0] += 4.9
        assert writer.maybe_commit() is False
        now[0] += 0.2
        assert writer.maybe_commit() is True
        assert folder.completed_ids() == {0}


def test_resume_continues_part_numbers(tmp_path: Path) -> None:
    out = tmp_path / "o"
    with OutputFolder.open(out, FP) as folder:
        writer = folder.writer(SCHEMA, 1, 1e9)
        for row_id in (0, 1):
            writer.add_row_group(samples(row_id))
            writer.maybe_commit()
        folder.set_total_rows(4)
    with OutputFolder.open(out, FP) as folder:
        assert folder.completed_ids() == {0, 1}
        assert folder.counts()["rows"] == 2
        writer = folder.writer(SCHEMA, 1, 1e9)
        writer.add_row_group(samples(2))
        writer.commit()
    assert visible(out) == ["part-00000.parquet", "part-00001.parquet", "part-00002.parquet"]
    assert sorted(set(read_back(out).column("id").to_pylist())) == [0, 1, 2]
    assert "3 of 4 rows (75.0%)" in read_status(out)


def test_string_ids_round_trip(tmp_path: Path) -> None:
    schema = output_schema(pa.string(), [], logprobs=True)
    with OutputFolder.open(tmp_path / "o", FP) as folder:
        writer = folder.writer(schema, 10, 1e9)
        rows = [
            {**r, "id": "row-a", "cumulative_logprob": -1.5, "token_logprobs": [-0.5, -1.0]}
            for r in samples(0)
        ]
        writer.add_row_group(rows)
        writer.commit()
        assert folder.completed_ids() == {"row-a"}
    table = read_back(tmp_path / "o")
    assert table.column("token_logprobs").to_pylist()[0] == [-0.5, -1.0]
    assert "topic" not in table.schema.names  # extra keys in the row dicts are ignored


def test_add_row_group_checks(tmp_path: Path) -> None:
    with OutputFolder.open(tmp_path / "o", FP) as folder:
        writer = folder.writer(SCHEMA, 10, 1e9)
        with pytest.raises(ValueError):
            writer.add_row_group([])
        with pytest.raises(ValueError):
            writer.add_row_group(samples(0, n=1) + samples(1, n=1))


def test_report_and_finished(tmp_path: Path) -> None:
    out = tmp_path / "o"
    with OutputFolder.open(out, FP) as folder:
        folder.set_total_rows(1)
        writer = folder.writer(SCHEMA, 10, 1e9)
        writer.add_row_group(samples(0))
        writer.commit()
        assert "not finished" in read_status(out)
        folder.mark_finished()
        folder.write_report({"rows": 1, "elapsed_s": 2.0, "output_tokens_per_s": 3.0})
        assert folder.finished
    # Under the name docs/job-file.md gives it, whole (no temp file left); its content shows in the status.
    assert REPORT_NAME == ".batchgen/report.json" and (out / REPORT_NAME).is_file()
    assert hidden(out) == ["lock", "manifest.json", "report.json"]
    assert sorted(os.listdir(out)) == [".batchgen", "part-00000.parquet"]
    status = read_status(out)
    assert "state:         finished" in status
    assert "1 of 1 rows (100.0%)" in status and "3.0 output tokens/s" in status
    assert visible(out) == ["part-00000.parquet"]
    # A later commit means the job is not finished any more.
    with OutputFolder.open(out, FP) as folder:
        writer = folder.writer(SCHEMA, 10, 1e9)
        writer.add_row_group(samples(1))
        writer.commit()
        assert not folder.finished


def test_status_errors(tmp_path: Path) -> None:
    with pytest.raises(JobError, match="is not a folder"):
        read_status(tmp_path / "missing")
    with pytest.raises(JobError, match="not a batchgen output folder"):
        read_status(tmp_path)
    with OutputFolder.open(tmp_path / "o", FP):
        pass
    assert "0 rows (total not known yet)" in read_status(tmp_path / "o")


# --------------------------------------------------------------------------- refusals, --fresh


def test_different_job_is_refused_naming_what_differs(tmp_path: Path) -> None:
    out = tmp_path / "o"
    with OutputFolder.open(out, FP):
        pass
    other = {**FP, "sampling": "s2", "input": "i2"}
    with pytest.raises(JobError) as info:
        OutputFolder.open(out, other)
    message = str(info.value)
    assert "holds a different job: input, sampling differ; use --fresh" in message
    assert "\n" not in message


def test_fresh_deletes_only_our_files(tmp_path: Path) -> None:
    out = tmp_path / "o"
    with OutputFolder.open(out, FP) as folder:
        writer = folder.writer(SCHEMA, 10, 1e9)
        writer.add_row_group(samples(0))
        writer.commit()
        folder.write_report({"rows": 1})
    (out / "notes.txt").write_text("mine")
    (out / ".batchgen" / "logs").mkdir()
    (out / ".batchgen" / "logs" / "error-1.log").write_text("log")
    other = {**FP, "model": "m2"}
    with OutputFolder.open(out, other, fresh=True) as folder:
        assert folder.completed_ids() == set()
    # The folder now holds the other job: it resumes without --fresh, the first is refused.
    OutputFolder.open(out, other).close()
    with pytest.raises(JobError, match="model differs"):
        OutputFolder.open(out, FP)
    assert sorted(os.listdir(out)) == [".batchgen", "notes.txt"]
    assert hidden(out) == ["lock", "logs/error-1.log", "manifest.json"]


def test_foreign_folder_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "o"
    out.mkdir()
    (out / "data.parquet").write_text("someone else's")
    for fresh in (False, True):
        with pytest.raises(JobError, match="not a batchgen output folder"):
            OutputFolder.open(out, FP, fresh=fresh)
    assert sorted(os.listdir(out)) == ["data.parquet"]  # nothing added


def test_output_path_problems(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(JobError, match="is a file, not a folder"):
        OutputFolder.open(tmp_path / "file", FP)
    with pytest.raises(JobError, match="cannot create output folder"):
        OutputFolder.open(tmp_path / "file" / "sub", FP)


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_unwritable_folder(tmp_path: Path) -> None:
    out = tmp_path / "ro"
    out.mkdir()
    out.chmod(0o500)
    try:
        with pytest.raises(JobError, match="not writable"):
            OutputFolder.open(out, FP)
    finally:
        out.chmod(0o700)


def test_bad_manifests(tmp_path: Path) -> None:
    out = tmp_path / "o"
    with OutputFolder.open(out, FP):
        pass
    (out / MANIFEST_NAME).write_text('{"format": "batchgen-output", "vers')  # truncated
    with pytest.raises(JobError, match=r"cannot read \.batchgen/manifest\.json"):
        OutputFolder.open(out, FP)
    with OutputFolder.open(out, FP, fresh=True) as folder:
        assert folder.counts()["rows"] == 0
    (out / MANIFEST_NAME).write_text('{"something": "else"}')
    for fresh in (False, True):
        with pytest.raises(JobError, match="batchgen did not write"):
            OutputFolder.open(out, FP, fresh=fresh)


def test_folder_is_locked_while_open(tmp_path: Path) -> None:
    out = tmp_path / "o"
    folder = OutputFolder.open(out, FP)
    with pytest.raises(JobError, match="in use by another batchgen process"):
        OutputFolder.open(out, FP)
    folder.close()
    folder.close()  # idempotent
    OutputFolder.open(out, FP).close()


def test_forgotten_folder_releases_its_lock(tmp_path: Path) -> None:
    OutputFolder.open(tmp_path / "o", FP)  # never closed, dropped at once
    OutputFolder.open(tmp_path / "o", FP).close()


def test_schema_change_is_refused(tmp_path: Path) -> None:
    with OutputFolder.open(tmp_path / "o", FP) as folder:
        writer = folder.writer(SCHEMA, 10, 1e9)
        writer.add_row_group(samples(0))
        writer.commit()
        with pytest.raises(JobError, match="other columns"):
            folder.writer(output_schema(pa.int64(), [], logprobs=True), 10, 1e9)


def test_missing_listed_part_is_regenerated(tmp_path: Path) -> None:
    out = tmp_path / "o"
    with OutputFolder.open(out, FP) as folder:
        writer = folder.writer(SCHEMA, 1, 1e9)
        for row_id in (0, 1):
            writer.add_row_group(samples(row_id))
            writer.maybe_commit()
    (out / "part-00000.parquet").unlink()
    with OutputFolder.open(out, FP) as folder:
        assert folder.completed_ids() == {1}
        assert folder.counts()["rows"] == 1 and folder.counts()["parts"] == 1


def test_unreadable_listed_part(tmp_path: Path) -> None:
    out = tmp_path / "o"
    with OutputFolder.open(out, FP) as folder:
        writer = folder.writer(SCHEMA, 1, 1e9)
        writer.add_row_group(samples(0))
        writer.commit()
    (out / "part-00000.parquet").write_bytes(b"garbage")
    with OutputFolder.open(out, FP) as folder:
        with pytest.raises(JobError, match="part-00000.parquet is unreadable"):
            folder.completed_ids()


# --------------------------------------------------------------------------- crashes


class Crash(Exception):
    """Stands for the process dying at a step of the commit protocol."""


@pytest.mark.parametrize("step", COMMIT_STEPS)
def test_crash_at_each_commit_step_then_resume(tmp_path: Path, step: str) -> None:
    """The rename out of staging is the commit: a crash before it loses the part (its rows are
    generated again), a crash after it keeps the part (the next open lists it). Readers see the
    committed rows at every step, and nothing else."""
    out = tmp_path / "o"
    committed = step != "part_written"

    def crash_at(name: str) -> None:
        if name == step:
            raise Crash(name)

    seen_steps: list[str] = []
    folder = OutputFolder.open(out, FP)
    writer = folder.writer(SCHEMA, 100, 1e9, on_step=seen_steps.append)
    writer.add_row_group(samples(0))
    writer.commit()
    assert seen_steps == list(COMMIT_STEPS)

    writer = folder.writer(SCHEMA, 100, 1e9, on_step=crash_at)
    writer.add_row_group(samples(1))
    writer.add_row_group(samples(2))
    with pytest.raises(Crash):
        writer.commit()
    # A reader while the job is down sees exactly the committed rows; a staged part is hidden.
    first = [(0, 0), (0, 1)]
    later = [(i, k) for i in (1, 2) for k in range(2)]
    assert keys_of(read_back(out)) == first + (later if committed else [])
    left = {
        "part_written": ["staging/" + PART1],  # staged, never renamed
        "part_renamed": [],
        "manifest_written": [".manifest.json.tmp"],  # the manifest's update, never renamed
    }[step]
    assert hidden(out) == sorted(["lock", "manifest.json", *left])
    assert json.loads((out / MANIFEST_NAME).read_text())["totals"]["rows"] == 1
    folder.close()  # the process is gone

    # Reopen: leftovers are cleaned, a committed part the manifest lacks is listed.
    folder = OutputFolder.open(out, FP)
    assert folder.completed_ids() == ({0, 1, 2} if committed else {0})
    assert folder.counts()["rows"] == (3 if committed else 1)
    assert folder.counts()["samples"] == (6 if committed else 2)
    assert visible(out) == ["part-00000.parquet"] + ([PART1] if committed else [])
    assert hidden(out) == ["lock", "manifest.json"]
    assert keys_of(read_back(out)) == first + (later if committed else [])

    # Resume: the lost rows are written again, exactly once.
    writer = folder.writer(SCHEMA, 100, 1e9)
    for row_id in (1, 2, 3):
        if row_id not in folder.completed_ids():
            writer.add_row_group(samples(row_id))
    writer.commit()
    folder.close()
    keys = keys_of(read_back(out))
    assert sorted(keys) == [(i, k) for i in range(4) for k in range(2)]
    assert len(keys) == len(set(keys))
    assert len(visible(out)) == (3 if committed else 2)
    assert OutputFolder.open(out, FP).completed_ids() == {0, 1, 2, 3}


PART1 = "part-00001.parquet"


def test_failed_commit_keeps_its_buffer(tmp_path: Path) -> None:
    def crash_once(name: str, calls: list[str] = []) -> None:  # noqa: B006 - a test counter
        if name == "part_renamed" and not calls:
            calls.append(name)
            raise Crash(name)

    with OutputFolder.open(tmp_path / "o", FP) as folder:
        writer = folder.writer(SCHEMA, 100, 1e9, on_step=crash_once)
        writer.add_row_group(samples(0))
        with pytest.raises(Crash):
            writer.commit()
        assert folder.completed_ids() == set()
        writer.commit()  # retried in the same process: same part number, overwritten
        assert folder.completed_ids() == {0}
    assert keys_of(read_back(tmp_path / "o")) == [(0, 0), (0, 1)]


def test_leftovers_of_a_crash_are_cleaned(tmp_path: Path) -> None:
    out = tmp_path / "o"
    with OutputFolder.open(out, FP) as folder:
        writer = folder.writer(SCHEMA, 100, 1e9)
        writer.add_row_group(samples(0))
        writer.commit()
    (out / ".batchgen" / "staging" / ".part-00001.parquet.tmp").write_bytes(b"half a file")
    (out / ".batchgen" / "staging" / "part-00001.parquet").write_bytes(b"staged, not renamed")
    (out / ".batchgen" / ".manifest.json.tmp").write_text("{")
    # Not the next part number: no commit of this protocol left it there.
    pq.write_table(pa.Table.from_pylist(samples(7), schema=SCHEMA), out / "part-00004.parquet")
    (out / ".DS_Store").write_text("not ours, left alone")
    with OutputFolder.open(out, FP) as folder:
        assert folder.completed_ids() == {0}
    assert sorted(os.listdir(out)) == [".DS_Store", ".batchgen", "part-00000.parquet"]
    assert hidden(out) == ["lock", "manifest.json"]


def test_unreadable_unlisted_newest_part(tmp_path: Path) -> None:
    """A part under the next number is committed (it got there by its rename): if it cannot be
    read, the folder cannot be resumed as it is, and says so in one line."""
    out = tmp_path / "o"
    OutputFolder.open(out, FP).close()
    (out / "part-00000.parquet").write_bytes(b"garbage")
    with pytest.raises(JobError, match="committed part part-00000.parquet is unreadable"):
        OutputFolder.open(out, FP)


def test_a_full_disk_at_the_manifest_update_counts_the_committed_part(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The part is committed by its rename; a full disk while the manifest is updated after it
    says those rows are saved too (the next open lists the part)."""
    out = tmp_path / "o"
    real = results_local.write_durably

    def full_at_manifest(folder: Path, name: str, *args: object, **kwargs: object) -> None:
        if name == "manifest.json":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(folder, name, *args, **kwargs)

    with OutputFolder.open(out, FP) as folder:
        writer = folder.writer(SCHEMA, 100, 1e9)
        writer.add_row_group(samples(0))
        writer.commit()
        monkeypatch.setattr(results_local, "write_durably", full_at_manifest)
        writer.add_row_group(samples(1))
        writer.add_row_group(samples(2))
        with pytest.raises(OutputFullError, match="3 rows are saved there"):
            writer.commit()
        monkeypatch.undo()
    assert keys_of(read_back(out)) == [(i, k) for i in range(3) for k in range(2)]
    with OutputFolder.open(out, FP) as folder:
        assert folder.completed_ids() == {0, 1, 2} and folder.counts()["rows"] == 3
