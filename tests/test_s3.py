"""Object storage: ``s3://`` input and output against a local S3-compatible server (moto's
server mode, started here on 127.0.0.1; ``moto[server]`` is in the test extra).

The commit protocol on object storage (batchgen.results, ObjectOutputFolder): a part is staged
under a unique ``.batchgen/staging/`` name, the manifest listing it is the commit point, the part is
then copied to ``part-NNNNN.parquet``. Readers of the prefix see committed rows only; a crash at
any step leaves a folder that resumes exactly once; a second writer is refused (a lease object
per writer, batchgen.storage.ObjectLease). The kill -9 test prints its figures (``pytest -s``).
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest
import yaml

from batchgen.errors import JobError
from batchgen.jobfile import load_job
from batchgen.results import (
    COMMIT_STEPS,
    MANIFEST_NAME,
    REPORT_NAME,
    ObjectOutputFolder,
    OutputFolder,
)
from batchgen.schema import error_rows, output_schema
from batchgen.status import read_status
from batchgen.storage import ObjectFolder, s3_filesystem
from batchgen.tiny_model import make_prompts
from tests.jobkit import (
    invoke,
    read_results,
    refusal,
    run_cli,
    run_job,
    write_job,
    write_job_file,
)
from tests.ties import compare_samples

pytest.importorskip("moto")

BUCKET = "batchgen-test"
FP = {"model": "m", "input": "i", "sampling": "s"}
SCHEMA = output_schema(pa.int64(), [], logprobs=False)
PROC_TIMEOUT = 240  # seconds; a loaded 2-core machine starts torch slowly
SAMPLING = {"n": 2, "max_tokens": 12, "temperature": 0.8, "seed": 3, "ignore_eos": True}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def s3_server() -> Iterator[str]:
    """moto's S3 server in its own process on 127.0.0.1; its endpoint URL."""
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(url, timeout=1).close()
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError("moto server did not start") from None
            time.sleep(0.1)
    yield url
    proc.kill()
    proc.wait()


