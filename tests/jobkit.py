"""Helpers for tests that run whole jobs: write a prompts file and a job file, run the CLI,
read the results back sorted by (id, sample_index)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import yaml
from click.testing import CliRunner

from batchgen.cli import main


def write_job(
    tmp: Path,
    model: Path,
    prompts: list[Any] | None = None,
    *,
    table: pa.Table | None = None,
    sampling: dict | None = None,
    engine: dict | None = None,
    input_extra: dict | None = None,
    output: str = "out",
    name: str = "job.yaml",
) -> Path:
    tmp.mkdir(parents=True, exist_ok=True)
    if table is None:
        table = pa.table({"id": list(range(len(prompts))), "prompt": prompts})
    pq.write_table(table, tmp / "prompts.parquet")
    job = {
        "model": str(model),
        "input": {"path": "prompts.parquet", **(input_extra or {})},
        "output": {"path": output},
        "sampling": sampling or {},
        "engine": engine or {},
    }
    path = tmp / name
    path.write_text(yaml.safe_dump(job))
    return path


def run_cli(*args: str, expect: int = 0):
    result = CliRunner().invoke(main, list(args))
    assert result.exit_code == expect, (result.exit_code, result.output, result.exception)
    return result


def read_results(out: Path) -> list[dict]:
    rows = ds.dataset(out, format="parquet").to_table().to_pylist()
    return sorted(rows, key=lambda r: (r["id"], r["sample_index"]))


def run_job(job: Path, *extra: str) -> list[dict]:
    run_cli("run", str(job), "--quiet", *extra)
    return read_results(job.parent / yaml.safe_load(job.read_text())["output"]["path"])


def invoke(*args: Any):
    """Run the CLI in this process and return click's Result, whatever the exit code."""
    return CliRunner().invoke(main, [str(a) for a in args])


def refusal(result) -> str:
    """The one stderr line of an exit-2 refusal (asserted: exit 2, no traceback, one line)."""
    assert result.exit_code == 2, (result.exit_code, result.output)
    assert "Traceback" not in result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ")
    return lines[0]


def manifest_of(out: Path) -> dict[str, Any] | None:
    """The output folder's manifest, or None while there is none (or it is being replaced)."""
    import json

    from batchgen.results import MANIFEST_NAME

    try:
        return json.loads((out / MANIFEST_NAME).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def committed_rows(out: Path) -> int:
    """Input rows the manifest lists as committed (0 without a manifest)."""
    m = manifest_of(out)
    return m["totals"]["rows"] if m else 0
