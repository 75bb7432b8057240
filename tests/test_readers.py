"""The output folder as its readers open it (docs/job-file.md, "The output folder"): pandas,
pyarrow.dataset, DuckDB and polars over ``path/*.parquet``, and Hugging Face datasets
(``load_dataset(path)``, ``load_dataset("parquet", data_dir=path)``), each given the folder as it
is, with no filter.

Each must see exactly the committed rows, and nothing else, in every state a folder can be in:
finished; mid-job (a writer holding it, a part staged but not committed, a part committed but
not yet in the manifest, the manifest's update in flight); after a ``kill -9``; in the earlier
layout's place after migration. What "committed" is comes from batchgen itself, after the fact:
the ids that reopening the folder counts as done (:meth:`OutputFolder.completed_ids`).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from batchgen.results import COMMIT_STEPS, OutputFolder
from batchgen.schema import output_schema
from batchgen.tiny_model import make_prompts
from tests.jobkit import committed_rows, fake_rows, manifest_of, read_results, run_job, write_job

FP = {"model": "m1", "input": "i1", "sampling": "s1"}
SCHEMA = output_schema(pa.int64(), [], logprobs=False)
N = 2  # samples per input row
Keys = list[tuple[int, int]]


# --------------------------------------------------------------------------- the readers


@pytest.fixture(scope="module")
def hf_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Hugging Face datasets kept off the network and out of ~/.cache: its settings are read
    when it is imported, so they are set before (the readers import it on first use), and put
    back after this module's tests."""
    cache = tmp_path_factory.mktemp("hf")
    with pytest.MonkeyPatch.context() as m:
        for key, value in {
            "HF_HOME": str(cache / "home"),
            "HF_DATASETS_CACHE": str(cache / "datasets"),
            "HF_HUB_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1",
            "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
        }.items():
            m.setenv(key, value)
        yield cache


def _keys(ids: list[Any], samples: list[Any]) -> Keys:
    return sorted(zip((int(i) for i in ids), (int(k) for k in samples), strict=True))


def _pandas(out: Path, cache: Path) -> Keys:
    import pandas as pd

    frame = pd.read_parquet(out)
    return _keys(frame["id"].tolist(), frame["sample_index"].tolist())


def _pyarrow_dataset(out: Path, cache: Path) -> Keys:
    import pyarrow.dataset as ds

    table = ds.dataset(out).to_table()
    return _keys(table.column("id").to_pylist(), table.column("sample_index").to_pylist())


def _duckdb(out: Path, cache: Path) -> Keys:
    import duckdb

    rows = duckdb.sql(f"SELECT id, sample_index FROM read_parquet('{out}/*.parquet')").fetchall()
    return _keys([r[0] for r in rows], [r[1] for r in rows])


def _polars(out: Path, cache: Path) -> Keys:
    import polars as pl

    frame = pl.read_parquet(f"{out}/*.parquet")
    return _keys(frame["id"].to_list(), frame["sample_index"].to_list())


def _hf_dataset(kind: str) -> Callable[[Path, Path], Keys]:
    def read(out: Path, cache: Path) -> Keys:
        from datasets import load_dataset

        # A cache of its own per read: a folder read again in another state is read anew.
        cache_dir = str(cache / f"{kind}-{time.monotonic_ns()}")
        if kind == "dir":
            loaded = load_dataset(str(out), cache_dir=cache_dir)
        else:
            loaded = load_dataset("parquet", data_dir=str(out), cache_dir=cache_dir)
        train = loaded["train"]
        return _keys(train["id"], train["sample_index"])

    return read


READERS: dict[str, Callable[[Path, Path], Keys]] = {
    "pandas.read_parquet(path)": _pandas,
    "pyarrow.dataset.dataset(path)": _pyarrow_dataset,
    "duckdb read_parquet('path/*.parquet')": _duckdb,
    "polars.read_parquet('path/*.parquet')": _polars,
    "datasets.load_dataset(path)": _hf_dataset("dir"),
    'datasets.load_dataset("parquet", data_dir=path)': _hf_dataset("data_dir"),
}


def assert_readers_see(out: Path, expected: Keys, cache: Path) -> None:
    """Every reader, given the folder as it is, reads exactly ``expected``."""
    seen = {name: read(out, cache) for name, read in READERS.items()}
    wrong = {name: keys for name, keys in seen.items() if keys != sorted(expected)}
    assert not wrong, f"expected {len(expected)} rows; {wrong}"


def committed_keys(out: Path) -> Keys:
    """The (id, sample_index) pairs the folder holds committed, as batchgen counts them when it
    opens the folder (every committed row has all N samples)."""
    fingerprint = dict(manifest_of(out)["fingerprint"])  # the folder's own job
    with OutputFolder.open(out, fingerprint) as folder:
        return sorted((i, k) for i in folder.completed_ids() for k in range(N))


