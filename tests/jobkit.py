"""Helpers for tests that run whole jobs: write a prompts file and a job file, run the CLI,
read the results back sorted by (id, sample_index).

The one place for these: test files import from here, never from each other.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import yaml
from click.testing import CliRunner, Result

from batchgen.cli import main
from batchgen.results import MANIFEST_NAME


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
    """Write ``tmp/prompts.parquet`` (``prompts`` with ids 0.., or ``table``) and a job file
    reading it; return the job file's path. The engine runs in float32 on the CPU unless
    ``engine`` names a dtype or a device: ``auto`` gives bf16 on CPUs with bf16 matrix
    instructions (and CUDA + bf16 on a GPU), and tests that compare tokens exactly choose their
    numerics and their device."""
    tmp.mkdir(parents=True, exist_ok=True)
    if table is None:
        table = pa.table({"id": list(range(len(prompts))), "prompt": prompts})
    pq.write_table(table, tmp / "prompts.parquet")
    job = {
        "model": str(model),
        "input": {"path": "prompts.parquet", **(input_extra or {})},
        "output": {"path": output},
        "sampling": sampling or {},
        "engine": {"dtype": "float32", "device": "cpu", **(engine or {})},
    }
    return write_job_file(tmp, job, name)


def write_job_file(tmp: Path, job: Mapping[str, Any] | str, name: str = "job.yaml") -> Path:
    """Write a job file as given: a mapping dumped as YAML, or text as it is (for files that
    are malformed on purpose). No prompts file is written."""
    tmp.mkdir(parents=True, exist_ok=True)
    path = tmp / name
    path.write_text(job if isinstance(job, str) else yaml.safe_dump(dict(job), sort_keys=False))
    return path


def copy_model(model: Path, tmp: Path, name: str = "model") -> Path:
    """A private copy of a model folder, ``tmp/name``, for a test that damages it."""
    return Path(shutil.copytree(model, tmp / name))


def invoke(*args: str | Path) -> Result:
    """Run the CLI in this process with these arguments; the result, whatever its exit code."""
    return CliRunner().invoke(main, [str(a) for a in args])


def one_line(result: Result, code: int, *needles: str) -> str:
    """Assert the exit code is ``code`` and stderr is ONE line holding every needle, with no
    traceback anywhere; return that line."""
    for stream in (result.stdout, result.stderr):
        assert "Traceback" not in stream, stream
    assert result.exit_code == code, (result.exit_code, result.output, result.exception)
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].strip(), result.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def run_cli(*args: str | Path, expect: int = 0) -> Result:
    """Run the CLI and assert its exit code."""
    result = invoke(*args)
    assert result.exit_code == expect, (result.exit_code, result.output, result.exception)
    return result


def read_results(out: Path) -> list[dict]:
    rows = ds.dataset(out, format="parquet").to_table().to_pylist()
    return sorted(rows, key=lambda r: (r["id"], r["sample_index"]))


def run_job(job: Path, *extra: str) -> list[dict]:
    run_cli("run", str(job), "--quiet", *extra)
    return read_results(job.parent / yaml.safe_load(job.read_text())["output"]["path"])


def refusal(result: Result) -> str:
    """The one stderr line of an exit-2 refusal (asserted: exit 2, no traceback, one line)."""
    line = one_line(result, 2)
    assert line.startswith("error: "), line
    return line


def manifest_of(out: Path) -> dict[str, Any] | None:
    """The output folder's manifest, or None while there is none (or it is being replaced)."""
    try:
        return json.loads((out / MANIFEST_NAME).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def committed_rows(out: Path) -> int:
    """Input rows the manifest lists as committed (0 without a manifest)."""
    m = manifest_of(out)
    return m["totals"]["rows"] if m else 0


def fake_rows(row_id: int, n: int = 2) -> list[dict[str, Any]]:
    """The ``n`` output rows of one input row, as a writer takes them (made up, not generated)."""
    return [
        {
            "id": row_id,
            "sample_index": k,
            "text": f"text {row_id}.{k}",
            "token_ids": [1, 2],
            "finish_reason": "length",
            "error": None,
            "num_prompt_tokens": 3,
            "num_cached_tokens": 0,
            "num_output_tokens": 2,
        }
        for k in range(n)
    ]


def samples_with_and_without_prefix_cache(
    tmp: Path, model: Path, prompts: list[str], sampling: dict
) -> list[dict]:
    """Run ``prompts`` twice: with the prefix cache and batches of up to 16 sequences, and one
    sequence per 5-token step without it (block size 4 both); assert the same samples (up to
    near-ties, :func:`tests.ties.compare_samples`) and return the first run's rows."""
    from tests.ties import compare_samples

    a = run_job(write_job(tmp / "a", model, prompts, sampling=sampling, engine={"block_size": 4}))
    lone = {"block_size": 4, "max_num_seqs": 1, "max_num_batched_tokens": 5}
    b = run_job(
        write_job(
            tmp / "b", model, prompts, sampling=sampling, engine=lone | {"prefix_caching": False}
        )
    )
    compare_samples(b, a, model=model, prompts=dict(enumerate(prompts)), sampling=sampling)
    return a
