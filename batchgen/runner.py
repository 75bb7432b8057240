"""One job end to end: ``validate``, ``run`` and ``status``.

:class:`JobRun` owns the only job loop: refill the executor with windows of encoded rows while it
wants work, poll it for finished input rows, commit them. Where the engines run (this process, Ray
workers) is the executor's business (:mod:`batchgen.executors`); what a row becomes on disk is
:mod:`batchgen.schema`'s and :mod:`batchgen.results`'; signals are :mod:`batchgen.signals`'.
"""

from __future__ import annotations

import gc
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from tqdm import tqdm

from batchgen.dataset import InputDataset
from batchgen.errors import JobError
from batchgen.executors import Executor
from batchgen.fingerprint import describe_fingerprint_mismatch, fingerprint
from batchgen.job import Job
from batchgen.layout import BATCH_OUTPUT_NAME
from batchgen.model.config import is_gguf
from batchgen.model.hub import resolve_model
from batchgen.model.loader import check_model, describe_gguf, load_tokenizer, model_identity
from batchgen.model.registry import read_model_info
from batchgen.openai_batch import write_batch_output
from batchgen.plan import (
    describe_engine,
    describe_executor,
    job_numerics,
    plan_num_blocks,
    resolve_placement,
    sampling_params,
)
from batchgen.prompts import PromptEncoder, check_job_against_model, output_columns
from batchgen.results import OutputFolder, inspect_folder, read_manifest
from batchgen.schema import RowGroup, Totals, error_rows, output_schema
from batchgen.signals import GracefulStop, Interrupted
from batchgen.status import read_status
from batchgen.storage import is_uri
from batchgen.structured import StructuredOutputs

# -- validate / status ----------------------------------------------------------------------------


def validate(job: Job) -> str:
    """Check the job as ``run`` would, in the same order, without generating or writing
    anything; return the plan. Raises the same errors ``run`` would raise before it starts."""
    job = resolve_model(job)  # a hub id -> its folder in the Hugging Face cache
    info = read_model_info(job.model)
    dataset = InputDataset(job.input, job.storage)
    check_model(job.model)  # weights and tokenizer files, from their headers
    text, adopt = job_numerics(job, job.output.path)
    fp = fingerprint(job, model_identity(job.model), dataset.identity, text)
    tokenizer = load_tokenizer(job.model)
    check_job_against_model(job, info, tokenizer)
    StructuredOutputs(job, info, tokenizer)  # the job-level constraint compiles
    state = inspect_folder(job.output.path, fp, False, adopt, job.storage)
    output = (
        f"resumes: {state.rows_done} of {dataset.num_rows} rows done" if state.manifest else "new"
    )
    continuations = (
        f"input.choices_column {job.input.choices_column!r}"
        if job.input.choices_column is not None
        else f"input.completion_column {job.input.completion_column!r}"
    )
    lines = [
        f"model:    {job.model} ({info.architecture}, {info.num_layers} layers, "
        f"{info.num_heads} heads / {info.num_kv_heads} KV heads, head_dim {info.head_dim})",
        f"input:    {dataset.num_rows} rows from {job.input.path}",
        (
            f"scores:   {dataset.num_rows} rows, a logprob per continuation ({continuations})"
            if job.task == "score"
            else f"samples:  {dataset.num_rows * job.sampling.n} (n={job.sampling.n}, "
            f"max_tokens={job.sampling.max_tokens})"
            if not _per_row_sampling(job)
            else f"samples:  n={job.sampling.n}, max_tokens={job.sampling.max_tokens}, "
            "unless a row sets its own"
        ),
        f"output:   {job.output.path} ({output})",
    ]
    if is_gguf(job.model):
        dtype = None if job.executor.kind == "ray" else resolve_placement(job).dtype
        lines.insert(1, f"weights:  GGUF {describe_gguf(job.model, dtype)} (dequantized at load)")
    if job.executor.kind == "ray":
        _check_ray_installed()
        return "\n".join(
            [
                *lines,
                describe_executor(job),
                "device, KV cache, max_model_len: decided by each worker when it starts",
            ]
        )
    lines += describe_engine(job, info, resolve_placement(job))
    lines.append(describe_executor(job))
    return "\n".join(lines)


