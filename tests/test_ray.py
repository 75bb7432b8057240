"""``executor.kind: ray``: the same job on Ray workers gives the local executor's results (up to
near-tie flips, tests/ties.py), exactly once, also when a worker or the driver is killed mid-job;
rows sharing a prefix run on one worker.

One local Ray cluster (2 CPUs, so 2 workers of 1 CPU) serves the tests marked slow. The figures
(kills, rows run again, duplicates) are printed; ``pytest -s`` shows them. The executor section's
schema, the planner and the workers' dtype check are tested without a cluster (not slow).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
import yaml

from batchgen.errors import JobError
from batchgen.fingerprint import fingerprint
from batchgen.job import ExecutorConfig
from batchgen.jobfile import load_job
from batchgen.results import MANIFEST_NAME, REPORT_NAME, OutputFolder, totals_of
from batchgen.tiny_model import make_prompts
from tests.jobkit import committed_rows, manifest_of, read_results, run_cli, write_job
from tests.ties import compare_samples

MODEL_ARGS = dict(num_heads=4, num_kv_heads=2, head_dim=24)
TEMPLATES = [
    "You are a careful translator. Translate the following sentence into the old tongue and "
    "keep every name as it is:",
    "Summarize the report below in one line for a busy reader who has never seen it before:",
    "Here are three examples of questions and answers about the weather in the valley. Now "
    "answer the next question:",
    "Classify the sentiment of this product review as good, bad or mixed, with one word only:",
]
ROWS_PER_TEMPLATE = 12
ROWS = ROWS_PER_TEMPLATE * len(TEMPLATES)
# The workers batch other rows together than the local run does (and a kill changes that again):
# docs/job-file.md lets floating-point differences between batch shapes flip a near-tie, which
# compare_samples exempts and counts. Any seed must pass.
SEEDED = {
    "n": 2,
    "max_tokens": 16,
    "temperature": 0.9,
    "top_p": 0.95,
    "seed": 0,
    "ignore_eos": True,
}
GREEDY = {"n": 1, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
ENGINE = {"block_size": 4}
RAY = ("--set", "executor.kind=ray", "--set", "executor.num_workers=2")
# Small batches and a commit per finished row: a job takes seconds, kills land mid-shard.
SLOW = (
    "--set",
    "engine.max_num_seqs=2",
    "--set",
    "output.commit_rows=2",
    "--set",
    "output.commit_seconds=0.05",
)
DRIVER_STALL = 2.0  # seconds; worker 0 alone runs its whole shard in less on a quiet 2-core EPYC
PROC_TIMEOUT = 240  # seconds; a loaded 2-core machine starts torch (and Ray workers) slowly


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray cluster for the module; jobs run in this process use it (and leave it up)."""
    ray = pytest.importorskip("ray")
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        object_store_memory=80 * 2**20,
        log_to_driver=False,
        logging_level="WARNING",
    )
    yield ray
    ray.shutdown()


def ahead_rows() -> int:
    """Rows a worker may have finished beyond what the driver has received: DELIVERIES_AHEAD unread
    deliveries and the one it builds, of at most two rows each (SLOW's max_num_seqs=2: a step
    finishes two samples at most). A kill at a delivery whose task has more rows left lands
    mid-shard."""
    from batchgen.executors.ray_worker import DELIVERIES_AHEAD

    return 2 * (DELIVERIES_AHEAD + 1)


def template_of(row_id: int) -> int:
    return row_id % len(TEMPLATES)


