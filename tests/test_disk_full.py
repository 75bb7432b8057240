"""A full disk (or quota) while committing: one line, exit 1, no traceback file; the committed
rows stay and running the same command again resumes exactly."""

from __future__ import annotations

import errno
import json
import os
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from batchgen.results import MANIFEST_NAME
from batchgen.tiny_model import make_prompts
from tests.jobkit import invoke, one_line, read_results, run_job, write_job
from tests.ties import compare_samples

# Plain seeds: the resumed rows are compared with tests.ties.compare_samples, any seed must pass.
PROMPTS = make_prompts(10, seed=0, min_words=2, max_words=8)
SAMPLING = {"n": 2, "max_tokens": 4, "temperature": 0.8, "seed": 0, "ignore_eos": True}
ENGINE = {"block_size": 4, "max_num_seqs": 2}


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT], ids=["ENOSPC", "EDQUOT"])
def test_disk_full_during_a_commit(
    tiny_model: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    model = tiny_model("llama", num_heads=4, num_kv_heads=2, head_dim=24)

    def job_in(folder: Path) -> Path:
        return write_job(folder, model, PROMPTS, sampling=SAMPLING, engine=ENGINE)

    reference = run_job(job_in(tmp_path / "ref"))
    job = job_in(tmp_path / "job")
    out = tmp_path / "job" / "out"
    real_write = pq.write_table
    calls = {"n": 0}

    def write_until_full(table: Any, where: Any, **kwargs: Any) -> None:
        calls["n"] += 1
        if calls["n"] == 1:
            return real_write(table, where, **kwargs)
        where.write(b"PAR1 and then the disk was full")
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(pq, "write_table", write_until_full)
    # A commit every 2 input rows (4 output rows): the first commit succeeds, the second fails.
    result = invoke("run", job, "--quiet", "--set", "output.commit_rows=4")
    saved = 2  # the rows of the one commit that succeeded
    line = one_line(result, 1, "error: ", str(out), os.strerror(code), f"{saved} rows", "resume")
    assert line.startswith("error: ") and "internal error" not in line, line
    assert json.loads((out / MANIFEST_NAME).read_text())["totals"]["rows"] == saved
    # No traceback log and no half-written temp file is left in the folder.
    assert sorted(os.listdir(out)) == [".batchgen", "part-00000.parquet"]
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()) == [
        ".batchgen/lock",
        MANIFEST_NAME,
        "part-00000.parquet",
    ]
    partial = read_results(out)
    assert len({r["id"] for r in partial}) == saved and len(partial) == saved * SAMPLING["n"]

    monkeypatch.undo()
    rows = run_job(job)
    assert Counter((r["id"], r["sample_index"]) for r in rows) == Counter(
        (i, k) for i in range(len(PROMPTS)) for k in range(SAMPLING["n"])
    )
    report = json.loads((out / ".batchgen" / "report.json").read_text())
    assert report["finished"] is True and report["rows_already_done"] == saved
    # The saved rows came from the same batches as the reference's: bit-exact; the resume left
    # them as they were.
    tokens = {(r["id"], r["sample_index"]): r["token_ids"] for r in rows}
    expected = {(r["id"], r["sample_index"]): r["token_ids"] for r in reference}
    for r in partial:
        key = (r["id"], r["sample_index"])
        assert r["token_ids"] == expected[key] == tokens[key], key
    # The resumed ones ran in other batches: equal up to near-tie flips.
    by_id = dict(enumerate(PROMPTS))
    compare_samples(rows, reference, model=model, prompts=by_id, sampling=SAMPLING)
