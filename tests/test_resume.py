"""Kill it anywhere, lose nothing: real ``batchgen run`` processes killed with SIGKILL at random
moments (mid-commit among them), stopped with SIGINT / SIGTERM (once and twice), then resumed
until done; the fingerprint check through the CLI; ``batchgen status``.

Every resumed folder must end up equal to one uninterrupted run: each ``(id, sample_index)``
exactly once, every Parquet file readable, committed rows never changed afterwards, and the token
ids the uninterrupted run's up to near-tie flips (tests/ties.py: a resumed run batches rows
differently). A kill loses at most the rows finished since the last commit, which is never much
older than ``commit_seconds``. The figures (kills, rows, duplicates, near-ties, commit ages at the
kills) are printed; ``pytest -s`` shows them.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from batchgen.results import MANIFEST_NAME, REPORT_NAME
from batchgen.tiny_model import make_prompts
from tests.jobkit import (
    committed_rows,
    invoke,
    manifest_of,
    read_results,
    refusal,
    run_cli,
    write_job,
)
from tests.ties import compare_samples

ROWS = 768  # enough work that six kills land before a fast, quiet machine finishes (384 did not
# on an AVX512-BF16 EPYC with nothing else running: the fourth kill found the job done)
N = 2
SAMPLING = {
    "n": N,
    "max_tokens": 32,
    "temperature": 0.9,
    "top_p": 0.95,
    "seed": 0,  # any seed must pass
    "ignore_eos": True,
}
ENGINE = {"block_size": 8, "max_num_seqs": 16}
# Commit after every few finished rows, so kills land in and around commits often.
FAST_COMMITS = ("--set", "output.commit_rows=4", "--set", "output.commit_seconds=0.05")
# Commit by time only, for the age of the last commit at a kill.
COMMIT_SECONDS = 0.5
TIMED_COMMITS = (
    "--set",
    "output.commit_rows=1000000",
    "--set",
    f"output.commit_seconds={COMMIT_SECONDS}",
)
MODEL_ARGS = dict(num_heads=4, num_kv_heads=2, head_dim=24)
PROC_TIMEOUT = 240  # seconds; a loaded 2-core machine starts torch slowly


# --------------------------------------------------------------------------- helpers


def leftovers(out: Path) -> list[str]:
    """Traces of an unfinished commit: what is in staging, temp files, and part files the
    manifest does not list (one, committed by its rename, that the next open records)."""
    m = manifest_of(out)
    listed = {p["name"] for p in m["parts"]} if m else set()
    hidden = out / ".batchgen"
    return sorted(
        [name for name in os.listdir(out) if name.startswith("part-") and name not in listed]
        + [str(p.relative_to(out)) for p in (hidden / "staging").glob("*")]
        + [str(p.relative_to(out)) for p in hidden.glob("*.tmp")]
    )


Tokens = dict[tuple[Any, int], list[int]]


def check_folder(out: Path, kept: Tokens | None = None) -> dict[str, int]:
    """Read the folder as a user would: every Parquet file readable on its own
    (pyarrow.parquet) and all together (pyarrow.dataset), each (id, sample_index) at most once,
    every id with all N samples. With ``kept``, add every committed sample's tokens to it, after
    asserting that samples already in it were not changed. Returns the figures."""
    m = manifest_of(out)
    assert m is not None
    # Nothing but the results is visible: the bookkeeping is under .batchgen/.
    assert all(n == ".batchgen" or n.startswith("part-") for n in os.listdir(out))
    for part in m["parts"]:
        assert (out / part["name"]).is_file(), f"listed part {part['name']} is missing"
    for name in sorted(os.listdir(out)):
        if name.startswith("part-"):
            pq.read_table(out / name)  # raises if unreadable
    rows = ds.dataset(out, format="parquet").to_table().to_pylist()
    keys = Counter((r["id"], r["sample_index"]) for r in rows)
    samples_per_id = Counter(r["id"] for r in rows)
    figures = {
        "samples": len(rows),
        "rows": len(samples_per_id),
        "duplicates": sum(c - 1 for c in keys.values()),
        "partial_rows": sum(1 for c in samples_per_id.values() if c != N),
    }
    assert figures["duplicates"] == 0 and figures["partial_rows"] == 0, figures
    if kept is not None:
        changed = [
            (r["id"], r["sample_index"])
            for r in rows
            if kept.setdefault((r["id"], r["sample_index"]), r["token_ids"]) != r["token_ids"]
        ]
        assert changed == [], f"committed samples changed: {changed[:5]}"
    return figures


def check_complete(out: Path, crash: SimpleNamespace, kept: Tokens | None = None) -> dict[str, int]:
    """The folder of a finished job: everything exactly once, committed samples unchanged, the
    tokens the uninterrupted run's up to near-tie flips."""
    figures = check_folder(out, kept)
    assert leftovers(out) == []
    assert manifest_of(out)["finished"] is True
    assert figures["samples"] == ROWS * N
    ties = compare_samples(
        read_results(out), crash.ref, model=crash.model, prompts=crash.prompts, sampling=SAMPLING
    )
    figures["near_ties"] = ties.exempt
    return figures