@pytest.fixture(scope="module")
def data(tiny_model, tmp_path_factory) -> SimpleNamespace:
    """Template prompts (rows of one template share a long prefix, interleaved in the input),
    and the local executor's results for seeded and greedy sampling: the references."""
    model = tiny_model("llama", **MODEL_ARGS)
    base = tmp_path_factory.mktemp("ray")
    tails = make_prompts(ROWS, seed=21, min_words=2, max_words=10)
    prompts = [f"{TEMPLATES[template_of(i)]} {tails[i]}" for i in range(ROWS)]
    refs = {}
    for name, sampling in (("seeded", SEEDED), ("greedy", GREEDY)):
        job = write_job(base / f"ref-{name}", model, prompts, sampling=sampling, engine=ENGINE)
        run_cli("run", str(job), "--quiet")
        refs[name] = read_results(job.parent / "out")
    return SimpleNamespace(model=model, prompts=prompts, refs=refs)


SAMPLING = {"seeded": SEEDED, "greedy": GREEDY}


def job_for(data: SimpleNamespace, folder: Path, sampling: dict) -> Path:
    return write_job(folder, data.model, data.prompts, sampling=sampling, engine=ENGINE)


def report_of(out: Path) -> dict[str, Any]:
    return json.loads((out / REPORT_NAME).read_text())


def check_exactly_once(out: Path, data: SimpleNamespace, kind: str) -> dict[str, int]:
    """Every (id, sample_index) once; the tokens the local run's up to near-tie flips, and where
    the tokens are equal, every other column the generation decides too. The figures for the
    printout."""
    sampling, ref = SAMPLING[kind], data.refs[kind]
    rows = ds.dataset(out, format="parquet").to_table().to_pylist()
    keys = Counter((r["id"], r["sample_index"]) for r in rows)
    figures = {
        "samples": len(rows),
        "duplicates": sum(c - 1 for c in keys.values()),
        "missing": ROWS * sampling["n"] - len(keys),
    }
    assert figures["duplicates"] == 0 and figures["missing"] == 0, figures
    got = sorted(rows, key=lambda r: (r["id"], r["sample_index"]))
    ties = compare_samples(
        got, ref, model=data.model, prompts=dict(enumerate(data.prompts)), sampling=sampling
    )
    figures["near_ties"] = ties.exempt
    columns = ("id", "sample_index", "text", "finish_reason", "num_prompt_tokens")
    mismatches = [
        (a["id"], a["sample_index"])
        for a, b in zip(got, ref, strict=True)
        if a["num_prompt_tokens"] != b["num_prompt_tokens"]
        or (a["token_ids"] == b["token_ids"] and any(a[c] != b[c] for c in columns))
    ]
    assert mismatches == [], mismatches[:5]
    return figures


# --------------------------------------------------------------------------- the job section


def test_executor_section_defaults_overrides_and_errors(tmp_path: Path) -> None:
    text = "model: m\ninput:\n  path: p.parquet\noutput:\n  path: out\n"
    (tmp_path / "job.yaml").write_text(text)
    job = load_job(tmp_path / "job.yaml")
    assert job.executor == ExecutorConfig()
    assert (job.executor.kind, job.executor.address, job.executor.num_workers) == (
        "local",
        None,
        None,
    )
    assert (job.executor.num_cpus, job.executor.num_gpus, job.executor.max_restarts) == (1, None, 3)
    ray_job = load_job(
        tmp_path / "job.yaml",
        [
            "executor.kind=ray",
            "executor.address=auto",
            "executor.num_workers=4",
            "executor.num_gpus=0.5",
        ],
    )
    ex = ray_job.executor
    assert (ex.kind, ex.address, ex.num_workers, ex.num_gpus) == ("ray", "auto", 4, 0.5)
    # Not in the fingerprint: a job may resume with another executor.
    assert fingerprint(job, "m", "i") == fingerprint(ray_job, "m", "i")
    (tmp_path / "empty.yaml").write_text(text + "executor:\n")
    assert load_job(tmp_path / "empty.yaml").executor == ExecutorConfig()
    for overrides, expected in [
        (
            ["executor.num_worker=2"],
            "unknown key 'executor.num_worker' (did you mean 'num_workers'?)",
        ),
        (["executor.kind=slurm"], "executor.kind"),
        (["executor.num_workers=0"], "executor.num_workers"),
        (["executor.num_gpus=-1"], "executor.num_gpus"),
    ]:
        with pytest.raises(JobError, match="executor") as info:
            load_job(tmp_path / "job.yaml", overrides)
        assert expected in str(info.value)
    (tmp_path / "typo.yaml").write_text(text + "executor:\n  kind: ray\n  adress: auto\n")
    with pytest.raises(JobError, match="unknown key 'executor.adress'"):
        load_job(tmp_path / "typo.yaml")


