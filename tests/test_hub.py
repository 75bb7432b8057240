"""Models by hub id: ``model: org/name`` (and ``revision``) resolved through a Hugging Face cache
that the tests build in the hub layout from tiny models (``models--org--name/snapshots/<commit>``,
``refs/<branch>``), with ``HF_HUB_OFFLINE=1``: nothing is downloaded."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from batchgen.errors import JobError, ModelError
from batchgen.jobfile import load_job
from batchgen.model.hub import hub_cache_dir, localize, resolve_model
from batchgen.tiny_model import make_prompts
from tests.jobkit import invoke, one_line, read_results, run_cli, write_job, write_job_file

REPO = "tiny-org/tiny-llama"
MAIN = "a" * 40  # commit of refs/main
V1 = "b" * 40  # commit of refs/v1: another model (other weights)
SAMPLING = {"n": 2, "max_tokens": 8, "temperature": 0.7, "seed": 1, "ignore_eos": True}


def add_snapshot(cache: Path, repo: str, commit: str, model: Path, refs: tuple[str, ...]) -> Path:
    """Put ``model``'s files into ``cache`` as huggingface_hub lays out a download."""
    root = cache / f"models--{repo.replace('/', '--')}"
    snapshot = root / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (root / "blobs").mkdir(exist_ok=True)
    for file in sorted(model.iterdir()):  # as the hub does: snapshot entries link to blobs
        blob = root / "blobs" / f"{commit[:8]}-{file.name}"
        shutil.copyfile(file, blob)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    (root / "refs").mkdir(parents=True, exist_ok=True)
    for ref in refs:
        (root / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture(scope="module")
def models(tiny_model) -> tuple[Path, Path]:
    return tiny_model("llama"), tiny_model("llama", seed=7)


@pytest.fixture
def cache(models, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A hub cache holding REPO at main (the first model) and at v1 (the second)."""
    folder = tmp_path / "hf-cache"
    add_snapshot(folder, REPO, MAIN, models[0], ("main",))
    add_snapshot(folder, REPO, V1, models[1], ("v1",))
    monkeypatch.setenv("HF_HUB_CACHE", str(folder))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return folder


def hub_job(tmp: Path, prompts: list[str], revision: str | None = None) -> Path:
    """A job on REPO (a hub id; the model folder argument is replaced)."""
    path = write_job(tmp, Path("unused"), prompts, sampling=SAMPLING)
    text = path.read_text().replace("model: unused", f"model: {REPO}")
    if revision is not None:
        text += f"revision: {revision}\n"
    path.write_text(text)
    return path


def test_a_hub_id_stays_one_and_resolves_from_the_cache(cache: Path, tmp_path: Path) -> None:
    job = load_job(hub_job(tmp_path, ["x"]))
    assert job.hub_id == REPO and job.model == Path(REPO)
    resolved = resolve_model(job)
    assert resolved.model == cache / f"models--{REPO.replace('/', '--')}" / "snapshots" / MAIN
    assert resolved.hub_id is None and resolved.revision is None
    assert resolve_model(resolved) == resolved  # a local folder stays as it is
    v1 = resolve_model(job.model_copy(update={"revision": "v1"}))
    assert v1.model.name == V1
    by_commit = resolve_model(job.model_copy(update={"revision": V1}))
    assert by_commit.model == v1.model


def test_hf_home_is_respected(models, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert hub_cache_dir() == tmp_path / "home" / "hub"
    add_snapshot(tmp_path / "home" / "hub", REPO, MAIN, models[0], ("main",))
    job = load_job(hub_job(tmp_path, ["x"]))
    assert resolve_model(job).model.name == MAIN


def test_jobs_by_hub_id_equal_jobs_on_the_folder(models, cache: Path, tmp_path: Path) -> None:
    """Hub id at main = the first model's folder; at revision v1 = the second's. The
    fingerprint identifies the model by its files: the hub id and its folder are one job."""
    prompts = make_prompts(6, seed=3)
    for revision, model in ((None, models[0]), ("v1", models[1])):
        name = revision or "main"
        local = write_job(tmp_path / f"local-{name}", model, prompts, sampling=SAMPLING)
        run_cli("run", str(local), "--quiet")
        job = hub_job(tmp_path / f"hub-{name}", prompts, revision)
        plan = run_cli("validate", str(job)).stdout
        assert f"snapshots/{MAIN if revision is None else V1}" in plan
        run_cli("run", str(job), "--quiet")
        assert read_results(job.parent / "out") == read_results(local.parent / "out")
    assert read_results(tmp_path / "hub-main" / "out") != read_results(tmp_path / "hub-v1" / "out")
    # the same job by folder resumes the hub job's output folder (nothing to do)
    again = run_cli(
        "run",
        str(tmp_path / "local-main" / "job.yaml"),
        "--quiet",
        "--set",
        f"output.path={tmp_path / 'hub-main' / 'out'}",
        "--set",
        f"input.path={tmp_path / 'hub-main' / 'prompts.parquet'}",
    )
    assert "nothing to do" in again.stderr


def test_a_missing_model_is_one_line(cache: Path, tmp_path: Path) -> None:
    job = hub_job(tmp_path, ["x"])
    for args, needles in [
        (("--set", "model=nobody/missing"), ("nobody/missing", "HF_HUB_OFFLINE", str(cache))),
        (("--set", "revision=v2"), (REPO, "revision v2", "HF_HUB_OFFLINE")),
    ]:
        for command in ("validate", "run"):
            line = one_line(invoke(command, job, *args), 2, *needles)
            assert "Traceback" not in line
    local = write_job(tmp_path / "local", Path("/abs/model"), ["x"])
    line = one_line(invoke("validate", local, "--set", "revision=v1"), 2, "revision")
    assert "hub id" in line


def test_a_ray_worker_finds_the_commit_in_its_own_cache(
    models, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No shared filesystem: the driver's snapshot folder does not exist on a worker's node;
    the worker takes the same commit from its own cache."""
    driver = tmp_path / "driver-cache" / f"models--{REPO.replace('/', '--')}" / "snapshots" / V1
    worker_cache = tmp_path / "worker-cache"
    mine = add_snapshot(worker_cache, REPO, V1, models[1], ())
    monkeypatch.setenv("HF_HUB_CACHE", str(worker_cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert localize(driver) == mine
    assert localize(models[0]) == models[0]  # a folder that exists stays as it is
    with pytest.raises(ModelError, match="HF_HUB_OFFLINE"):
        localize(driver.parent / MAIN)  # this commit is not in the worker's cache


def test_revision_needs_a_hub_id(tmp_path: Path, models) -> None:
    job = load_job(write_job(tmp_path, models[0], ["x"]))
    with pytest.raises(JobError, match="hub id"):
        resolve_model(job.model_copy(update={"revision": "main"}))
    assert write_job_file  # (jobkit's writer builds every job file here)