def start(job: Path, *args: str) -> subprocess.Popen[str]:
    """A real ``batchgen run`` in its own process."""
    return subprocess.Popen(
        [sys.executable, "-m", "batchgen.cli", "run", str(job), "--quiet", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for_commit(proc: subprocess.Popen[str], out: Path, rows_before: int) -> bool:
    """Wait until ``proc`` has committed rows (it is generating). False if it exited first."""
    deadline = time.monotonic() + PROC_TIMEOUT
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        if out.is_dir() and committed_rows(out) > rows_before:
            return True
        time.sleep(0.01)
    proc.kill()
    raise AssertionError("no commit in time")


def wait_for_temp_file(proc: subprocess.Popen[str], out: Path, timeout: float) -> bool:
    """Poll (fast) until a commit's staged part exists: a kill now lands inside a commit."""
    deadline = time.monotonic() + timeout
    staging = out / ".batchgen" / "staging"
    while time.monotonic() < deadline and proc.poll() is None:
        if staging.is_dir() and any(True for _ in staging.iterdir()):
            return True
        time.sleep(0.0005)
    return False


def age_at(iso: str, when: datetime) -> float:
    """Seconds from the manifest time ``iso`` (UTC) to ``when``."""
    then = datetime.strptime(iso, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=timezone.utc)
    return (when - then).total_seconds()


def finish(out: Path, job: Path, *args: str) -> str:
    """Resume to the end in this process (saves a torch start-up); returns its stderr."""
    result = run_cli("run", str(job), "--quiet", "--set", f"output.path={out}", *args)
    return result.stderr


# --------------------------------------------------------------------------- the shared job


@pytest.fixture(scope="module")
def crash(tiny_model, tmp_path_factory) -> SimpleNamespace:
    """A job of ROWS rows, run once uninterrupted (in this process) with the default commit
    settings: the reference samples, and the run's own pace, measured: the longest engine step,
    the longest wait between two steps that finished rows, the longest commit."""
    from batchgen.executors.local import LocalExecutor
    from batchgen.results import PartWriter

    model = tiny_model("llama", **MODEL_ARGS)
    base = tmp_path_factory.mktemp("resume")
    prompts = make_prompts(ROWS, seed=11, min_words=3, max_words=30)
    job = write_job(base, model, prompts, sampling=SAMPLING, engine=ENGINE, output="ref")
    steps: list[float] = []  # seconds per poll (one engine step)
    finished_at: list[float] = []  # when a step handed back finished rows
    commits: list[float] = []  # seconds per commit
    real_poll, real_commit = LocalExecutor.poll, PartWriter.commit

    def timed_poll(self: LocalExecutor) -> list:
        t = time.monotonic()
        groups = real_poll(self)
        steps.append(time.monotonic() - t)
        if groups:
            finished_at.append(time.monotonic())
        return groups

    def timed_commit(self: PartWriter) -> None:
        t = time.monotonic()
        real_commit(self)
        commits.append(time.monotonic() - t)

    t0 = time.time()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(LocalExecutor, "poll", timed_poll)
        mp.setattr(PartWriter, "commit", timed_commit)
        run_cli("run", str(job), "--quiet")
    t1 = time.time()
    ref_out = base / "ref"
    ref = read_results(ref_out)
    assert len(ref) == ROWS * N
    report = json.loads((ref_out / REPORT_NAME).read_text())
    gaps = [b - a for a, b in zip(finished_at, finished_at[1:], strict=False)]
    pace = SimpleNamespace(step=max(steps), finish_gap=max(gaps), commit=max(commits))
    print(
        f"\n[resume] reference run: {ROWS} rows x n={N}, {report['output_tokens']} tokens in "
        f"{report['elapsed_s']:.1f}s of generation ({t1 - t0:.1f}s in all), "
        f"{report['engine_steps']} steps; longest step {pace.step:.3f}s, longest wait between "
        f"finished rows {pace.finish_gap:.3f}s, longest commit {pace.commit:.3f}s"
    )
    return SimpleNamespace(
        model=model, base=base, job=job, ref=ref, prompts=dict(enumerate(prompts)), pace=pace
    )


# --------------------------------------------------------------------------- SIGKILL


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sigkill_anywhere_then_resume(crash: SimpleNamespace) -> None:
    """SIGKILL real runs at random moments: after a random delay, inside a commit (a temp file
    exists), during start-up; after each kill the folder must read cleanly and hold the samples
    committed before unchanged; then resume.

    The "random" kills hit runs that commit by time only (every COMMIT_SECONDS): at each that lands
    while rows are still being produced, the last commit must be at most COMMIT_SECONDS + the
    pace slack old: 4 x (the reference run's longest wait between finished rows + longest step +
    longest commit), at least 1 s, for a subprocess on a loaded machine. A kill so loses at most
    the rows finished in that time (the default commit_seconds, 5, would fail the bound)."""
    folders = 0  # a job that ran to the end before its kill is checked; the kills go on anew
    out = crash.base / "killed-0"
    pace = crash.pace
    age_bound = COMMIT_SECONDS + max(1.0, 4 * (pace.finish_gap + pace.step + pace.commit))
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    plan = ["random", "in_commit", "startup", "random", "in_commit", "random"]
    extra = ["in_commit"] * 3  # only while no kill has landed inside a commit yet
    kills = mid_commit = 0
    log: list[str] = []
    ages: list[float] = []
    kept: Tokens = {}  # every sample seen committed, with its tokens
    t_start = time.monotonic()
    while plan or (extra and not mid_commit):
        how = plan.pop(0) if plan else extra.pop(0)
        before = committed_rows(out)
        commits = TIMED_COMMITS if how == "random" else FAST_COMMITS
        proc = start(crash.job, "--set", f"output.path={out}", *commits)
        if how == "startup":
            time.sleep(rng.uniform(0.2, 2.5))  # imports, model load, folder cleanup
        elif wait_for_commit(proc, out, before):
            if how == "random":
                time.sleep(rng.uniform(0.0, 2 * COMMIT_SECONDS))
            else:
                wait_for_temp_file(proc, out, timeout=3.0)
        if proc.poll() is not None:
            # It ran to the end before the kill (a fast machine): the folder must be complete;
            # this kill is tried again on a fresh folder.
            _, err = proc.communicate(timeout=PROC_TIMEOUT)
            assert proc.returncode == 0, err
            figures = check_complete(out, crash, kept)
            log.append(f"{how}: the job ended first ({figures['rows']} rows); a fresh folder")
            folders += 1
            assert folders < 5, log
            out, kept = crash.base / f"killed-{folders}", {}
            plan.insert(0, how)
            continue
        killed_at = datetime.now(timezone.utc)
        proc.kill()
        proc.wait(timeout=60)
        kills += 1
        if out.is_dir() and manifest_of(out) is not None:
            left = leftovers(out)
            mid_commit += bool(left) and how != "startup"
            figures = check_folder(out, kept)
            age = ""
            if how == "random":
                ages.append(age_at(manifest_of(out)["last_commit_at"], killed_at))
                age = f", the last commit {ages[-1]:.2f}s old"
            log.append(f"{how}: {figures['rows']} rows committed{age}, leftovers {left or 'none'}")
        else:
            log.append(f"{how}: before the folder existed")
    stderr = finish(out, crash.job, *FAST_COMMITS)
    assert "batchgen: done:" in stderr
    figures = check_complete(out, crash, kept)
    elapsed = time.monotonic() - t_start
    print(
        f"\n[resume] SIGKILL (random seed {seed}): {kills} kills, {mid_commit} of them inside a "
        f"commit; then {figures['rows']} rows / {figures['samples']} samples, "
        f"{figures['duplicates']} duplicates, {figures['near_ties']} near-tie flips vs the "
        f"uninterrupted run; the last commit at the timed kills was "
        f"{', '.join(f'{a:.2f}s' for a in ages)} old (bound {age_bound:.2f}s, "
        f"commit_seconds={COMMIT_SECONDS}); {elapsed:.0f}s"
    )
    for line in log:
        print(f"[resume]   {line}")
    assert kills >= 6
    # Else no kill hit a part-file write; the temp-file kills (retried) make that unlikely.
    assert mid_commit >= 1
    assert len(ages) == 3
    assert max(ages) <= age_bound, (ages, age_bound)


# --------------------------------------------------------------------------- SIGINT / SIGTERM


@pytest.mark.slow
def test_sigint_and_sigterm_save_then_resume(crash: SimpleNamespace) -> None:
    rng = random.Random()
    for sig in (signal.SIGINT, signal.SIGTERM):
        # A fast machine can finish the whole job before a late signal lands: then try again on a
        # new folder, signalling right after the first commit.
        for attempt in range(4):
            out = crash.base / f"signalled-{signal.Signals(sig).name}-{attempt}"
            args = ("--set", f"output.path={out}", *FAST_COMMITS)
            proc = start(crash.job, *args)
            assert wait_for_commit(proc, out, 0), proc.communicate()
            time.sleep(rng.uniform(0.0, 0.3) if attempt == 0 else 0.0)
            sent = time.monotonic()
            proc.send_signal(sig)
            _, err = proc.communicate(timeout=PROC_TIMEOUT)
            took = time.monotonic() - sent
            if "batchgen: done:" not in err:
                break
        assert proc.returncode == 130, (sig, err)
        assert "Traceback" not in err
        assert "batchgen: interrupted:" in err, err
        report = json.loads((out / REPORT_NAME).read_text())
        m = manifest_of(out)
        assert report["finished"] is False and m["finished"] is False
        # Everything finished was committed: the report's rows are all in the manifest.
        assert report["rows"] == m["totals"]["rows"] > 0
        assert report["rows_done"] == m["totals"]["rows"]
        assert leftovers(out) == []  # a graceful stop leaves no half-done commit
        kept: Tokens = {}
        check_folder(out, kept)
        status = run_cli("status", str(out)).output
        assert "not finished" in status
        assert f"{m['totals']['rows']} of {ROWS} rows" in status
        print(
            f"\n[resume] {signal.Signals(sig).name}: exit 130 after {took:.2f}s, "
            f"{report['rows']} rows saved ({m['totals']['rows']} of {ROWS} in all)\n{status}"
        )
        finish(out, crash.job, *FAST_COMMITS)
        figures = check_complete(out, crash, kept)
        status = run_cli("status", str(out)).output
        assert "state:         finished" in status and f"{ROWS} of {ROWS} rows" in status
        print(f"[resume] after the resume: {figures}\n{status}")


@pytest.fixture(scope="module")
def long_steps(tiny_model, tmp_path_factory) -> Path:
    """A job whose engine steps last long (prefill chunks of 2048 tokens through 8 layers of
    width 256: about 0.1 s a step on a 2-core EPYC), each made of many short torch ops."""
    model = tiny_model(
        "llama",
        num_layers=8,
        hidden_size=256,
        intermediate_size=512,
        max_position_embeddings=2048,
    )
    prompts = make_prompts(128, seed=3, min_words=150, max_words=300)
    sampling = {**SAMPLING, "max_tokens": 8}  # n=N, as check_folder expects
    engine = {"max_num_seqs": 32, "max_num_batched_tokens": 2048}
    base = tmp_path_factory.mktemp("long-steps")
    return write_job(base, model, prompts, sampling=sampling, engine=engine)


@pytest.mark.slow
def test_second_sigint_exits_at_once(long_steps: Path) -> None:
    """A second SIGINT during the graceful stop exits 130 at once: the hard exit's message is the
    last thing written, the graceful summary never comes, the folder reads cleanly. The second
    signal must land in the graceful stop, which first finishes the step in progress: on a job
    of long steps, the first signal's handler runs within one short op, and the second, a few
    milliseconds later, lands in the rest of the step. Signals that arrive within one op reach
    Python as one (the stop is then graceful): on a fresh folder each time, try other delays
    until one landed."""
    delays = [0.01, 0.02, 0.005, 0.03, 0.015, 0.01, 0.04, 0.008]
    outcomes: list[str] = []
    for attempt, delay in enumerate(delays):
        out = long_steps.parent / f"twice-{attempt}"
        proc = start(long_steps, "--set", f"output.path={out}", *FAST_COMMITS)
        assert wait_for_commit(proc, out, 0), proc.communicate()
        proc.send_signal(signal.SIGINT)
        time.sleep(delay)
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=PROC_TIMEOUT)
        took = time.monotonic() - sent
        assert proc.returncode == 130, err
        assert "Traceback" not in err
        check_folder(out)
        assert "not finished" in run_cli("status", str(out)).output
        if "interrupted again" in err:
            break
        # The first signal's graceful stop had ended (or the two were taken as one).
        outcomes.append(f"{delay}s: {err.strip().splitlines()[-1]!r}")
    else:
        raise AssertionError(f"no second SIGINT landed in a graceful stop: {outcomes}")
    # At once: the hard exit's line is the last one; the graceful summary was never printed.
    assert err.rstrip().endswith("stopped at once; rows committed so far are kept"), err
    assert "batchgen: interrupted:" not in err, err
    left = leftovers(out)
    # (Resuming such a folder is what the SIGKILL test does at length.)
    print(
        f"\n[resume] second SIGINT ({delay}s after the first, attempt {attempt + 1}; before: "
        f"{outcomes or 'none'}): exit 130 {took:.2f}s after it; {committed_rows(out)} rows "
        f"kept, leftovers {left or 'none'}"
    )


def test_second_signal_handler_exits_130(monkeypatch: pytest.MonkeyPatch) -> None:
    """In process: the first signal only sets ``stop``; the second exits 130 at once."""
    from batchgen.signals import GracefulStop

    class Exited(Exception):
        pass

    def fake_exit(code: int) -> None:
        raise Exited(code)

    monkeypatch.setattr(os, "_exit", fake_exit)
    before = signal.getsignal(signal.SIGINT)
    with GracefulStop() as signals:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)  # the handler runs at the next bytecode boundary
        assert signals.stop
        with pytest.raises(Exited) as exited:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.01)
        assert exited.value.args == (130,)
    assert signal.getsignal(signal.SIGINT) is before
    assert signals.received == signal.SIGTERM


