"""The ``batchgen`` command: run, run-batch, validate, status.

A view only: parse the command line, load the job, call the runner, and map what comes back to
the exit codes of docs/job-file.md:

- 0: done.
- 2: the job, its input or its model is invalid (a BatchgenError): one line ``error: ...``.
- 130: interrupted (SIGINT/SIGTERM, after the runner saved what was finished).
- 1: anything else, a bug: one line ``internal error: ...`` naming a log file that holds the
  traceback. A traceback never reaches the terminal.

The runner (and with it torch) is imported inside the commands, so ``--help`` stays fast.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import platform
import shlex
import sys
import tempfile
import traceback
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from types import ModuleType, TracebackType
from typing import Any, TypeVar

import click

from batchgen.errors import BatchgenError, OutputFullError
from batchgen.job import Job
from batchgen.jobfile import apply_override, load_job, parse_job
from batchgen.layout import LOGS_PREFIX
from batchgen.signals import EXIT_INTERRUPTED, Interrupted, exit_at_once

EXIT_INTERNAL = 1
EXIT_INVALID = 2

F = TypeVar("F", bound=Callable[..., Any])


def _runner() -> ModuleType:
    """The runner module (imported on first use; tests may put a fake in sys.modules)."""
    return importlib.import_module("batchgen.runner")


def _one_line(exc: BaseException) -> str:
    """An exception as one line: its message with newlines folded, or its type's name."""
    text = " ".join(str(exc).split())
    return text or type(exc).__name__


def _write_traceback(exc: BaseException, log_dir: Path | None) -> Path:
    """Write the traceback to ``log_dir/.batchgen/logs/error-<time>.log`` (hidden: readers of
    the output folder never meet it), or to a temp file when there is no usable folder. Returns
    the file's path."""
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    text = (
        f"command: {shlex.join(sys.argv)}\n"
        f"python: {platform.python_version()} on {platform.platform()}\n\n"
        + "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    )
    if log_dir is not None and log_dir.is_dir():
        path = log_dir / LOGS_PREFIX / f"error-{stamp}.log"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
            return path
        except OSError:
            with contextlib.suppress(OSError):  # e.g. created empty on a full disk
                path.unlink(missing_ok=True)
    fd, name = tempfile.mkstemp(prefix=f"batchgen-error-{stamp}-", suffix=".log")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    return Path(name)


class _ErrorGuard:
    """Turns exceptions raised inside a command into the documented exit codes and one stderr line.

    Set ``log_dir`` as soon as the output folder is known, so a traceback lands next to the
    results it concerns.
    """

    def __init__(self) -> None:
        self.log_dir: Path | None = None

    def __enter__(self) -> _ErrorGuard:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        if exc is None:
            return False
        if isinstance(exc, (click.exceptions.Exit, click.ClickException, click.Abort)):
            return False  # click's own control flow
        if isinstance(exc, BatchgenError):
            click.echo(f"error: {_one_line(exc)}", err=True)
            raise click.exceptions.Exit(EXIT_INVALID) from None
        if isinstance(exc, OutputFullError):
            # Not a bug (no traceback log: there is no room for it either) and not an invalid
            # job (exit 2): the saved rows stay and the same command resumes once there is room.
            click.echo(f"error: {_one_line(exc)}", err=True)
            raise click.exceptions.Exit(EXIT_INTERNAL) from None
        if isinstance(exc, (KeyboardInterrupt, Interrupted)):
            message = "" if isinstance(exc, KeyboardInterrupt) else _one_line(exc)
            click.echo(
                message if message and message != type(exc).__name__ else "interrupted", err=True
            )
            if getattr(exc, "signum", None) is not None:
                # Stopped by a real signal: everything is saved. Leave now, skipping interpreter
                # finalization, which resets the signal handlers to the defaults: another Ctrl-C
                # during torch's teardown would otherwise kill the process (-2) instead of 130.
                for stream in (sys.stdout, sys.stderr):
                    with contextlib.suppress(Exception):
                        stream.flush()
                os._exit(EXIT_INTERRUPTED)
            raise click.exceptions.Exit(EXIT_INTERRUPTED) from None
        if isinstance(exc, Exception):
            try:
                where = f"traceback written to {_write_traceback(exc, self.log_dir)}"
            except OSError as log_err:
                where = f"no traceback written: {_one_line(log_err)}"
            click.echo(
                f"internal error: {type(exc).__name__}: {_one_line(exc)} ({where})", err=True
            )
            raise click.exceptions.Exit(EXIT_INTERNAL) from None
        return False  # SystemExit, GeneratorExit: not ours to handle


def _set_option(f: F) -> F:
    return click.option(
        "--set",
        "overrides",
        multiple=True,
        metavar="KEY=VALUE",
        help="Override one key of the job file (dotted key, YAML value). Repeatable.",
    )(f)


_JOB_ARG = click.argument("job_file", metavar="JOB.yaml", type=click.Path(path_type=Path))


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="batchgen", prog_name="batchgen")
def main() -> None:
    """Offline batch LLM inference: Parquet rows in, Parquet completions out.

    \b
    Example:
      batchgen validate jobs/quickstart.yaml
      batchgen run jobs/quickstart.yaml --set sampling.n=4
      batchgen status out/quickstart
    """