@pytest.fixture
def s3(s3_server: str, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> Any:
    """The AWS variables pointing at the local server, and a fresh prefix in the bucket."""
    for key, value in {
        "AWS_ENDPOINT_URL": s3_server,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
    }.items():
        monkeypatch.setenv(key, value)
    fs = s3_filesystem()
    if fs.get_file_info(BUCKET).type == pafs.FileType.NotFound:
        pafs.S3FileSystem(
            endpoint_override=s3_server.removeprefix("http://"),
            scheme="http",
            access_key="testing",
            secret_key="testing",
            allow_bucket_creation=True,
        ).create_dir(BUCKET)
    prefix = f"{BUCKET}/{request.node.name.replace('[', '-').replace(']', '')}"
    fs.delete_dir_contents(prefix, missing_dir_ok=True)
    return SimpleNamespace(fs=fs, prefix=prefix, uri=f"s3://{prefix}", endpoint=s3_server)


def names(s3: Any, sub: str = "out") -> list[str]:
    """Every object under ``prefix/sub``, relative to it."""
    folder = ObjectFolder(f"{s3.uri}/{sub}")
    return sorted(folder.list())


def s3_results(s3: Any, sub: str = "out") -> list[dict]:
    """What a reader of the prefix sees (pyarrow.dataset over s3, default options)."""
    dataset = ds.dataset(f"{s3.prefix}/{sub}", format="parquet", filesystem=s3.fs)
    rows = dataset.to_table().to_pylist()
    return sorted(rows, key=lambda r: (r["id"], r["sample_index"]))


def upload(s3: Any, local: Path, key: str) -> str:
    with s3.fs.open_output_stream(f"{s3.prefix}/{key}") as f:
        f.write(local.read_bytes())
    return f"{s3.uri}/{key}"


def s3_job(
    s3: Any, tmp: Path, model: Path, prompts: list[str], sampling: dict = SAMPLING, **extra: Any
) -> Path:
    """A job reading ``prompts`` from s3 and writing to ``<prefix>/out``."""
    local = write_job(tmp, model, prompts, sampling=sampling, **extra)
    job = yaml.safe_load(local.read_text())
    job["input"]["path"] = upload(s3, tmp / "prompts.parquet", "in/prompts.parquet")
    job["output"]["path"] = f"{s3.uri}/out"
    return write_job_file(tmp, job, "s3.yaml")


def manifest(s3: Any, sub: str = "out") -> dict[str, Any] | None:
    """The manifest, read again when it is being replaced: moto (unlike S3, whose PUTs are
    atomic) can serve an object that a concurrent PUT is still writing, the new text's start
    over the old one's tail: malformed JSON or, cut inside a character, bytes that are not
    UTF-8 (both ValueErrors)."""
    for _ in range(50):
        raw = ObjectFolder(f"{s3.uri}/{sub}").read_bytes(MANIFEST_NAME)
        try:
            return json.loads(raw) if raw else None
        except ValueError:  # json.JSONDecodeError or UnicodeDecodeError
            time.sleep(0.02)
    raise AssertionError("the manifest stays unreadable")


# --------------------------------------------------------------------------- the job file


def test_job_file_keeps_s3_paths_and_reads_storage(tmp_path: Path) -> None:
    text = (
        "model: /m\ninput:\n  path: s3://b/in/*.parquet\noutput:\n  path: s3://b/runs/1/\n"
        "storage:\n  endpoint_url: http://127.0.0.1:9000\n  region: eu-west-1\n"
    )
    job = load_job(write_job_file(tmp_path, text))
    assert job.input.path == "s3://b/in/*.parquet"
    assert job.output.path == "s3://b/runs/1/"
    assert (job.storage.endpoint_url, job.storage.region) == ("http://127.0.0.1:9000", "eu-west-1")
    with pytest.raises(JobError, match="unknown key 'storage.secret_key'"):
        load_job(write_job_file(tmp_path, text + "  secret_key: x\n"))


# --------------------------------------------------------------------------- the protocol


def write_rows(folder: OutputFolder, ids: range, on_step: Any = None) -> None:
    writer = folder.writer(SCHEMA, 10**6, 1e9, on_step=on_step)
    for i in ids:
        writer.add_row_group(error_rows(i, {}, f"row {i}", 1, False))
    writer.commit()


def test_commits_are_visible_only_once_committed(s3: Any) -> None:
    uri = f"{s3.uri}/out"
    with OutputFolder.open(uri, FP) as folder:
        assert isinstance(folder, ObjectOutputFolder)
        write_rows(folder, range(0, 5))
        write_rows(folder, range(5, 8))
        assert names(s3) == sorted(
            [MANIFEST_NAME, "part-00000.parquet", "part-00001.parquet", folder._lease.name]
        )
    # the lease is gone once closed; readers see exactly the rows
    assert names(s3) == [MANIFEST_NAME, "part-00000.parquet", "part-00001.parquet"]
    assert [r["id"] for r in s3_results(s3)] == list(range(8))
    with OutputFolder.open(uri, FP) as folder:
        assert folder.completed_ids() == set(range(8))
        assert folder.counts()["rows"] == 8


@pytest.mark.parametrize("step", [*COMMIT_STEPS, "after_manifest"])
def test_crash_at_each_step_resumes_exactly_once(s3: Any, step: str) -> None:
    """A crash in each step of a commit: readers never see uncommitted rows; the next open
    keeps exactly the committed rows and leaves no staging object behind."""
    uri = f"{s3.uri}/out"
    folder = OutputFolder.open(uri, FP)
    write_rows(folder, range(0, 3))

    class Crash(Exception):
        pass

    def crash_at(name: str) -> None:
        if name == step:
            raise Crash

    store = folder.store
    if step == "after_manifest":  # the manifest is written, the part not yet published
        store.copy = lambda src, dst: (_ for _ in ()).throw(Crash())  # type: ignore[method-assign]
    with pytest.raises(Crash):
        write_rows(folder, range(3, 6), on_step=crash_at)
    folder._lease._stop.set()  # the crashed process renews no more (its lease is left behind)
    committed = step in ("part_renamed", "after_manifest")
    # readers: committed and published rows only (never a half-done commit)
    visible = [r["id"] for r in s3_results(s3)]
    assert visible == (list(range(6)) if step == "part_renamed" else list(range(3)))
    # same host, live process: the crashed folder's lease still counts...
    with pytest.raises(JobError, match="in use by another batchgen process"):
        OutputFolder.open(uri, FP)
    folder._lease = None  # ...so drop it as a killed process would (its pid's check aside)
    store.delete(next(n for n in store.list() if n.startswith(".batchgen/lease/")))
    with OutputFolder.open(uri, FP) as again:
        assert again.completed_ids() == (set(range(6)) if committed else set(range(3)))
        assert not [n for n in names(s3) if n.startswith(".batchgen/staging/")]
    assert [r["id"] for r in s3_results(s3)] == (list(range(6)) if committed else list(range(3)))


def test_a_second_writer_is_refused(s3: Any) -> None:
    uri = f"{s3.uri}/out"
    with OutputFolder.open(uri, FP) as first:
        with pytest.raises(JobError, match="in use by another batchgen process"):
            OutputFolder.open(uri, FP)
        write_rows(first, range(2))  # the first one still commits
    with OutputFolder.open(uri, FP) as later:  # released: the next one may write
        assert later.completed_ids() == {0, 1}


def test_stale_leases_are_taken_over(s3: Any, tmp_path: Path) -> None:
    """A lease of a process gone from this host is stale at once; one of another host only when
    it has not been renewed for lease_seconds (measured on the store's clock)."""
    uri = f"{s3.uri}/out"
    store = ObjectFolder(uri)
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True
    )
    body = {"host": socket.gethostname(), "pid": int(dead.stdout), "token": "dead"}
    store.put(".batchgen/lease/dead.json", lambda f: f.write(json.dumps(body).encode()))
    with OutputFolder.open(uri, FP):
        pass
    assert ".batchgen/lease/dead.json" not in store.list()
    # an earlier batchgen's lease (its layout's name) keeps this one out as well
    body = {"host": "another-host", "pid": 1, "token": "far"}
    store.put("_lease/far.json", lambda f: f.write(json.dumps(body).encode()))
    storage = load_job(
        write_job_file(
            tmp_path,
            "model: /m\ninput:\n  path: p\noutput:\n  path: o\nstorage:\n  lease_seconds: 1\n",
        )
    ).storage
    with pytest.raises(JobError, match="pid 1 on another-host"):
        OutputFolder.open(uri, FP, storage=storage)
    time.sleep(2.5)  # the other host's lease is now older than lease_seconds on the store's clock
    with OutputFolder.open(uri, FP, storage=storage):
        assert "_lease/far.json" not in store.list()