# --------------------------------------------------------------------------- fingerprint


@pytest.fixture
def model(tiny_model) -> Path:
    """The crash job's model, without its reference run (these tests are fast)."""
    return tiny_model("llama", **MODEL_ARGS)


def snapshot(out: Path) -> dict[str, tuple[int, bytes]]:
    """Every file but the lock: mtime and bytes."""
    return {
        str(path.relative_to(out)): (path.stat().st_mtime_ns, path.read_bytes())
        for path in sorted(out.rglob("*"))
        if path.is_file() and path.relative_to(out) != Path(".batchgen", "lock")
    }


def test_fingerprint_through_the_cli(model: Path, tmp_path: Path) -> None:
    prompts = make_prompts(8, seed=12, min_words=3, max_words=12)
    sampling = {"n": 2, "max_tokens": 4, "temperature": 0.8, "seed": 3, "ignore_eos": True}
    job = write_job(tmp_path, model, prompts, sampling=sampling, engine={"block_size": 8})
    out = tmp_path / "out"
    # Two sequences at a time: rows finish one by one, so there are several parts.
    run_cli(
        "run",
        str(job),
        "--quiet",
        "--set",
        "output.commit_rows=4",
        "--set",
        "engine.max_num_seqs=2",
    )
    first = read_results(out)
    assert len(first) == 16 and len(manifest_of(out)["parts"]) > 1

    # The same job again: nothing is generated, nothing is rewritten.
    before = snapshot(out)
    result = run_cli("run", str(job), "--quiet")
    assert "nothing to do" in result.stderr
    assert snapshot(out) == before
    # A run killed after its last commit but before marking the folder finished: the next run
    # only marks it and writes a report.
    m = manifest_of(out)
    (out / MANIFEST_NAME).write_text(json.dumps({**m, "finished": False}))
    assert "nothing to do" in run_cli("run", str(job), "--quiet").stderr
    assert manifest_of(out)["finished"] is True
    report = json.loads((out / REPORT_NAME).read_text())
    assert report["finished"] is True and report["rows"] == 0 and report["rows_done"] == 8
    assert read_results(out) == first
    before = snapshot(out)

    # What decides the results differs: refused, the folder left as it was.
    assert "sampling differs" in refusal(invoke("run", job, "--set", "sampling.temperature=0.5"))
    assert "sampling differs" in refusal(invoke("run", job, "--set", "sampling.seed=4"))
    other_model = tmp_path / "other-model"
    shutil.copytree(model, other_model)
    config = json.loads((other_model / "config.json").read_text())
    config["rms_norm_eps"] = config.get("rms_norm_eps", 1e-6) * 10
    (other_model / "config.json").write_text(json.dumps(config))
    assert "model differs" in refusal(invoke("run", job, "--set", f"model={other_model}"))
    other_input = tmp_path / "other.parquet"
    pq.write_table(
        pa.table({"id": list(range(8)), "prompt": prompts[:7] + ["changed"]}), other_input
    )
    assert "input differs" in refusal(invoke("run", job, "--set", f"input.path={other_input}"))
    assert "input differs" in refusal(invoke("run", job, "--set", "input.id_column=null"))
    line = refusal(invoke("run", job, "--set", "sampling.n=3", "--set", f"model={other_model}"))
    assert "model, sampling differ" in line
    assert snapshot(out) == before
    print(f"\n[resume] refusal: {line}")

    # Engine (and commit) settings may differ: drop the last part, resume with others.
    last = manifest_of(out)["parts"][-1]
    (out / last["name"]).unlink()
    result = run_cli(
        "run",
        str(job),
        "--quiet",
        "--set",
        "engine.block_size=4",
        "--set",
        "engine.max_num_seqs=3",
        "--set",
        "engine.max_num_batched_tokens=24",
        "--set",
        "output.commit_rows=1000",
    )
    assert f"batchgen: done: {last['rows']} rows" in result.stderr

    def without_cache_counts(rows: list[dict]) -> list[dict]:
        # how many prompt tokens came from the prefix cache depends on the block size
        return [{k: v for k, v in r.items() if k != "num_cached_tokens"} for r in rows]

    assert without_cache_counts(read_results(out)) == without_cache_counts(first)
    status = run_cli("status", str(out)).output
    assert "state:         finished" in status and "8 of 8 rows" in status
    assert "samples:       16 (0 errors)" in status

    # --fresh starts over, also with another job.
    result = run_cli("run", str(job), "--quiet", "--fresh", "--set", "sampling.seed=4")
    assert "batchgen: done: 8 rows" in result.stderr
    fresh = read_results(out)
    assert [r["id"] for r in fresh] == [r["id"] for r in first]
    assert [r["token_ids"] for r in fresh] != [r["token_ids"] for r in first]
    assert manifest_of(out)["parts"][0]["name"] == "part-00000.parquet"
    assert "sampling differs" in refusal(invoke("run", job))  # the folder now holds seed 4