def test_validate_prints_the_executor(tiny_model, tmp_path: Path) -> None:
    pytest.importorskip("ray")
    model = tiny_model("llama", **MODEL_ARGS)
    job = write_job(tmp_path, model, make_prompts(4, seed=21), sampling=SEEDED, engine=ENGINE)
    local = run_cli("validate", str(job)).stdout
    assert "executor: local" in local
    plan = run_cli("validate", str(job), *RAY, "--set", "executor.address=auto").stdout
    assert "executor: ray on auto: 2 workers, each num_cpus=1" in plan
    assert "decided by each worker" in plan


def test_ray_missing_is_a_job_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from batchgen import runner

    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    with pytest.raises(JobError, match=r"pip install 'batchgen\[ray\]'"):
        runner._check_ray_installed()


# --------------------------------------------------------------------------- results


@pytest.fixture(scope="module")
def seeded_ray_run(ray_cluster, data, tmp_path_factory) -> Path:
    job = job_for(data, tmp_path_factory.mktemp("ray-seeded"), SEEDED)
    t0 = time.monotonic()
    run_cli("run", str(job), "--quiet", *RAY)
    print(
        f"\n[ray] seeded job on 2 workers: {time.monotonic() - t0:.1f}s (workers' start included)"
    )
    return job.parent / "out"


@pytest.mark.slow
def test_ray_equals_local_seeded(seeded_ray_run: Path, data: SimpleNamespace) -> None:
    figures = check_exactly_once(seeded_ray_run, data, "seeded")
    report = report_of(seeded_ray_run)
    assert report["finished"] is True and report["executor"] == "ray"
    assert report["rows"] == ROWS and report["samples"] == ROWS * SEEDED["n"]
    workers = report["workers"]
    assert len(workers) == 2 and report["num_workers"] == 2
    # The job's figures are the sums of the workers' and agree with the manifest.
    for key in ("rows", "samples", "prompt_tokens", "cached_prompt_tokens", "output_tokens"):
        assert report[key] == sum(w[key] for w in workers), key
    manifest = manifest_of(seeded_ray_run)
    assert manifest["finished"] is True and manifest["totals"]["rows"] == ROWS
    assert all(w["rows"] > 0 and w["restarts"] == 0 for w in workers)
    print(f"[ray] seeded: {figures}, rows per worker {[w['rows'] for w in workers]}")


@pytest.mark.slow
def test_prefix_locality(seeded_ray_run: Path, data: SimpleNamespace) -> None:
    """Each template's rows form one prefix group, run whole by one worker; the work is split."""
    workers = report_of(seeded_ray_run)["workers"]
    owner: dict[Any, int] = {}
    for w in workers:
        for g in w["prefix_groups"]:
            owner[g["first_id"]] = w["worker"]
            assert g["rows"] == ROWS_PER_TEMPLATE, g
            # The group's rows share the template's tokens (most of them: its text's start).
            assert g["shared_prefix_tokens"] >= 12
            assert TEMPLATES[template_of(g["first_id"])].startswith(g["shared_prefix"][:20])
    assert sorted(owner) == list(range(len(TEMPLATES)))  # one group per template
    assert sorted(Counter(owner.values()).values()) == [2, 2]  # two templates per worker
    # Every row ran on the worker that owns its template: per worker, the rows it ran are
    # exactly its templates' rows.
    for w in workers:
        mine = sum(1 for t in owner if owner[t] == w["worker"])
        assert w["rows"] == mine * ROWS_PER_TEMPLATE and w["groups"] == mine