def test_a_writer_that_lost_its_lease_does_not_commit(s3: Any) -> None:
    uri = f"{s3.uri}/out"
    folder = OutputFolder.open(uri, FP)
    write_rows(folder, range(2))
    folder._lease._stop.set()
    folder.store.delete(folder._lease.name)  # taken over while it was paused
    with pytest.raises(JobError, match="lost the writer's lease"):
        write_rows(folder, range(2, 4))
    assert manifest(s3)["totals"]["rows"] == 2
    folder._lease = None
    # a writer whose renewals failed for lease_seconds stops too (its own clock measures it)
    with OutputFolder.open(uri, FP) as other:
        other._lease._renewed -= other._lease.ttl + 1
        with pytest.raises(JobError, match="was not renewed for"):
            write_rows(other, range(2, 4))
        assert manifest(s3)["totals"]["rows"] == 2


# --------------------------------------------------------------------------- the earlier layout

EARLIER = ("_report.json", "_batch_output.jsonl", "_manifest.json")


def to_earlier_layout(store: ObjectFolder) -> None:
    """A folder as an earlier batchgen left it: manifest and report beside the parts, and its
    newest part committed but not published yet (a crash between the manifest's PUT and the
    copy): staged under the earlier ``_staging/`` name only."""
    manifest = json.loads(store.read_bytes(MANIFEST_NAME) or b"")
    last = manifest["parts"][-1]
    last["staged"] = f"_staging/{last['name'].removesuffix('.parquet')}-earlier.parquet"
    store.copy(last["name"], last["staged"])
    store.delete(last["name"])
    store.put("_manifest.json", lambda f: f.write(json.dumps(manifest).encode()))
    store.copy(REPORT_NAME, "_report.json")
    for name in store.list():
        if name.startswith(".batchgen/"):
            store.delete(name)


