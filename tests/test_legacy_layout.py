"""Output folders in the earlier layout (``_manifest.json``, ``_report.json``,
``_batch_output.jsonl`` and ``.batchgen.lock`` beside the parts): ``status`` and ``validate``
read them, a job resumes them, moving them into ``.batchgen/`` once (batchgen/legacy_layout.py),
and a migration killed at any step is resumed without losing or repeating a row.

An earlier-layout folder is made from one written now, by moving its files back to the earlier
names: the parts and the manifest's content are the same in both layouts.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from batchgen.errors import JobError
from batchgen.results import OutputFolder, read_manifest
from batchgen.schema import output_schema
from batchgen.status import read_status
from batchgen.tiny_model import make_prompts
from tests.jobkit import fake_rows, manifest_of, read_results, run_cli, run_job, write_job

FP = {"model": "m1", "input": "i1", "sampling": "s1"}
SCHEMA = output_schema(pa.int64(), [], logprobs=False)
# new name (under .batchgen/) -> the earlier layout's name (beside the parts)
LEGACY = {
    "report.json": "_report.json",
    "batch_output.jsonl": "_batch_output.jsonl",
    "manifest.json": "_manifest.json",
}


def to_earlier_layout(out: Path) -> None:
    """Turn a closed output folder into the earlier layout (as an earlier batchgen left it)."""
    hidden = out / ".batchgen"
    for new, old in LEGACY.items():
        if (hidden / new).exists():
            os.replace(hidden / new, out / old)
    shutil.rmtree(hidden)
    (out / ".batchgen.lock").touch()


def files(out: Path) -> list[str]:
    return sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())


def earlier_folder(out: Path) -> None:
    """An earlier-layout folder holding rows 0..4 in two parts, a report and a batch output."""
    with OutputFolder.open(out, FP) as folder:
        for ids in (range(0, 3), range(3, 5)):
            writer = folder.writer(SCHEMA, 10**6, 1e9)
            for i in ids:
                writer.add_row_group(fake_rows(i))
            writer.commit()
        folder.write_report({"rows": 5, "elapsed_s": 1.0, "output_tokens_per_s": 20.0})
    (out / ".batchgen" / "batch_output.jsonl").write_text('{"custom_id": "a"}\n')
    to_earlier_layout(out)
    # the earlier layout's temp files of a commit a crash interrupted
    (out / ".part-00002.parquet.tmp").write_bytes(b"half a part")
    (out / "._manifest.json.tmp").write_text("{")


def keys(out: Path) -> list[tuple[int, int]]:
    table = ds.dataset(out, format="parquet").to_table()
    return sorted(zip(table["id"].to_pylist(), table["sample_index"].to_pylist(), strict=True))


EXPECTED = [(i, k) for i in range(5) for k in range(2)]


def test_an_earlier_folder_is_read_and_migrated(tmp_path: Path) -> None:
    out = tmp_path / "o"
    earlier_folder(out)
    manifest = json.loads((out / "_manifest.json").read_text())
    assert read_manifest(out) == manifest
    status = read_status(out)
    assert "5 rows" in status and "20.0 output tokens/s" in status  # its _report.json
    with OutputFolder.open(out, FP) as folder:
        assert folder.completed_ids() == set(range(5))
    assert files(out) == [
        ".batchgen/batch_output.jsonl",
        ".batchgen/lock",
        ".batchgen/manifest.json",
        ".batchgen/report.json",
        "part-00000.parquet",
        "part-00001.parquet",
    ]
    assert read_manifest(out) == manifest  # moved as it was
    assert "20.0 output tokens/s" in read_status(out)
    assert keys(out) == EXPECTED


class Crash(Exception):
    """Stands for the process dying in the middle of a migration."""


@pytest.mark.parametrize("moved", [0, 1, 2, 3])
def test_a_migration_killed_at_each_step_resumes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, moved: int
) -> None:
    """Killed after ``moved`` of its renames (the report, the batch output, the manifest; 3:
    before the earlier lock is removed): status and readers see the same rows meanwhile, the
    next open finishes the migration, no row is lost or repeated."""
    out = tmp_path / "o"
    earlier_folder(out)
    before = {old: (out / old).read_bytes() for old in LEGACY.values()}
    real_replace, real_unlink = os.replace, Path.unlink
    done: list[str] = []

    def replace(src: Any, dst: Any) -> None:
        if Path(src).name in LEGACY.values():
            if len(done) == moved:
                raise Crash(src)
            done.append(Path(src).name)
        real_replace(src, dst)

    def unlink(self: Path, missing_ok: bool = False) -> None:
        if self.name == ".batchgen.lock":
            raise Crash(self)
        real_unlink(self, missing_ok=missing_ok)

    with monkeypatch.context() as m:
        m.setattr(os, "replace", replace)
        m.setattr(Path, "unlink", unlink)
        with pytest.raises(Crash):
            OutputFolder.open(out, FP)
    assert done == list(LEGACY.values())[:moved]
    # Meanwhile: the folder reads as it did, in whichever layout its manifest is.
    assert "5 rows" in read_status(out)
    assert keys(out) == EXPECTED

    with OutputFolder.open(out, FP) as folder:
        assert folder.completed_ids() == set(range(5))
        assert folder.counts()["rows"] == 5
    assert not [n for n in os.listdir(out) if n.startswith("_") or n.endswith((".tmp", ".lock"))]
    for new, old in LEGACY.items():
        assert (out / ".batchgen" / new).read_bytes() == before[old]
    assert keys(out) == EXPECTED


def test_an_earlier_writer_keeps_a_job_out(tmp_path: Path) -> None:
    """An earlier batchgen writing the folder holds ``.batchgen.lock``: the folder is refused,
    and left as it was."""
    out = tmp_path / "o"
    earlier_folder(out)
    before = files(out)
    fd = os.open(out / ".batchgen.lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(JobError, match="in use by another batchgen process"):
            OutputFolder.open(out, FP)
    finally:
        os.close(fd)
    assert files(out) == before


def test_two_different_manifests_are_refused(tmp_path: Path) -> None:
    """An earlier batchgen run on a migrated folder writes ``_manifest.json`` again: which one
    holds the job is not batchgen's to guess."""
    out = tmp_path / "o"
    earlier_folder(out)
    OutputFolder.open(out, FP).close()
    manifest = manifest_of(out)
    (out / "_manifest.json").write_text(json.dumps({**manifest, "next_part": 7}))
    with pytest.raises(JobError, match="holds two different manifests") as info:
        OutputFolder.open(out, FP)
    assert "\n" not in str(info.value)
    # the same bytes under both names: a copy, the earlier one is dropped
    (out / "_manifest.json").write_bytes((out / ".batchgen" / "manifest.json").read_bytes())
    OutputFolder.open(out, FP).close()
    assert not (out / "_manifest.json").exists()