@pytest.mark.slow
def test_ray_equals_local_greedy_over_many_rounds(
    ray_cluster, data: SimpleNamespace, tmp_path: Path
) -> None:
    """Rounds of 8 rows per worker (16 rows: 4 of each template): in every round each template's
    rows form one prefix group."""
    job = job_for(data, tmp_path, GREEDY)
    run_cli("run", str(job), "--quiet", *RAY, "--set", "input.window_rows=8")
    out = tmp_path / "out"
    check_exactly_once(out, data, "greedy")
    workers = report_of(out)["workers"]
    groups = [g for w in workers for g in w["prefix_groups"]]
    assert len(groups) == sum(w["groups"] for w in workers) == 3 * len(TEMPLATES)
    assert all(g["rows"] == 4 for g in groups), groups
    assert len({g["first_id"] for g in groups}) == len(groups)


def test_planner_groups_balances_and_sticks() -> None:
    """Unit test of the plan: prefixes split only as far as balance needs; a prefix seen in an
    earlier round goes back to its worker unless that worker is far behind."""
    pytest.importorskip("ray")
    from batchgen.dataset import InputRow
    from batchgen.executors.sharding import Planner, group_by_prefix
    from batchgen.prompts import EncodedRow

    def rows(prefixes: list[list[int]], per: int, start: int = 0) -> list[EncodedRow]:
        out = []
        for i in range(per * len(prefixes)):
            tokens = prefixes[i % len(prefixes)] + [100 + i, 200 + i]
            out.append(EncodedRow(InputRow(start + i, "p", None, {}), tokens))
        return out

    a, b, c = [1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [7, 7, 7, 7, 7, 7, 7, 7]
    batch = rows([a, b, c], per=4)

    def unit(r: EncodedRow) -> int:
        return 1

    # Cheap enough for one worker: one group. A limit of 4 rows: a, b and c apart; a and b
    # share their first block, so they are told apart by their second. Every row in exactly
    # one group.
    assert len(group_by_prefix(batch, 4, 12, unit)) == 1
    split = group_by_prefix(batch, 4, 4, unit)
    assert sorted(g.key for g in split) == sorted([tuple(a), tuple(b), tuple(c[:4])])
    assert sorted(r.row.id for g in split for r in g.rows) == list(range(12))
    # Identical prompts beyond the limit: split into runs of rows.
    same = [EncodedRow(InputRow(i, "p", None, {}), [5, 5, 5]) for i in range(6)]
    assert [len(g.rows) for g in group_by_prefix(same, 4, 6, unit)] == [6]
    pieces = group_by_prefix(same, 4, 2, unit)
    assert [[r.row.id for r in g.rows] for g in pieces] == [[0, 1], [2, 3], [4, 5]]

    planner = Planner(block_size=4, n=1, max_tokens=0)  # cost: prompt tokens
    first = planner.plan(rows([a, c], per=4), {0: 0, 1: 0})
    owner = {g.key: w for w, gs in first.items() for g in gs}
    assert sorted(owner.values()) == [0, 1]  # one prefix each
    # The next round: same prefixes, balanced loads -> same workers (even when reversed).
    again = planner.plan(rows([c, a], per=4, start=100), {0: 5, 1: 0})
    assert {g.key: w for w, gs in again.items() for g in gs} == owner
    # The owner of `a` far behind: `a` goes to the other worker too.
    wa, wc = owner[tuple(a[:4])], owner[tuple(c[:4])]
    moved = planner.plan(rows([a, c], per=4, start=200), {wa: 10_000, wc: 0})
    assert (len(moved[wa]), len(moved[wc])) == (0, 2)


# --------------------------------------------------------------------------- killing a worker


@pytest.mark.slow
@pytest.mark.parametrize("max_restarts", [3, 0])
def test_worker_killed_mid_job(
    ray_cluster,
    data: SimpleNamespace,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    max_restarts: int,
) -> None:
    """SIGKILL worker 0's process at its first delivery, after the driver stalled for a while (as a
    busy driver on a fast machine does). The worker cannot have run its shard to the end
    meanwhile (it pauses DELIVERIES_AHEAD deliveries ahead of the driver), so the kill lands mid-shard.
    With restarts left, Ray restarts it and it runs the rows it had not delivered; with none,
    worker 1 takes them."""
    from batchgen.executors.ray import RayExecutor

    real = RayExecutor._receive
    killed: list[int] = []

    def receive(self: RayExecutor, task: Any, delivery: Any) -> None:
        if not killed and task.slot.index == 0:
            time.sleep(DRIVER_STALL)
            real(self, task, delivery)
            assert len(task.remaining) > ahead_rows(), len(task.remaining)
            killed.append(delivery.pid)
            os.kill(delivery.pid, signal.SIGKILL)
        else:
            real(self, task, delivery)

    monkeypatch.setattr(RayExecutor, "_receive", receive)
    job = job_for(data, tmp_path, SEEDED)
    run_cli(
        "run", str(job), "--quiet", *RAY, *SLOW, "--set", f"executor.max_restarts={max_restarts}"
    )
    out = tmp_path / "out"
    assert len(killed) == 1
    figures = check_exactly_once(out, data, "seeded")
    report = report_of(out)
    assert report["finished"] is True and report["rows"] == ROWS
    w0, w1 = report["workers"]
    if max_restarts:
        assert w0["restarts"] == 1 and w0["alive"] and w0["pid"] != killed[0]
        rerun = w0["rerun_rows"]  # the restarted worker ran them
    else:
        assert not w0["alive"] and w1["alive"] and w1["restarts"] == 0
        rerun = w1["rerun_rows"]  # the survivor took them over
    assert rerun > 0  # the kill landed mid-shard: rows not delivered yet ran again
    assert report["worker_restarts"] == (1 if max_restarts else 0)
    print(
        f"[ray] worker 0 killed (max_restarts={max_restarts}): {figures}, rows run again: "
        f"{rerun}, rows delivered per worker {w0['rows']} + {w1['rows']}"
    )


# --------------------------------------------------------------------------- killing the driver


@pytest.mark.slow
def test_driver_killed_then_resumed(ray_cluster, data: SimpleNamespace, tmp_path: Path) -> None:
    """A real `batchgen run` (joining this module's cluster) is SIGKILLed once it has committed
    rows; the next `batchgen run` resumes and completes exactly once."""
    job = job_for(data, tmp_path, SEEDED)
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "batchgen.cli",
            "run",
            str(job),
            "--quiet",
            *RAY,
            *SLOW,
            "--set",
            "executor.address=auto",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + PROC_TIMEOUT
    try:
        while committed_rows(out) == 0:
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "no commit in time"
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    killed_at = committed_rows(out)
    assert 0 < killed_at < ROWS, killed_at
    # What the killed driver committed (the parts its manifest lists) is readable: whole rows,
    # no duplicates.
    listed = [p["name"] for p in manifest_of(out)["parts"]]
    partial = ds.dataset([str(out / n) for n in listed], format="parquet").to_table().to_pylist()
    assert Counter(Counter(r["id"] for r in partial).values()) == {SEEDED["n"]: killed_at}
    # A kill between a part's rename (its commit) and the manifest update leaves one part the
    # manifest does not list yet (see batchgen/results/local.py); the resume lists it, and
    # check_exactly_once below verifies that no row is lost or written twice.
    unlisted = [p for p in out.glob("part-*.parquet") if p.name not in listed]
    assert len(unlisted) <= 1, unlisted
    committed = killed_at + sum(
        len(set(pq.read_table(p, columns=["id"]).column("id").to_pylist())) for p in unlisted
    )
    result = run_cli("run", str(job), "--quiet", *RAY)
    assert "batchgen: done" in result.stderr
    figures = check_exactly_once(out, data, "seeded")
    report = report_of(out)
    assert report["rows_already_done"] == committed and report["rows"] == ROWS - committed
    print(f"[ray] driver killed after {killed_at} of {ROWS} rows committed; resumed: {figures}")


@pytest.mark.slow
def test_job_yaml_with_executor_section(ray_cluster, data: SimpleNamespace, tmp_path: Path) -> None:
    """The section in the file (not only --set); a ray job resumed by the local executor."""
    job = job_for(data, tmp_path, GREEDY)
    raw = yaml.safe_load(job.read_text())
    raw["executor"] = {"kind": "ray", "num_workers": 2, "num_cpus": 1}
    job.write_text(yaml.safe_dump(raw))
    run_cli(
        "run", str(job), "--quiet", "--set", "input.window_rows=4", "--set", "output.commit_rows=1"
    )
    out = tmp_path / "out"
    assert report_of(out)["executor"] == "ray"
    # Drop the last committed part and resume locally: the fingerprint does not see executors.
    manifest = manifest_of(out)
    assert len(manifest["parts"]) > 1
    last = manifest["parts"].pop()
    manifest["totals"] = totals_of(manifest["parts"])
    manifest["finished"] = False
    (out / MANIFEST_NAME).write_text(json.dumps(manifest))
    run_cli("run", str(job), "--quiet", "--set", "executor.kind=local")
    check_exactly_once(out, data, "greedy")
    assert report_of(out)["rows"] == last["rows"] and report_of(out)["executor"] == "local"


@pytest.mark.slow
@pytest.mark.parametrize("moment", ["loading", "early", "mid", "twice"])
def test_worker_sigkilled_restarts(
    ray_cluster,
    data: SimpleNamespace,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    moment: str,
) -> None:
    """A real SIGKILL of worker 0's process at several moments: while it loads its model, right
    after the workers loaded (before any shard ran), once rows were handed back, and twice in one
    job. Ray restarts it (max_restarts 3), the job completes exactly once with the local results,
    and the report counts the restarts."""
    from batchgen.executors.ray import RayExecutor

    killed: list[int] = []
    # Committed rows at which worker 0's current process is killed.
    at = {"loading": [], "early": [], "mid": [6], "twice": [4, 12]}[moment]

    def kill(slot: Any) -> None:
        pid = slot.pids[-1]
        killed.append(pid)
        os.kill(pid, signal.SIGKILL)

    real_submit, real_receive = RayExecutor.submit, RayExecutor._receive
    real_load = RayExecutor._submit_load

    def submit_load(self: RayExecutor, slot: Any) -> Any:
        ref = real_load(self, slot)
        if moment == "loading" and slot.index == 0 and not killed:
            kill(slot)  # the load was submitted and has not returned
        return ref

    def submit(self: RayExecutor, rows: Any) -> None:
        if moment == "early" and not killed:
            kill(self.slots[0])  # the workers loaded; no shard has run yet
        real_submit(self, rows)

    def receive(self: RayExecutor, task: Any, delivery: Any) -> None:
        real_receive(self, task, delivery)
        slot = self.slots[0]
        received = sum(s.totals.rows for s in self.slots)
        # Kill again only once the previous kill's restart was seen (a new pid delivered rows),
        # and only while worker 0 surely has rows left to run (its delivery's task has more rows
        # left than it may have run ahead).
        if (
            len(killed) < len(at)
            and received >= at[len(killed)]
            and len(slot.pids) > len(killed)
            and task.slot is slot
            and len(task.remaining) > ahead_rows()
        ):
            kill(slot)

    monkeypatch.setattr(RayExecutor, "_submit_load", submit_load)
    monkeypatch.setattr(RayExecutor, "submit", submit)
    monkeypatch.setattr(RayExecutor, "_receive", receive)
    job = job_for(data, tmp_path, SEEDED)
    run_cli("run", str(job), "--quiet", *RAY, *SLOW, "--set", "executor.max_restarts=3")
    out = tmp_path / "out"
    assert len(killed) == max(len(at), 1), killed
    figures = check_exactly_once(out, data, "seeded")
    report = report_of(out)
    assert report["finished"] is True and report["rows"] == ROWS
    w0, w1 = report["workers"]
    assert w0["alive"] and w0["restarts"] == len(killed) and w0["pid"] not in killed
    assert w1["restarts"] == 0 and report["worker_restarts"] == len(killed)
    print(f"[ray] worker 0 SIGKILLed {moment}: {figures}, rows run again: {w0['rerun_rows']}")


@pytest.mark.slow
def test_worker_killed_while_loading_without_restarts(
    ray_cluster, data: SimpleNamespace, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """max_restarts 0: a worker SIGKILLed while it loads is dead for good; the other one runs
    every row."""
    from batchgen.executors.ray import RayExecutor

    real_load = RayExecutor._submit_load
    killed: list[int] = []

    def submit_load(self: RayExecutor, slot: Any) -> Any:
        ref = real_load(self, slot)
        if slot.index == 0 and not killed:
            killed.append(slot.pids[-1])
            os.kill(slot.pids[-1], signal.SIGKILL)
        return ref

    monkeypatch.setattr(RayExecutor, "_submit_load", submit_load)
    job = job_for(data, tmp_path, GREEDY)
    run_cli("run", str(job), "--quiet", *RAY, "--set", "executor.max_restarts=0")
    out = tmp_path / "out"
    check_exactly_once(out, data, "greedy")
    w0, w1 = report_of(out)["workers"]
    assert not w0["alive"] and w0["rows"] == 0
    assert w1["alive"] and w1["rows"] == ROWS and w1["restarts"] == 0


def test_job_loop_checks_the_workers_dtype(tmp_path: Path) -> None:
    """Ray workers resolve engine.dtype themselves: what they report is held against the output
    folder's fingerprint (adopted while nothing is committed, refused after)."""
    pytest.importorskip("ray")
    import pyarrow as pa

    from batchgen.executors.ray import RayExecutor, _Slot
    from batchgen.runner import JobRun
    from batchgen.schema import output_schema

    fp = {
        "model": "m",
        "input": "i",
        "sampling": "s",
        "numerics": "dtype=float32,kv_cache_dtype=float32",
    }
    folder = OutputFolder.open(tmp_path / "out", fp)
    executor = object.__new__(RayExecutor)
    executor.job = SimpleNamespace(engine=SimpleNamespace(dtype="auto"))
    job_run = object.__new__(JobRun)
    job_run.folder = folder

    def check(*dtypes: str) -> None:
        executor.slots = [_Slot(i, None, {"dtype": d}) for i, d in enumerate(dtypes)]
        job_run._check_numerics(executor.numerics())

    check("float32", "float32")
    assert folder.fingerprint == fp
    with pytest.raises(JobError, match="bfloat16 and float32"):
        check("float32", "bfloat16")
    check("bfloat16", "bfloat16")  # nothing committed: the driver's guess was wrong
    assert folder.fingerprint == {**fp, "numerics": "dtype=bfloat16,kv_cache_dtype=bfloat16"}
    writer = folder.writer(output_schema(pa.int64(), [], False), 1, 1e9)
    row = {"id": 0, "sample_index": 0, "text": "", "token_ids": [], "finish_reason": "length"}
    writer.add_row_group([{**row, "num_prompt_tokens": 1, "num_cached_tokens": 0}])
    writer.commit()
    with pytest.raises(JobError, match="numerics differs .*kv_cache_dtype=bfloat16 in the folder"):
        check("float32", "float32")
    folder.close()