@main.command()
@_JOB_ARG
@_set_option
@click.option("--fresh", is_flag=True, help="Delete earlier results in the output folder first.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
def run(job_file: Path, overrides: tuple[str, ...], fresh: bool, quiet: bool) -> None:
    """Generate completions for every input row of JOB.yaml.

    If the output folder already holds part of the same job, only the missing rows are
    generated. Exit codes: 0 done, 2 invalid job/input/model, 130 interrupted (finished rows
    are saved), 1 internal error.

    \b
    Example:
      batchgen run jobs/quickstart.yaml
      batchgen run jobs/quickstart.yaml --set engine.block_size=32 --fresh
    """
    with _ErrorGuard() as guard, exit_at_once():
        job = load_job(job_file, overrides)
        guard.log_dir = job.output.path if isinstance(job.output.path, Path) else None
        _runner().run(job, fresh=fresh, quiet=quiet)


@main.command()
@_JOB_ARG
@_set_option
def validate(job_file: Path, overrides: tuple[str, ...]) -> None:
    """Check JOB.yaml, its model and its input; print the plan.

    Checks the job file, the model folder and the input columns; nothing is generated or
    written.

    \b
    Example:
      batchgen validate jobs/quickstart.yaml --set engine.kv_cache_memory=2GiB
    """
    with _ErrorGuard():
        job = load_job(job_file, overrides)
        click.echo(_runner().validate(job))


def batch_parts_folder(out: Path) -> Path:
    """The results folder of ``run-batch IN OUT``: OUT's name without its extension plus
    ``.parts``, next to OUT (``out.jsonl`` -> ``out.parts/``)."""
    return out.with_name(f"{out.stem if out.suffix else out.name}.parts")


def batch_job(
    input_file: Path, output_file: Path, model: str, overrides: tuple[str, ...]
) -> tuple[Job, Path]:
    """The job of ``run-batch``: an ``openai_batch`` input, the results next to ``output_file``;
    ``--set`` overrides as for ``run``. Returns the job and the output JSONL's path."""
    out = output_file.absolute()
    raw: dict[str, Any] = {
        # a model folder that exists is made absolute; anything else is left as given
        "model": str(Path(model).absolute()) if Path(model).exists() else model,
        "input": {"path": str(input_file.absolute()), "format": "openai_batch"},
        "output": {"path": str(batch_parts_folder(out))},
    }
    for override in overrides:
        raw = apply_override(raw, override)
    return parse_job(raw, source="run-batch"), out


@main.command("run-batch")
@click.argument("input_file", metavar="IN", type=click.Path(path_type=Path))
@click.argument("output_file", metavar="OUT", type=click.Path(path_type=Path))
@click.option("--model", "-m", required=True, help="The model folder.")
@_set_option
@click.option("--fresh", is_flag=True, help="Delete earlier results first.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
def run_batch(
    input_file: Path,
    output_file: Path,
    model: str,
    overrides: tuple[str, ...],
    fresh: bool,
    quiet: bool,
) -> None:
    """Run an OpenAI Batch API input file IN; write the batch output JSONL OUT.

    The Parquet results go to a folder next to OUT (OUT's name with ``.parts`` for its
    extension); run the same command again to resume. OUT is written when every request ran.

    \b
    Example:
      batchgen run-batch requests.jsonl results.jsonl --model models/tiny-llama
      batchgen run-batch requests.jsonl results.jsonl -m models/tiny-llama --set sampling.seed=1
    """
    with _ErrorGuard() as guard, exit_at_once():
        job, out = batch_job(input_file, output_file, model, overrides)
        guard.log_dir = job.output.path
        _runner().run(job, fresh=fresh, quiet=quiet, batch_output=out)


@main.command()
@click.argument("output_dir", metavar="OUTPUT_DIR")
def status(output_dir: str) -> None:
    """Show how far the job writing OUTPUT_DIR has got.

    Safe to run while the job runs.

    \b
    Example:
      batchgen status out/quickstart
      batchgen status s3://bucket/runs/quickstart
    """
    with _ErrorGuard():  # a log goes to a temp file: OUTPUT_DIR may not be ours
        click.echo(_runner().status(output_dir))


if __name__ == "__main__":  # pragma: no cover
    main()
