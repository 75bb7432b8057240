"""The CLI as a view: exit codes 0/2/130/1, one line on stderr, never a traceback.

The runner is replaced by a fake module, so these tests need neither torch nor a model.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
import pytest

import batchgen
from batchgen.errors import InputError, JobError, ModelError
from batchgen.signals import Interrupted
from tests.jobkit import invoke, one_line

JOB = "model: m\ninput:\n  path: in.parquet\noutput:\n  path: out\n"


@pytest.fixture
def fake_runner(monkeypatch: pytest.MonkeyPatch) -> types.SimpleNamespace:
    """Install a fake ``batchgen.runner``; set ``.behaviour`` to make its calls raise."""
    calls: list[tuple[str, Any]] = []
    state = types.SimpleNamespace(calls=calls, behaviour=None)
    module = types.ModuleType("batchgen.runner")

    def act(name: str, arg: Any, result: Any) -> Any:
        calls.append((name, arg))
        if state.behaviour is not None:
            state.behaviour()
        return result

    def run(job: Any, fresh: bool = False, quiet: bool = False) -> dict:
        return act("run", (job, fresh, quiet), {"rows": 1})

    module.run = run  # type: ignore[attr-defined]
    module.validate = lambda job: act("validate", job, "plan: 3 rows")  # type: ignore[attr-defined]
    module.status = lambda path: act("status", path, f"status of {path}")  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "batchgen.runner", module)
    monkeypatch.setattr(batchgen, "runner", module, raising=False)
    return state


@pytest.fixture
def job_file(tmp_path: Path) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(JOB)
    return path


def raising(exc: BaseException) -> Callable[[], None]:
    def behaviour() -> None:
        raise exc

    return behaviour


# --------------------------------------------------------------------------- success


def test_run_passes_job_and_flags(fake_runner: Any, job_file: Path) -> None:
    result = invoke("run", job_file, "--set", "sampling.n=3", "--fresh", "--quiet")
    assert result.exit_code == 0, result.output
    assert result.stdout == "" and result.stderr == ""  # the runner prints, not the CLI
    ((name, (job, fresh, quiet)),) = fake_runner.calls
    assert name == "run" and fresh is True and quiet is True
    assert job.sampling.n == 3
    assert job.output.path == job_file.parent / "out"


def test_run_defaults(fake_runner: Any, job_file: Path) -> None:
    assert invoke("run", job_file).exit_code == 0
    ((_, (_, fresh, quiet)),) = fake_runner.calls
    assert (fresh, quiet) == (False, False)


def test_validate_prints_plan(fake_runner: Any, job_file: Path) -> None:
    result = invoke("validate", job_file, "--set", "engine.block_size=32")
    assert result.exit_code == 0
    assert result.stdout == "plan: 3 rows\n"
    assert fake_runner.calls[0][1].engine.block_size == 32


def test_status_prints(fake_runner: Any, tmp_path: Path) -> None:
    result = invoke("status", tmp_path)
    assert result.exit_code == 0
    assert result.stdout == f"status of {tmp_path}\n"


def test_help_has_examples() -> None:
    for args in ([], ["run"], ["validate"], ["status"]):
        result = invoke(*args, "--help")
        assert result.exit_code == 0
        assert "Example:" in result.stdout


# --------------------------------------------------------------------------- exit code 2


@pytest.mark.parametrize("command", ["run", "validate"])
def test_bad_job_file_exits_2(fake_runner: Any, tmp_path: Path, command: str) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(JOB + "sampling:\n  temprature: 0.5\n")
    result = invoke(command, path)
    line = one_line(result, 2)
    assert line.startswith("error: ")
    assert "unknown key 'sampling.temprature' (did you mean 'temperature'?)" in line
    assert fake_runner.calls == []


def test_missing_job_file_exits_2(fake_runner: Any, tmp_path: Path) -> None:
    result = invoke("run", tmp_path / "nope.yaml")
    assert one_line(result, 2) == f"error: job file {tmp_path / 'nope.yaml'} not found"


def test_bad_override_exits_2(fake_runner: Any, job_file: Path) -> None:
    result = invoke("run", job_file, "--set", "engine.blok_size=32")
    assert "did you mean 'block_size'?" in one_line(result, 2)
    result = invoke("run", job_file, "--set", "no-equals-sign")
    assert "expected KEY=VALUE" in one_line(result, 2)


@pytest.mark.parametrize("error", [JobError, InputError, ModelError])
def test_runner_errors_exit_2(fake_runner: Any, job_file: Path, error: type) -> None:
    fake_runner.behaviour = raising(error("the thing is wrong\nsecond line"))
    result = invoke("run", job_file)
    assert one_line(result, 2) == "error: the thing is wrong second line"


def test_status_error_exits_2(fake_runner: Any, tmp_path: Path) -> None:
    fake_runner.behaviour = raising(JobError(f"{tmp_path} is not a batchgen output folder"))
    result = invoke("status", tmp_path)
    assert one_line(result, 2).startswith("error: ")


# --------------------------------------------------------------------------- exit code 130


def test_interrupted_exits_130(fake_runner: Any, job_file: Path) -> None:
    fake_runner.behaviour = raising(Interrupted("interrupted; 5 rows saved this run"))
    result = invoke("run", job_file)
    assert one_line(result, 130) == "interrupted; 5 rows saved this run"


def test_keyboard_interrupt_exits_130(fake_runner: Any, job_file: Path) -> None:
    fake_runner.behaviour = raising(KeyboardInterrupt())
    result = invoke("run", job_file)
    assert one_line(result, 130) == "interrupted"


# --------------------------------------------------------------------------- exit code 1


def test_internal_error_logs_in_output_folder(fake_runner: Any, job_file: Path) -> None:
    out = job_file.parent / "out"
    out.mkdir()
    fake_runner.behaviour = raising(ZeroDivisionError("division by zero"))
    result = invoke("run", job_file)
    line = one_line(result, 1)
    assert line.startswith(
        "internal error: ZeroDivisionError: division by zero (traceback written to "
    )
    logs = list(out.glob(".batchgen/logs/error-*.log"))
    assert len(logs) == 1 and str(logs[0]) in line
    text = logs[0].read_text()
    assert "Traceback" in text and "ZeroDivisionError" in text and "command:" in text


def test_internal_error_without_output_folder_logs_to_temp(
    fake_runner: Any, job_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setenv("TMPDIR", str(temp))
    monkeypatch.setattr("tempfile.tempdir", None)
    fake_runner.behaviour = raising(RuntimeError(""))
    result = invoke("validate", job_file)
    line = one_line(result, 1)
    assert line.startswith("internal error: RuntimeError: RuntimeError (traceback written to ")
    logs = list(temp.glob("batchgen-error-*.log"))
    assert len(logs) == 1 and str(logs[0]) in line


def test_missing_runner_is_an_internal_error(
    monkeypatch: pytest.MonkeyPatch, job_file: Path
) -> None:
    monkeypatch.setitem(sys.modules, "batchgen.runner", None)  # import raises ImportError
    result = invoke("validate", job_file)
    assert one_line(result, 1).startswith("internal error: ")


def test_click_usage_errors_stay_with_click(fake_runner: Any) -> None:
    result = invoke("run")
    assert result.exit_code == 2
    assert "Missing argument 'JOB.yaml'" in result.stderr
    assert "Traceback" not in result.stderr


def test_click_exit_passes_through(fake_runner: Any, job_file: Path) -> None:
    fake_runner.behaviour = raising(click.exceptions.Exit(0))
    assert invoke("run", job_file).exit_code == 0