def test_fingerprint_notices_new_weights_of_the_same_shapes(model: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    prompts = make_prompts(2, seed=13, min_words=3, max_words=6)
    job = write_job(tmp_path, model, prompts, sampling={"max_tokens": 2})
    run_cli("run", str(job), "--quiet")
    tuned = tmp_path / "tuned"
    shutil.copytree(model, tuned)
    for path in tuned.glob("*.safetensors"):
        tensors = load_file(path)
        save_file({k: v + 0.01 for k, v in tensors.items()}, path, metadata={"format": "pt"})
    assert "model differs" in refusal(invoke("run", job, "--set", f"model={tuned}"))


@pytest.mark.parametrize("cpu_bf16", [False, True], ids=["fp32-cpu", "bf16-cpu"])
def test_fingerprint_covers_the_numerics(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cpu_bf16: bool
) -> None:
    """The resolved dtype is in the fingerprint: a resume in another dtype is refused (naming
    both), ``auto`` that resolves to the same dtype resumes, ``--fresh`` starts over. ``auto`` on
    a CPU follows its bf16 instructions (both kinds of CPU are simulated), so a float32 folder
    resumed with ``auto`` on a CPU that has them is refused. A folder from before numerics were
    fingerprinted resumes in float32, what ``auto`` gave on every CPU then."""
    import torch

    from batchgen.model.cpu_features import Bf16Support

    if torch.cuda.is_available():
        pytest.skip("auto resolves by the CPU's instructions on a CPU only")
    features = ("AMX-BF16",) if cpu_bf16 else ()
    monkeypatch.setattr("batchgen.plan.bf16_support", lambda: Bf16Support(features))
    prompts = make_prompts(6, seed=14, min_words=3, max_words=8)
    sampling = {"max_tokens": 3, "temperature": 0}
    job = write_job(
        tmp_path,
        model,
        prompts,
        sampling=sampling,
        engine={"dtype": "float32", "max_num_seqs": 2},
    )
    out = tmp_path / "out"
    run_cli("run", str(job), "--quiet", "--set", "output.commit_rows=2")
    first = read_results(out)

    def results() -> list[tuple[Any, int, list[int]]]:
        # num_cached_tokens depends on what a resumed run had cached
        return [(r["id"], r["sample_index"], r["token_ids"]) for r in read_results(out)]

    assert manifest_of(out)["fingerprint"]["numerics"] == "dtype=float32,kv_cache_dtype=float32"

    dropped = drop_last_part(out)
    before = snapshot(out)
    for command in ("run", "validate"):
        line = refusal(invoke(command, job, "--set", "engine.dtype=bfloat16"))
        assert "numerics differs" in line and "float32" in line and "bfloat16" in line, line
    if cpu_bf16:
        line = refusal(invoke("run", job, "--set", "engine.dtype=auto"))
        assert "dtype=float32,kv_cache_dtype=float32 in the folder, " in line, line
        assert "dtype=bfloat16,kv_cache_dtype=bfloat16 now" in line, line
        assert "set engine.dtype" in line, line
    assert snapshot(out) == before
    resume_dtype = "float32" if cpu_bf16 else "auto"
    assert (
        f"batchgen: done: {dropped} rows"
        in run_cli("run", str(job), "--quiet", "--set", f"engine.dtype={resume_dtype}").stderr
    )
    assert results() == [(r["id"], r["sample_index"], r["token_ids"]) for r in first]

    # A manifest written before the fingerprint had numerics.
    manifest = manifest_of(out)
    del manifest["fingerprint"]["numerics"]
    (out / MANIFEST_NAME).write_text(json.dumps(manifest))
    drop_last_part(out)
    assert "numerics differs" in refusal(invoke("run", job, "--set", "engine.dtype=bfloat16"))
    if cpu_bf16:
        assert "numerics differs" in refusal(invoke("run", job, "--set", "engine.dtype=auto"))
    run_cli("run", str(job), "--quiet", "--set", f"engine.dtype={resume_dtype}")
    assert results() == [(r["id"], r["sample_index"], r["token_ids"]) for r in first]
    assert manifest_of(out)["fingerprint"]["numerics"] == "dtype=float32,kv_cache_dtype=float32"

    run_cli("run", str(job), "--quiet", "--fresh", "--set", "engine.dtype=bfloat16")
    assert manifest_of(out)["fingerprint"]["numerics"] == "dtype=bfloat16,kv_cache_dtype=bfloat16"
    assert len(read_results(out)) == len(first)


def test_fingerprint_covers_the_kv_cache_dtype(model: Path, tmp_path: Path) -> None:
    """The resolved kv_cache_dtype is in the numerics: a resume with another one is refused (one
    line naming both), ``auto`` resumes a cache of the compute dtype. A folder written before
    the KV cache could be quantized (numerics ``dtype=float32`` alone) resumes as
    ``kv_cache_dtype=float32``, is upgraded to today's form, and refuses int8."""
    prompts = make_prompts(6, seed=15, min_words=3, max_words=8)
    sampling = {"max_tokens": 3, "temperature": 0}
    job = write_job(
        tmp_path,
        model,
        prompts,
        sampling=sampling,
        engine={"dtype": "float32", "kv_cache_dtype": "int8", "max_num_seqs": 2},
    )
    out = tmp_path / "out"
    run_cli("run", str(job), "--quiet", "--set", "output.commit_rows=2")
    first = read_results(out)
    assert manifest_of(out)["fingerprint"]["numerics"] == "dtype=float32,kv_cache_dtype=int8"

    dropped = drop_last_part(out)
    before = snapshot(out)
    for value in ("auto", "float32"):
        for command in ("run", "validate"):
            line = refusal(invoke(command, job, "--set", f"engine.kv_cache_dtype={value}"))
            assert "\n" not in line.strip(), line
            assert "kv_cache_dtype=int8 in the folder" in line, line
            assert "kv_cache_dtype=float32 now" in line, line
            assert "engine.kv_cache_dtype" in line, line
    assert snapshot(out) == before
    result = run_cli("run", str(job), "--quiet")
    assert f"batchgen: done: {dropped} rows" in result.stderr
    assert [r["token_ids"] for r in read_results(out)] == [r["token_ids"] for r in first]

    # A folder from before kv_cache_dtype: its numerics recorded the dtype alone.
    run_cli("run", str(job), "--quiet", "--fresh", "--set", "engine.kv_cache_dtype=auto")
    float_results = read_results(out)
    manifest = manifest_of(out)
    manifest["fingerprint"]["numerics"] = "dtype=float32"
    (out / MANIFEST_NAME).write_text(json.dumps(manifest))
    drop_last_part(out)
    line = refusal(invoke("run", job))  # the job asks for int8
    assert "kv_cache_dtype=float32 in the folder, " in line, line
    assert "kv_cache_dtype=int8 now" in line, line
    run_cli("run", str(job), "--quiet", "--set", "engine.kv_cache_dtype=auto")
    assert [r["token_ids"] for r in read_results(out)] == [r["token_ids"] for r in float_results]
    assert manifest_of(out)["fingerprint"]["numerics"] == "dtype=float32,kv_cache_dtype=float32"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sigkill_then_resume_with_int8_kv_cache(tiny_model, tmp_path: Path) -> None:
    """kill -9 a run with ``kv_cache_dtype: int8`` once it has committed, then resume: the folder
    ends up with every sample exactly once and the uninterrupted run's tokens (a resumed run
    re-prefills what the killed one had cached: its int8 bytes are the same, token by token)."""
    model = tiny_model("llama", **MODEL_ARGS)
    rows = 96
    prompts = make_prompts(rows, seed=21, min_words=3, max_words=30)
    engine = {**ENGINE, "kv_cache_dtype": "int8"}
    job = write_job(tmp_path, model, prompts, sampling=SAMPLING, engine=engine, output="ref")
    run_cli("run", str(job), "--quiet")
    ref = read_results(tmp_path / "ref")
    assert len(ref) == rows * N
    out = tmp_path / "killed"
    proc = start(job, "--set", f"output.path={out}", *FAST_COMMITS)
    assert wait_for_commit(proc, out, 0), "the run ended before it could be killed"
    proc.kill()
    proc.wait(timeout=60)
    committed = check_folder(out)["rows"]
    assert 0 < committed < rows, committed
    assert manifest_of(out)["fingerprint"]["numerics"] == "dtype=float32,kv_cache_dtype=int8"
    assert "batchgen: done:" in finish(out, job, *FAST_COMMITS)
    figures = check_folder(out)
    assert figures["samples"] == rows * N and leftovers(out) == []
    ties = compare_samples(
        read_results(out), ref, model=model, prompts=dict(enumerate(prompts)), sampling=SAMPLING
    )
    print(
        f"\n[resume] int8 KV: killed after {committed} of {rows} rows committed; resumed: "
        f"{figures['samples']} samples, {ties.exempt} near-tie flips"
    )


def drop_last_part(out: Path) -> int:
    """Delete the output folder's last committed part file (as a lost file would); return its
    row count."""
    last = manifest_of(out)["parts"][-1]
    (out / last["name"]).unlink()
    return last["rows"]