@pytest.mark.parametrize("crash", [None, "copy:0", "copy:1", "delete:0", "delete:2"])
def test_an_earlier_folder_on_s3_is_migrated(
    s3: Any, monkeypatch: pytest.MonkeyPatch, crash: str | None
) -> None:
    """status reads an earlier-layout folder; opening it migrates it (rolling its unpublished
    part forward) also when an earlier open was killed at a copy or a delete of the migration;
    no row is lost or repeated."""
    uri = f"{s3.uri}/out"
    with OutputFolder.open(uri, FP) as folder:
        write_rows(folder, range(0, 3))
        write_rows(folder, range(3, 5))
        folder.write_report({"rows": 5, "elapsed_s": 1.0, "output_tokens_per_s": 20.0})
    store = ObjectFolder(uri)
    to_earlier_layout(store)
    assert "5 rows" in read_status(uri) and "20.0 output tokens/s" in read_status(uri)
    assert [r["id"] for r in s3_results(s3)] == [0, 1, 2]  # the unpublished part is hidden

    if crash is not None:
        op, at = crash.split(":")
        real = getattr(ObjectFolder, op)
        calls: list[str] = []

        class Crash(Exception):
            pass

        def crashing(self: ObjectFolder, name: str, *rest: str) -> None:
            if name in EARLIER:
                if len(calls) == int(at):
                    raise Crash(name)
                calls.append(name)
            real(self, name, *rest)

        with monkeypatch.context() as m:
            m.setattr(ObjectFolder, op, crashing)
            with pytest.raises(Crash):
                OutputFolder.open(uri, FP)  # the lease is released on the way out
        assert "5 rows" in read_status(uri)
        assert [r["id"] for r in s3_results(s3)] == [0, 1, 2]

    with OutputFolder.open(uri, FP) as folder:
        assert folder.completed_ids() == set(range(5))
        assert folder.counts()["rows"] == 5
    assert names(s3) == [MANIFEST_NAME, REPORT_NAME, "part-00000.parquet", "part-00001.parquet"]
    assert [r["id"] for r in s3_results(s3)] == list(range(5))
    assert "20.0 output tokens/s" in read_status(uri)


# --------------------------------------------------------------------------- whole jobs


@pytest.fixture(scope="module")
def model(tiny_model) -> Path:
    return tiny_model("llama")


def test_job_from_s3_to_s3_equals_the_local_job(s3: Any, model: Path, tmp_path: Path) -> None:
    prompts = make_prompts(10, seed=5)
    local = write_job(tmp_path / "local", model, prompts, sampling=SAMPLING)
    run_cli("run", str(local), "--quiet")
    expected = read_results(local.parent / "out")
    job = s3_job(s3, tmp_path / "s3", model, prompts)

    plan = run_cli("validate", str(job)).stdout
    assert "10 rows from s3://" in plan and f"{s3.uri}/out (new)" in plan
    run_cli("run", str(job), "--quiet")
    assert s3_results(s3) == expected
    objects = names(s3)
    assert [n for n in objects if not n.startswith(".")] == ["part-00000.parquet"]
    assert not [n for n in objects if n.startswith((".batchgen/staging/", ".batchgen/lease/"))]

    status = run_cli("status", f"{s3.uri}/out").stdout
    assert "finished" in status and "10 of 10 rows" in status
    assert "resumes: 10 of 10 rows done" in run_cli("validate", str(job)).stdout
    again = run_cli("run", str(job), "--quiet")
    assert "nothing to do" in again.stderr
    # the fingerprint and the folder hold no secrets
    assert "testing" not in json.dumps(manifest(s3))
    # another job is refused; --fresh deletes the results first
    assert "holds a different job" in refusal(invoke("run", job, "--set", "sampling.seed=9"))
    run_cli("run", str(job), "--quiet", "--fresh", "--set", "sampling.seed=9")
    assert s3_results(s3) != expected and len(s3_results(s3)) == len(expected)
    assert [n for n in names(s3) if not n.startswith(".")] == ["part-00000.parquet"]