def _per_row_sampling(job: Job) -> bool:
    return bool(job.input.sampling_columns) or job.input.format == "openai_batch"


def status(path: str | Path) -> str:
    return read_status(path)


def _check_ray_installed() -> None:
    try:
        import ray  # noqa: F401
    except ImportError:
        raise JobError(
            "executor.kind is 'ray' but Ray is not installed: pip install 'batchgen[ray]'"
        ) from None


def _make_executor(job: Job, tokenizer: Any, structured: StructuredOutputs) -> Executor:
    if job.executor.kind == "ray":
        from batchgen.executors.ray import RayExecutor

        return RayExecutor(job, tokenizer)
    from batchgen.executors.local import LocalExecutor

    info = read_model_info(job.model)
    return LocalExecutor(job, info, resolve_placement(job), tokenizer, structured)


# -- run ------------------------------------------------------------------------------------------


class JobRun:
    """One ``batchgen run``: the output folder and its writer, the totals, the executor, and
    the loop that joins them."""

    def __init__(
        self, job: Job, fresh: bool, quiet: bool, batch_output: Path | None = None
    ) -> None:
        """``batch_output``: where an OpenAI batch job writes its output JSONL (default:
        :func:`default_batch_output`)."""
        # what OpenAI batch output lines name as the model: the hub id, or the folder's name
        self.model_name = job.hub_id or Path(job.model).name
        job = resolve_model(job)  # a hub id -> its folder in the Hugging Face cache
        self.job = job
        self.quiet = quiet
        if job.input.format == "openai_batch" and batch_output is None and is_uri(job.output.path):
            raise JobError(
                "input.format openai_batch writes its output JSONL into output.path, which must "
                "then be a local folder"
            )
        self.batch_output = (
            (batch_output or default_batch_output(job))
            if job.input.format == "openai_batch"
            else None
        )
        info = read_model_info(job.model)
        self.dataset = InputDataset(job.input, job.storage)
        self.executor: Executor | None = None
        # Settings that can still fail are checked before the output folder is touched (the
        # number of KV blocks is planned again once the model is loaded and memory is known).
        # With Ray, each worker checks its own placement when it starts.
        if job.executor.kind == "ray":
            _check_ray_installed()
        else:
            plan_num_blocks(job, info, resolve_placement(job))
        text, adopt = job_numerics(job, job.output.path)
        fp = fingerprint(job, model_identity(job.model), self.dataset.identity, text)
        self.tokenizer = load_tokenizer(job.model)
        check_job_against_model(job, info, self.tokenizer)
        self.structured = StructuredOutputs(job, info, self.tokenizer)
        self.folder = OutputFolder.open(job.output.path, fp, fresh, adopt, job.storage)
        try:
            self._start(job)
        except BaseException:
            # Release the folder's lock now: a caller that keeps the exception (and with it this
            # half-built object) must not keep a later run on the same folder out.
            self._close_executor()
            self.folder.close()
            raise

    def _start(self, job: Job) -> None:
        """The rest of __init__, once the output folder is open and locked."""
        self.folder.set_total_rows(self.dataset.num_rows)
        self.done_ids = self.folder.completed_ids()
        self.totals = Totals()
        # Every row already committed (the fingerprint says they are this input's rows): there
        # is nothing to generate, so the model and the engine are not loaded.
        self.nothing_to_do = len(self.done_ids) >= self.dataset.num_rows
        if self.nothing_to_do:
            return
        if self.batch_output is not None:
            # It exists only for a finished job: it is written again when this run finishes.
            self.batch_output.unlink(missing_ok=True)
        self.encoder = PromptEncoder(job, self.tokenizer, self.structured)
        self.params = sampling_params(job)
        self.columns = output_columns(job, self.tokenizer)
        schema = output_schema(self.dataset.id_type, self.dataset.keep_fields, self.columns)
        # Checked before any model is loaded: results with other columns cannot be resumed.
        self.folder.check_schema(schema)
        self.executor = _make_executor(job, self.tokenizer, self.structured)
        self._check_numerics(self.executor.numerics())
        self.writer = self.folder.writer(schema, job.output.commit_rows, job.output.commit_seconds)

    def _check_numerics(self, ran: str) -> None:
        """The numerics the engines resolved must be the folder's. While nothing is committed
        the folder takes the engines' (with ``dtype: auto`` the driver of Ray workers can only
        guess what their devices give)."""
        folder = self.folder
        fp = {**folder.fingerprint, "numerics": ran}
        if fp == folder.fingerprint:
            return
        if not folder.counts()["parts"]:
            folder.set_fingerprint(fp)
            return
        raise JobError(
            f"output folder {folder.path} holds a different job: "
            f"{describe_fingerprint_mismatch(folder.fingerprint, fp)} (as the engines resolved "
            "engine.dtype); set engine.dtype, use --fresh to delete its results, or choose "
            "another output.path"
        )

    def _close_executor(self) -> None:
        executor, self.executor = self.executor, None
        if executor is not None:
            executor.close()

    def run(self) -> dict[str, Any]:
        """Generate the missing rows; commit as rows finish; write the report.

        The first SIGINT/SIGTERM stops admitting work: rows already finished are committed, the
        report is written (``finished: false``) and :class:`Interrupted` is raised. A second one
        exits 130 at once; the commit protocol keeps the folder consistent anyway (the next run
        removes a half-done commit). The folder's lock is released on return.
        """
        try:
            with GracefulStop() as signals:
                report = self._nothing_to_do() if self.nothing_to_do else self._generate(signals)
                if report["finished"] and self.batch_output is not None:
                    self._write_batch_output(self.batch_output)
        finally:
            self._close_executor()
            self.folder.close()
        if not report["finished"]:
            raise Interrupted(
                f"interrupted; {report['rows']} rows saved this run, {report['rows_done']} of "
                f"{report['rows_total']} in all; run it again to resume",
                signals.received,
            )
        return report

    def _write_batch_output(self, out: Path) -> None:
        """The OpenAI batch output JSONL, from the committed results (so resumes do not show)."""
        assert self.dataset.batch is not None
        manifest = read_manifest(self.folder.path) or {}
        created = datetime.strptime(
            manifest.get("created_at") or "1970-01-01T00:00:00.0Z", "%Y-%m-%dT%H:%M:%S.%fZ"
        ).replace(tzinfo=timezone.utc)
        lines = write_batch_output(
            self.dataset.batch,
            self.folder.path,
            out,
            self.model_name,
            int(created.timestamp()),
        )
        if not self.quiet:
            print(f"batchgen: wrote {lines} OpenAI batch output lines to {out}", file=sys.stderr)

    def _nothing_to_do(self) -> dict[str, Any]:
        """Every row is committed already: mark the folder finished (a run killed after its last
        commit left that undone) and keep the report of the run that did the work."""
        report = self.report(0.0, True)
        if not self.folder.finished:
            self.folder.mark_finished()
            self.folder.write_report(report)
        print(
            f"batchgen: done: nothing to do, all {report['rows_done']} rows are already in "
            f"{self.folder.path}",
            file=sys.stderr,
        )
        return report

    def _generate(self, signals: GracefulStop) -> dict[str, Any]:
        # What start-up made (modules, the tokenizer's tables, the model's objects) lives as long
        # as the generation: frozen out of the cyclic collector while it runs, whose full passes
        # over it paused the run up to 0.1 s each (workload L: 1.6% of its generation time), and
        # given back to it after (a process that runs several jobs collects them as before). No
        # collection first: in a long-lived process with a large heap (the test suite) one full
        # pass per job cost more than it saved; freezing and unfreezing are O(1).
        gc.freeze()
        try:
            return self._generate_rows(signals)
        finally:
            gc.unfreeze()

    def _generate_rows(self, signals: GracefulStop) -> dict[str, Any]:
        start = time.perf_counter()
        bar = tqdm(
            total=self.dataset.num_rows,
            initial=len(self.done_ids),
            unit="row",
            disable=self.quiet,
            file=sys.stderr,
            dynamic_ncols=True,
        )
        try:
            complete = self._loop(signals, bar, start)
            # Rows still in an engine are dropped unfinished; the next run generates them.
            self.writer.commit()
        finally:
            bar.close()
        elapsed = time.perf_counter() - start
        if complete:
            self.folder.mark_finished()
        report = self.report(elapsed, complete)
        self.folder.write_report(report)
        print(self.summary(report), file=sys.stderr)
        return report

    def _loop(self, signals: GracefulStop, bar: tqdm, start: float) -> bool:
        """Refill, poll, commit until every row ran (True) or a signal stops it (False)."""
        executor = self.executor
        assert executor is not None
        windows = self.dataset.iter_windows(executor.window_rows, skip_ids=self.done_ids)
        exhausted = False
        while not signals.stop:
            while not exhausted and not signals.stop and executor.wants_work():
                window = next(windows, None)
                if window is None:
                    exhausted = True
                    break
                runnable = []
                for item in self.encoder.encode(window):
                    if item.tokens is None:
                        self._add(self._error_rows(item.row, item.problem or "unknown error"))
                    else:
                        runnable.append(item)
                executor.submit(runnable)
            if signals.stop:
                break
            if not executor.has_work():
                assert exhausted, "an executor without work must want work"
                return True  # every window was read and every row has finished
            for group in executor.poll():
                self._add(group)
            elapsed = time.perf_counter() - start
            bar.set_postfix(
                tok_s=f"{executor.sampled_tokens() / max(elapsed, 1e-9):.0f}",
                cache=f"{100 * self.totals.hit_rate():.0f}%",
                refresh=False,
            )
            bar.update(len(self.done_ids) + self.totals.rows - bar.n)
            self.writer.maybe_commit()
        return False

    def _error_rows(self, row: Any, problem: str) -> RowGroup:
        n = row.num_samples(self.params.n)
        return error_rows(row.id, row.keep, problem, n, self.columns)

    def _add(self, group: RowGroup) -> None:
        """Buffer one finished input row for the next commit."""
        self.writer.add_row_group(group)
        self.totals.add(group)

    def report(self, elapsed: float, finished: bool) -> dict[str, Any]:
        """This run's figures (``rows``, tokens, speed: what this run generated), plus
        ``rows_done`` and ``rows_total`` for the output folder as a whole."""
        t = self.totals
        report: dict[str, Any] = {
            "finished": finished,
            "rows": t.rows,
            "rows_already_done": len(self.done_ids),
            "rows_done": self.folder.counts()["rows"],
            "rows_total": self.dataset.num_rows,
            "samples": t.samples,
            "prompt_tokens": t.prompt_tokens,
            "cached_prompt_tokens": t.cached_prompt_tokens,
            "computed_prompt_tokens": t.prompt_tokens - t.cached_prompt_tokens,
            "cache_hit_rate": round(t.hit_rate(), 4),
            "output_tokens": t.output_tokens,
            "elapsed_s": round(elapsed, 3),
            "output_tokens_per_s": round(t.output_tokens / elapsed, 2) if elapsed > 0 else 0.0,
            "preemptions": 0,
            "errors": t.errors,
            "executor": self.job.executor.kind,
        }
        if self.executor is not None:  # None: nothing to do, no engine was built
            report.update(self.executor.report())
        structured = report.get("structured")
        if structured is not None:
            # compiling the row schemas happens here, on the rows' way in
            structured["compile_s"] = round(self.structured.seconds, 4)
            structured["mask_share"] = (
                round(structured["mask_s"] / elapsed, 4) if elapsed > 0 else 0.0
            )
        return report

    @staticmethod
    def summary(r: dict[str, Any]) -> str:
        state = "done" if r["finished"] else "interrupted"
        workers = f" on {len(r['workers'])} Ray workers" if r.get("workers") else ""
        return (
            f"batchgen: {state}: {r['rows']} rows, {r['samples']} samples, "
            f"{r['output_tokens']} output tokens in {r['elapsed_s']:.1f}s{workers} "
            f"({r['output_tokens_per_s']:.0f} tok/s), prefix cache hit "
            f"{100 * r['cache_hit_rate']:.0f}%, {r['preemptions']} preemptions, "
            f"{r['errors']} errors"
        )


def default_batch_output(job: Job) -> Path:
    """Where ``run`` writes an OpenAI batch job's output JSONL: ``.batchgen/batch_output.jsonl``
    in the output folder (hidden: readers of the folder's Parquet files never meet it)."""
    return Path(job.output.path) / BATCH_OUTPUT_NAME


def run(
    job: Job, fresh: bool = False, quiet: bool = False, batch_output: Path | None = None
) -> dict[str, Any]:
    return JobRun(job, fresh, quiet, batch_output).run()