def commit(folder: OutputFolder, ids: range, on_step: Any = None) -> None:
    writer = folder.writer(SCHEMA, 10**6, 1e9, on_step=on_step)
    for i in ids:
        writer.add_row_group(fake_rows(i))
    writer.commit()


def keys_of(ids: range) -> Keys:
    return [(i, k) for i in ids for k in range(N)]


# --------------------------------------------------------------------------- the states


def test_a_finished_job(tiny_model: Any, tmp_path: Path, hf_cache: Path) -> None:
    model = tiny_model("llama")
    prompts = make_prompts(6, seed=3)
    sampling = {"n": N, "max_tokens": 3, "seed": 0}
    job = write_job(tmp_path, model, prompts, sampling=sampling, engine={"max_num_seqs": 2})
    results = run_job(job, "--set", "output.commit_rows=4")  # rows finish apart: several parts
    out = tmp_path / "out"
    assert manifest_of(out)["finished"] and len(manifest_of(out)["parts"]) > 1
    assert sorted(os.listdir(out))[0] == ".batchgen"  # and the parts, nothing else
    assert all(n.startswith("part-") for n in sorted(os.listdir(out))[1:])
    assert_readers_see(out, [(r["id"], r["sample_index"]) for r in results], hf_cache)
    assert len(results) == 6 * N


def test_a_folder_being_written(tmp_path: Path, hf_cache: Path) -> None:
    """The writer holds the folder (its lock), rows wait in its buffer: only committed rows."""
    out = tmp_path / "o"
    with OutputFolder.open(out, FP) as folder:
        commit(folder, range(0, 3))
        commit(folder, range(3, 5))
        writer = folder.writer(SCHEMA, 10**6, 1e9)
        writer.add_row_group(fake_rows(5))  # buffered, not committed
        assert_readers_see(out, keys_of(range(5)), hf_cache)


class Crash(Exception):
    """Stands for the process dying at a step of a commit."""


@pytest.mark.parametrize("step", COMMIT_STEPS)
def test_a_folder_mid_commit(tmp_path: Path, hf_cache: Path, step: str) -> None:
    """A commit stopped at each of its steps (and the process gone): a staged part, a committed
    part the manifest does not list yet, the manifest's temp file. Readers see the committed
    rows, before the folder is reopened and after; a staged part is never visible."""
    out = tmp_path / "o"
    folder = OutputFolder.open(out, FP)
    commit(folder, range(0, 3))

    def crash_at(name: str) -> None:
        if name == step:
            raise Crash(name)

    with pytest.raises(Crash):
        commit(folder, range(3, 6), on_step=crash_at)
    folder.close()
    staged = sorted((out / ".batchgen" / "staging").iterdir())
    assert bool(staged) == (step == "part_written")
    expected = committed_keys(out)  # reopens it: the manifest now lists the committed part
    assert expected == keys_of(range(3 if step == "part_written" else 6))
    assert_readers_see(out, expected, hf_cache)


@pytest.mark.timeout(600)
def test_a_folder_after_kill_9(tiny_model: Any, tmp_path: Path, hf_cache: Path) -> None:
    """A real ``batchgen run`` killed with SIGKILL, while a part is staged if the kill can catch
    one: readers see what batchgen counts as committed when it reopens the folder, and nothing
    of the staged part, before the reopening and after."""
    model = tiny_model("llama")
    prompts = make_prompts(400, seed=4)
    sampling = {"n": N, "max_tokens": 16, "ignore_eos": True, "seed": 0}
    job = write_job(tmp_path, model, prompts, sampling=sampling, engine={"max_num_seqs": 8})
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, "-m", "batchgen.cli", "run", str(job), "--quiet"]
        + ["--set", "output.commit_rows=8", "--set", "output.commit_seconds=0.05"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    staging = out / ".batchgen" / "staging"
    deadline = time.monotonic() + 240
    while proc.poll() is None and committed_rows(out) == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    # Then, for up to 3 s, a moment when a part is staged (a commit in flight).
    until = time.monotonic() + 3
    while proc.poll() is None and time.monotonic() < until:
        if staging.is_dir() and any(True for _ in staging.iterdir()):
            break
        time.sleep(0.0005)
    assert proc.poll() is None, f"the run ended before it could be killed: {proc.stderr.read()}"
    proc.kill()
    proc.wait(timeout=60)

    manifest = manifest_of(out)
    assert manifest is not None and not manifest["finished"]
    before = {name: read(out, hf_cache) for name, read in READERS.items()}
    expected = committed_keys(out)
    assert 0 < len(expected) < 400 * N
    assert before == {name: expected for name in READERS}, {
        name: len(keys) for name, keys in before.items()
    }
    assert_readers_see(out, expected, hf_cache)
    assert read_results(out) and not any(True for _ in staging.iterdir())  # cleaned on reopen