@pytest.mark.parametrize("fmt", ["jsonl", "csv"])
def test_other_input_formats_read_from_s3(s3: Any, model: Path, tmp_path: Path, fmt: str) -> None:
    """A prefix of JSON Lines / CSV objects (input.format names which) gives the rows of the same
    prompts read from a local Parquet file; the parquet object beside them is not read."""
    import pyarrow.csv as pcsv

    prompts = make_prompts(6, seed=7)
    local = write_job(tmp_path / "local", model, prompts, sampling=SAMPLING)
    expected = run_job(local)
    table = pq.read_table(tmp_path / "local" / "prompts.parquet")
    data = tmp_path / f"prompts.{fmt}"
    if fmt == "jsonl":
        data.write_text("".join(json.dumps(r) + "\n" for r in table.to_pylist()))
    else:
        pcsv.write_csv(table, data)
    upload(s3, data, f"in/prompts.{fmt}")
    upload(s3, tmp_path / "local" / "prompts.parquet", "in/other.parquet")
    job = yaml.safe_load(local.read_text())
    job["input"] = {"path": f"{s3.uri}/in/", "format": fmt}
    job["output"]["path"] = str(tmp_path / "out-s3")
    path = write_job_file(tmp_path, job, "s3.yaml")
    assert run_job(path) == expected


def test_s3_problems_are_one_line(s3: Any, model: Path, tmp_path: Path) -> None:
    job = s3_job(s3, tmp_path, model, make_prompts(2, seed=5))
    line = refusal(invoke("validate", job, "--set", "input.path=s3://batchgen-test/nothing-here/"))
    assert "s3://batchgen-test/nothing-here" in line
    line = refusal(invoke("validate", job, "--set", "output.path=s3://no-such-bucket/out"))
    assert "bucket no-such-bucket does not exist" in line
    assert "not a batchgen output folder" in refusal(invoke("status", f"{s3.uri}/empty"))


# --------------------------------------------------------------------------- kill -9