def test_an_earlier_job_folder_resumes_through_the_cli(tiny_model: Any, tmp_path: Path) -> None:
    """A job's folder in the earlier layout, stopped by a crash between a part's rename and the
    manifest's update (the earlier protocol's order): ``status`` and ``validate`` read it, ``run``
    migrates it, keeps that part (whole rows, written once), and finishes the rest."""
    model = tiny_model("llama")
    prompts = make_prompts(8, seed=2)
    sampling = {"n": 2, "max_tokens": 3, "seed": 0}
    job = write_job(tmp_path, model, prompts, sampling=sampling, engine={"max_num_seqs": 2})
    full = run_job(job, "--set", "output.commit_rows=4")
    out = tmp_path / "out"
    parts = manifest_of(out)["parts"]
    assert len(parts) >= 3
    # The earlier layout, the job stopped after its second part's rename: the manifest lists
    # the first part only; the third part never existed.
    (out / parts[2]["name"]).unlink()
    kept = {n: pq.read_table(out / n).to_pylist() for n in (parts[0]["name"], parts[1]["name"])}
    m = manifest_of(out)
    first = m["parts"][:1]
    totals = {k: first[0][k] for k in m["totals"] if k != "parts"}
    m.update(parts=first, next_part=1, finished=False, totals={**totals, "parts": 1})
    (out / ".batchgen" / "manifest.json").write_text(json.dumps(m))
    to_earlier_layout(out)

    status = run_cli("status", str(out)).stdout
    assert "not finished" in status and f"{parts[0]['rows']} of 8 rows" in status
    assert f"resumes: {parts[0]['rows']} of 8 rows done" in run_cli("validate", str(job)).stdout
    run_cli("run", str(job), "--quiet")
    assert not [n for n in os.listdir(out) if not n.startswith(("part-", ".batchgen"))]
    assert not (out / ".batchgen.lock").exists()
    got = read_results(out)
    assert [(r["id"], r["sample_index"]) for r in got] == [
        (r["id"], r["sample_index"]) for r in full
    ]
    for name, part_rows in kept.items():  # the committed parts, as they were
        assert pq.read_table(out / name).to_pylist() == part_rows
    assert manifest_of(out)["finished"] and "finished" in run_cli("status", str(out)).stdout
