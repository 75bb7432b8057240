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
from click.testing import CliRunner

from batchgen.cli import main
from batchgen.results import MANIFEST_NAME
from batchgen.tiny_model import make_prompts
from tests.jobkit import read_results, run_job, write_job

PROMPTS = make_prompts(10, seed=5, min_words=2, max_words=8)
SAMPLING = {"n": 2, "max_tokens": 4, "temperature": 0.8, "seed": 1, "ignore_eos": True}
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
    result = CliRunner().invoke(main, ["run", str(job), "--quiet", "--set", "output.commit_rows=4"])
    assert result.exit_code == 1, (result.output, result.exception)
    assert "Traceback" not in result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    line = lines[0]
    assert line.startswith("error: ") and "internal error" not in line, line
    saved = json.loads((out / MANIFEST_NAME).read_text())["totals"]["rows"]
    assert saved == 2, line
    for needle in (str(out), os.strerror(code), f"{saved} rows", "resume"):
        assert needle in line, (needle, line)
    # No traceback log and no half-written temp file is left in the folder.
    assert sorted(os.listdir(out)) == [".batchgen.lock", MANIFEST_NAME, "part-00000.parquet"]
    assert len(read_results(out)) == saved * SAMPLING["n"]

    monkeypatch.undo()
    rows = run_job(job)
    assert Counter((r["id"], r["sample_index"]) for r in rows) == Counter(
        (i, k) for i in range(len(PROMPTS)) for k in range(SAMPLING["n"])
    )
    assert [r["token_ids"] for r in rows] == [r["token_ids"] for r in reference]