def start(job: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "batchgen.cli", "run", str(job), "--quiet"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_sigkill_mid_job_then_resume_on_s3(s3: Any, model: Path, tmp_path: Path) -> None:
    """Real runs killed with SIGKILL after each of their first commits; the resumed result is
    exactly the uninterrupted one, no (id, sample_index) twice, and readers never saw a row the
    manifest did not list."""
    rows = 96
    prompts = make_prompts(rows, seed=9)
    engine = {"max_num_seqs": 4}
    local = write_job(tmp_path / "local", model, prompts, sampling=SAMPLING, engine=engine)
    run_cli("run", str(local), "--quiet")
    expected = read_results(local.parent / "out")
    job = s3_job(s3, tmp_path / "s3", model, prompts, engine=engine)
    data = yaml.safe_load(job.read_text())
    data["output"].update(commit_rows=8, commit_seconds=0.2)
    job = write_job_file(tmp_path / "s3", data, "s3.yaml")

    start_time = time.monotonic()
    kills, in_commit, before, resumed_rows = 0, 0, 0, []
    store = ObjectFolder(f"{s3.uri}/out")
    while kills < 6:
        proc = start(job)
        deadline = time.monotonic() + PROC_TIMEOUT
        while proc.poll() is None and time.monotonic() < deadline:
            m = manifest(s3)
            done = m["totals"]["rows"] if m else 0
            if done > before:
                break
            time.sleep(0.05)
        # every other kill waits for a commit in flight (a staged part exists)
        staged = False
        if kills % 2 and proc.poll() is None:
            until = time.monotonic() + 20
            while proc.poll() is None and time.monotonic() < until and not staged:
                staged = any(n.startswith(".batchgen/staging/") for n in store.list())
        if proc.poll() is not None:
            break  # it finished before a kill landed
        proc.kill()
        proc.communicate()
        kills += 1
        in_commit += staged
        # readers see committed rows only, never duplicates
        seen = Counter((r["id"], r["sample_index"]) for r in s3_results(s3))
        assert all(c == 1 for c in seen.values())
        committed = manifest(s3)["totals"]["rows"]
        assert len(seen) <= committed * SAMPLING["n"]
        resumed_rows.append(committed)
        before = committed
    result = run_cli("run", str(job), "--quiet")
    elapsed = time.monotonic() - start_time
    got = s3_results(s3)
    keys = Counter((r["id"], r["sample_index"]) for r in got)
    duplicates = sum(c - 1 for c in keys.values())
    assert duplicates == 0
    # the tokens are the uninterrupted run's (up to near-tie flips between batch shapes, which
    # docs/job-file.md allows), and where they are, so is every column but the prefix-cache count
    ties = compare_samples(
        got, expected, model=model, prompts=dict(enumerate(prompts)), sampling=SAMPLING
    )
    columns = ("id", "sample_index", "text", "finish_reason", "num_prompt_tokens")
    assert [
        (a["id"], a["sample_index"])
        for a, b in zip(got, expected, strict=True)
        if a["token_ids"] == b["token_ids"] and any(a[c] != b[c] for c in columns)
    ] == []
    m = manifest(s3)
    assert m["finished"] and m["totals"]["rows"] == rows
    assert not [n for n in names(s3) if n.startswith((".batchgen/staging/", ".batchgen/lease/"))]
    print(
        f"\n[s3 kill -9] {rows} rows, {len(got)} samples, {kills} kills "
        f"({in_commit} with a commit in flight), "
        f"{m['totals']['parts']} parts, committed rows at the kills {resumed_rows}, "
        f"duplicates {duplicates}, near-ties {ties.exempt}, {elapsed:.1f} s in all; "
        f"last run: {result.stderr.strip()}"
    )
    assert kills >= 1


# --------------------------------------------------------------------------- Ray


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_ray_job_on_s3(s3: Any, model: Path, tmp_path: Path) -> None:
    """The Ray executor with s3 input and output: the driver alone reads and writes the store,
    workers get rows through Ray's object store (no shared filesystem)."""
    ray = pytest.importorskip("ray")
    prompts = make_prompts(12, seed=4)
    greedy = {"n": 1, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    local = write_job(tmp_path / "local", model, prompts, sampling=greedy)
    run_cli("run", str(local), "--quiet")
    expected = read_results(local.parent / "out")
    job = s3_job(s3, tmp_path / "s3", model, prompts, greedy)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="WARNING")
    try:
        run_cli(
            "run",
            str(job),
            "--quiet",
            "--set",
            "executor.kind=ray",
            "--set",
            "executor.num_workers=2",
        )
    finally:
        ray.shutdown()
    got = s3_results(s3)
    assert [(r["id"], r["sample_index"]) for r in got] == [
        (r["id"], r["sample_index"]) for r in expected
    ]
    assert [r["token_ids"] for r in got] == [r["token_ids"] for r in expected]
    report = json.loads(ObjectFolder(f"{s3.uri}/out").read_bytes(REPORT_NAME))
    assert report["executor"] == "ray" and report["num_workers"] == 2


def test_s3_filesystem_reads_the_storage_section(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    settings = SimpleNamespace(endpoint_url="http://127.0.0.1:1", region="eu-west-3")
    fs = s3_filesystem(settings)  # type: ignore[arg-type]
    assert fs.region == "eu-west-3"
    assert "127.0.0.1:1" in repr(fs.__reduce__())
