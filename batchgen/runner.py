"""One job end to end: dataset -> tokenizer -> engine -> results, with progress, signals and resume.

Rows are read in windows; each window is tokenized and fed to the engine in lexicographic order
of its token ids, which is a depth-first walk of the window's prompt trie: rows that share a
prefix run one after another while the prefix is in the radix cache, and identical prompts become
one request whose samples are forked from a single prefill. Results are keyed by id, so the order
is invisible to users.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from batchgen.dataset import InputDataset, InputRow
from batchgen.engine.engine import Engine, EngineConfig
from batchgen.engine.request import (
    FinishReason,
    Request,
    SampleResult,
    SampleTarget,
    SamplingParams,
)
from batchgen.engine.sampler import rng_key
from batchgen.errors import JobError
from batchgen.host_memory import keep_freed_memory
from batchgen.job import Job, describe_fingerprint_mismatch, fingerprint
from batchgen.model import cpu_kernels
from batchgen.model.attention import make_attention_backend
from batchgen.model.config import ModelInfo, read_model_info
from batchgen.model.loader import (
    check_model,
    load_model,
    load_tokenizer,
    model_identity,
)
from batchgen.results import (
    _PART_RE,
    OutputFolder,
    _read_manifest,
    output_schema,
    read_status,
)

CPU_KV_CACHE_CAP = 1 << 30  # bytes: "auto" never takes more than this on a CPU
CPU_KV_CACHE_SHARE = 0.25  # of available memory, for "auto" on a CPU
GPU_KV_CACHE_SHARE = 0.85  # of free device memory after the model is loaded


class Interrupted(Exception):
    """Raised after a SIGINT/SIGTERM once everything finished so far has been saved."""


# -- settings -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Placement:
    device: torch.device
    dtype: torch.dtype
    backend: str  # "torch" | "triton"


def resolve_placement(job: Job) -> Placement:
    eng = job.engine
    if eng.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(eng.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise JobError(f"engine.device is {eng.device!r} but no CUDA device is available")
    if eng.dtype == "auto":
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    else:
        dtype = getattr(torch, eng.dtype)
    if eng.attention_backend == "auto":
        backend = "triton" if device.type == "cuda" else "torch"
    else:
        backend = eng.attention_backend
    if backend == "triton" and device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise JobError(
            "engine.attention_backend is 'triton' on a CPU: set TRITON_INTERPRET=1 "
            "(slow, for testing) or use 'torch'"
        )
    return Placement(device, dtype, backend)


def _available_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


def plan_num_blocks(job: Job, info: ModelInfo, place: Placement) -> int:
    """KV blocks for the pool: kv_cache_blocks, else kv_cache_memory, else a share of free memory."""
    eng = job.engine
    block_bytes = info.kv_bytes_per_token(place.dtype) * eng.block_size
    if eng.kv_cache_blocks is not None:
        return eng.kv_cache_blocks
    if eng.kv_cache_memory != "auto":
        blocks = int(eng.kv_cache_memory) // block_bytes
    elif place.device.type == "cuda":
        blocks = int(_available_memory(place.device) * GPU_KV_CACHE_SHARE) // block_bytes
    else:
        budget = min(int(_available_memory(place.device) * CPU_KV_CACHE_SHARE), CPU_KV_CACHE_CAP)
        blocks = budget // block_bytes
    if blocks < 1:
        raise JobError(
            f"engine.kv_cache_memory leaves no room for one KV block ({block_bytes} bytes)"
        )
    return blocks


def max_model_len(job: Job, info: ModelInfo, num_blocks: int) -> int:
    limit = info.max_model_len
    if job.engine.max_model_len is not None:
        limit = min(limit, job.engine.max_model_len)
    # One sequence must fit in the pool, or it could never be scheduled.
    return min(limit, num_blocks * job.engine.block_size)


def sampling_params(job: Job) -> SamplingParams:
    s = job.sampling
    return SamplingParams(
        n=s.n,
        max_tokens=s.max_tokens,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        min_p=s.min_p,
        repetition_penalty=s.repetition_penalty,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        stop=tuple(s.stop),
        stop_token_ids=tuple(s.stop_token_ids),
        ignore_eos=s.ignore_eos,
        seed=s.seed,
        logprobs=s.logprobs,
    )


# -- validate / status ----------------------------------------------------------------------------


def validate(job: Job) -> str:
    """Check the job as ``run`` would, in the same order, without generating or writing
    anything; return the plan. Raises the same errors ``run`` would raise before it starts."""
    info = read_model_info(job.model)
    dataset = InputDataset(job.input)
    check_model(job.model)  # weights and tokenizer files, from their headers
    output = _check_output_folder(job, dataset)
    load_tokenizer(job.model)
    head = [
        f"model:    {job.model} ({info.architecture}, {info.num_layers} layers, "
        f"{info.num_heads} heads / {info.num_kv_heads} KV heads, head_dim {info.head_dim})",
        f"input:    {dataset.num_rows} rows from {job.input.path}",
        f"samples:  {dataset.num_rows * job.sampling.n} (n={job.sampling.n}, "
        f"max_tokens={job.sampling.max_tokens})",
        f"output:   {job.output.path} ({output})",
    ]
    if job.executor.kind == "ray":
        _ray_executor()  # Ray is installed
        return "\n".join(
            [
                *head,
                _executor_plan(job),
                "device, KV cache, max_model_len: decided by each worker when it starts",
            ]
        )
    place = resolve_placement(job)
    num_blocks = plan_num_blocks(job, info, place)
    per_token = info.kv_bytes_per_token(place.dtype)
    bs = job.engine.block_size
    length: int | str = max_model_len(job, info, num_blocks)
    if length < min(info.max_model_len, job.engine.max_model_len or info.max_model_len):
        length = f"{length} (all the KV cache holds: longer prompts will be error rows)"
    lines = [
        *head,
        f"device:   {place.device} {str(place.dtype).removeprefix('torch.')}, "
        f"attention {place.backend}",
        f"KV cache: {per_token} bytes/token, {num_blocks} blocks x {bs} tokens = "
        f"{num_blocks * bs} tokens ({num_blocks * bs * per_token / 2**20:.1f} MiB)",
        f"max_model_len: {length}",
        _executor_plan(job),
    ]
    return "\n".join(lines)


def _executor_plan(job: Job) -> str:
    """The ``executor:`` line of the plan."""
    ex = job.executor
    if ex.kind == "local":
        return "executor: local (one engine in this process)"
    where = "a local Ray cluster started for the job" if ex.address is None else ex.address
    if ex.num_workers is not None:
        workers = f"{ex.num_workers} workers"
    elif ex.num_gpus is None:
        workers = (
            "one worker per GPU of the cluster "
            f"(per {ex.num_cpus:g} CPUs on a cluster without GPUs)"
        )
    elif ex.num_gpus > 0:
        workers = f"one worker per {ex.num_gpus:g} GPUs of the cluster"
    else:
        workers = f"one worker per {ex.num_cpus:g} CPUs of the cluster"
    gpus = "1 if the cluster has GPUs, else 0" if ex.num_gpus is None else f"{ex.num_gpus:g}"
    return (
        f"executor: ray on {where}: {workers}, each num_cpus={ex.num_cpus:g}, "
        f"num_gpus={gpus}, max_restarts={ex.max_restarts}"
    )


def _ray_executor() -> Any:
    """The Ray executor module; a JobError if Ray is not installed."""
    try:
        import ray  # noqa: F401
    except ImportError:
        raise JobError(
            "executor.kind is 'ray' but Ray is not installed: pip install 'batchgen[ray]'"
        ) from None
    from batchgen import ray_executor

    return ray_executor


def _check_output_folder(job: Job, dataset: InputDataset) -> str:
    """What ``run`` would find in the output folder, read-only: raises the JobError ``run``
    would raise when opening it (a file, not writable, a foreign folder, another job's
    results); else says whether the job starts afresh or resumes."""
    path = job.output.path
    if not path.exists():
        parent = path.parent
        while not parent.exists():
            parent = parent.parent
        if not parent.is_dir():
            raise JobError(f"cannot create output folder {path}: {parent} is a file")
        if not os.access(parent, os.W_OK | os.X_OK):
            raise JobError(f"cannot create output folder {path}: {parent} is not writable")
        return "new"
    if not path.is_dir():
        raise JobError(f"output path {path} is a file, not a folder")
    if not os.access(path, os.W_OK | os.X_OK):
        raise JobError(f"output folder {path} is not writable")
    manifest = _read_manifest(path)
    if manifest is None:
        foreign = sorted(
            n for n in os.listdir(path) if not n.startswith((".", "_")) and not _PART_RE.match(n)
        )
        if foreign:
            raise JobError(
                f"output folder {path} is not empty and is not a batchgen output folder "
                f"(it holds {', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''}); "
                "choose a new or empty folder"
            )
        return "new"
    fp = fingerprint(job, model_identity(job.model), dataset.identity)
    if manifest.get("fingerprint") != fp:
        what = describe_fingerprint_mismatch(manifest.get("fingerprint") or {}, fp)
        raise JobError(
            f"output folder {path} holds a different job: {what}; use --fresh to delete its "
            "results, or choose another output.path"
        )
    done = sum(int(p.get("rows", 0)) for p in manifest.get("parts", []))
    return f"resumes: {done} of {dataset.num_rows} rows done"


def status(path: str | Path) -> str:
    return read_status(Path(path))


# -- run ------------------------------------------------------------------------------------------

# The n output rows (dicts keyed by output column) of one input row: what the writer commits
# whole, and what a Ray worker hands back to the driver.
RowGroup = list[dict[str, Any]]


@dataclass(frozen=True)
class EncodedRow:
    """An input row with its prompt's token ids, or (``tokens`` None) why it cannot be generated.

    ``tokens`` is any sequence of ints (the Ray executor ships them as a compact array)."""

    row: InputRow
    tokens: Sequence[int] | None
    problem: str | None = None


@dataclass
class PendingRow:
    row: InputRow
    num_prompt_tokens: int
    samples: list[SampleResult | None]


@dataclass
class Totals:
    rows: int = 0
    samples: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    output_tokens: int = 0
    errors: int = 0

    def add(self, group: RowGroup) -> None:
        """Count one finished input row (its n output rows)."""
        self.rows += 1
        self.samples += len(group)
        for r in group:
            self.prompt_tokens += r["num_prompt_tokens"]
            self.cached_prompt_tokens += r["num_cached_tokens"]
            self.output_tokens += r["num_output_tokens"]
            self.errors += r["finish_reason"] == FinishReason.ERROR.value

    def hit_rate(self) -> float:
        return self.cached_prompt_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass
class _Signals:
    """First SIGINT/SIGTERM: set ``stop`` (the loop stops admitting work, commits what has finished
    and writes the report). Second: exit 130 at once, without waiting for that."""

    stop: bool = False
    received: int | None = None  # the number of the first signal
    previous: dict[int, Any] = field(default_factory=dict)

    def install(self) -> None:
        try:
            for sig in (signal.SIGINT, signal.SIGTERM):
                self.previous[sig] = signal.signal(sig, self._handle)
        except ValueError:  # not the main thread: signals stay as they are
            self.restore()

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            # None: the handler was not set from Python; the default is the closest we have.
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)
        self.previous.clear()

    def _handle(self, signum: int, frame: Any) -> None:
        if self.stop:
            self.exit_now()
        self.stop = True
        self.received = signum

    @staticmethod
    def exit_now() -> None:
        """Exit 130 at once. This loses nothing a SIGKILL would not: committed parts and the
        manifest are only ever replaced by rename, and the next run removes a half-done commit.
        (A KeyboardInterrupt could be swallowed by a library's broad ``except``.)"""
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        os.write(2, b"\ninterrupted again: stopped at once; rows committed so far are kept\n")
        os._exit(130)


class PromptEncoder:
    """Input rows -> token ids (plain prompts, or chat messages through the chat template), or
    the reason a row cannot be generated. Prompt length against max_model_len is checked later,
    by the :class:`RowGenerator` that knows its KV cache."""

    def __init__(self, job: Job, tokenizer: Any) -> None:
        self.job = job
        self.tokenizer = tokenizer

    def encode(self, rows: list[InputRow]) -> list[EncodedRow]:
        out: list[EncodedRow] = []
        plain = [r for r in rows if r.messages is None and r.prompt]
        encoded: dict[int, list[int]] = {}
        if plain:
            try:
                ids = self.tokenizer([r.prompt for r in plain], add_special_tokens=True)[
                    "input_ids"
                ]
                encoded = {id(r): list(t) for r, t in zip(plain, ids, strict=True)}
            except Exception:  # noqa: BLE001 - fall back to rows one by one to name the culprit
                encoded = {}
        column = self.job.input.messages_column or self.job.input.prompt_column
        for r in rows:
            try:
                if r.problem is not None:
                    raise RowProblem(r.problem)
                if self.job.input.messages_column is not None:
                    tokens = self._render_messages(r, column)
                elif r.prompt is None:
                    raise RowProblem(f"{column} is null")
                elif r.prompt == "":
                    raise RowProblem(f"{column} is empty")
                elif id(r) in encoded:
                    tokens = encoded[id(r)]
                else:
                    tokens = list(self.tokenizer(r.prompt, add_special_tokens=True)["input_ids"])
                if not tokens:
                    raise RowProblem("the prompt encodes to zero tokens")
                out.append(EncodedRow(r, tokens))
            except RowProblem as e:
                out.append(EncodedRow(r, None, str(e)))
            except Exception as e:  # noqa: BLE001 - a tokenizer failure is the row's problem
                problem = RowProblem.of("the tokenizer cannot encode the prompt", e)
                out.append(EncodedRow(r, None, str(problem)))
        return out

    def _render_messages(self, row: InputRow, column: str) -> list[int]:
        messages = row.messages
        if messages is None:
            raise RowProblem(f"{column} is null")
        if not messages:
            raise RowProblem(f"{column} is empty")
        for i, m in enumerate(messages):
            if m is None:
                raise RowProblem(f"{column}[{i}] is null")
            if not isinstance(m, dict):
                raise RowProblem(f"{column}[{i}] is not a {{role, content}} message")
            for key in ("role", "content"):
                if m.get(key) is None:
                    raise RowProblem(f"{column}[{i}].{key} is null")
                if not isinstance(m[key], str):
                    raise RowProblem(f"{column}[{i}].{key} is not a string")
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
        except Exception as e:  # noqa: BLE001 - a template that rejects the row (raise_exception)
            raise RowProblem.of(f"the chat template cannot render {column}", e) from e
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])


def _base_row(row: InputRow, sample_index: int) -> dict[str, Any]:
    out: dict[str, Any] = {"id": row.id, "sample_index": sample_index}
    out.update(row.keep)
    return out


def error_group(row: InputRow, problem: str, params: SamplingParams) -> RowGroup:
    """The n ``error`` output rows of an input row that cannot be generated."""
    rows = []
    for k in range(params.n):
        r = _base_row(row, k)
        r.update(
            text="",
            token_ids=[],
            finish_reason=FinishReason.ERROR.value,
            error=problem,
            num_prompt_tokens=0,
            num_cached_tokens=0,
            num_output_tokens=0,
        )
        if params.logprobs:
            r.update(cumulative_logprob=None, token_logprobs=None)
        rows.append(r)
    return rows


class RowGenerator:
    """One engine on one model: encoded rows in, finished input rows out (all n output rows of a
    row at once, as :data:`RowGroup`). The local executor runs one in the job's process; each
    Ray worker runs one of its own.

    Usage: :meth:`feed` rows (rows that cannot run come back at once as error groups), then
    :meth:`step` while :meth:`has_work`; each step returns the rows that finished in it.
    """

    def __init__(self, job: Job, info: ModelInfo, place: Placement, tokenizer: Any) -> None:
        self.job = job
        self.info = info
        self.place = place
        self.tokenizer = tokenizer
        self.params = sampling_params(job)
        self.pending: dict[int, PendingRow] = {}
        self.next_handle = 0
        attention = make_attention_backend(place.backend)
        if place.device.type == "cpu":
            keep_freed_memory()  # step activations reuse mapped pages instead of faulting anew
        model, _ = load_model(job.model, place.device, place.dtype, attention)
        num_blocks = plan_num_blocks(job, info, place)
        self.max_model_len = max_model_len(job, info, num_blocks)
        eng = job.engine
        self.engine = Engine(
            model,
            info,
            EngineConfig(
                block_size=eng.block_size,
                num_blocks=num_blocks,
                max_num_seqs=eng.max_num_seqs,
                max_num_batched_tokens=eng.max_num_batched_tokens,
                max_model_len=self.max_model_len,
                prefix_caching=eng.prefix_caching,
                attention_backend=place.backend,
            ),
            device=place.device,
            dtype=place.dtype,
            detokenize=self._decode if self.params.stop else None,
        )

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def has_work(self) -> bool:
        return self.engine.has_work()

    @property
    def num_waiting_targets(self) -> int:
        return self.engine.num_waiting_targets

    def _too_long(self, num_tokens: int) -> str:
        # When the KV cache, not the model or engine.max_model_len, sets the limit, say so.
        eng = self.job.engine
        limits = [self.info.max_model_len, eng.max_model_len or self.info.max_model_len]
        knob = "kv_cache_blocks" if eng.kv_cache_blocks is not None else "kv_cache_memory"
        cause = (
            f" (all the KV cache holds; raise engine.{knob})"
            if self.max_model_len < min(limits)
            else ""
        )
        return (
            f"prompt has {num_tokens} tokens; max_model_len is {self.max_model_len}{cause}, "
            "which leaves no room for output"
        )

    def feed(self, encoded: Sequence[EncodedRow]) -> list[RowGroup]:
        """Queue rows: the rest become requests in depth-first trie order, identical prompts
        folded into one request. Returns the error groups of rows that cannot run."""
        errors: list[RowGroup] = []
        groups: dict[tuple[int, ...], list[SampleTarget]] = {}
        n = self.params.n
        for item in encoded:
            row, tokens = item.row, item.tokens
            handle = self.next_handle
            self.next_handle += 1
            if tokens is None:
                errors.append(error_group(row, item.problem or "unknown error", self.params))
                continue
            if len(tokens) >= self.max_model_len:
                errors.append(error_group(row, self._too_long(len(tokens)), self.params))
                continue
            self.pending[handle] = PendingRow(row, len(tokens), [None] * n)
            targets = groups.setdefault(tuple(tokens), [])
            for k in range(n):
                targets.append(SampleTarget(handle, k, rng_key(self.params.seed, row.id, k)))
        for tokens in sorted(groups):
            self.engine.add(Request(tokens, self.params, tuple(groups[tokens])))
        return errors

    def step(self) -> list[RowGroup]:
        """One engine step; the input rows whose every sample has finished."""
        done: list[RowGroup] = []
        for res in self.engine.step():
            pending = self.pending[res.target.row]
            pending.samples[res.target.sample_index] = res
            if all(s is not None for s in pending.samples):
                del self.pending[res.target.row]
                done.append(self._group(pending))
        return done

    def _text(self, res: SampleResult) -> str:
        if res.text is not None:
            return res.text
        ids = res.token_ids
        if res.finish_reason == FinishReason.STOP and ids and ids[-1] in self.params.stop_token_ids:
            ids = ids[:-1]
        return self._decode(ids)

    def _group(self, pending: PendingRow) -> RowGroup:
        rows = []
        for res in pending.samples:
            assert res is not None
            r = _base_row(pending.row, res.target.sample_index)
            r.update(
                text=self._text(res),
                token_ids=res.token_ids,
                finish_reason=res.finish_reason.value,
                error=None,
                num_prompt_tokens=res.num_prompt_tokens,
                num_cached_tokens=res.num_cached_tokens,
                num_output_tokens=len(res.token_ids),
            )
            if self.params.logprobs:
                lps = res.token_logprobs or []
                r.update(cumulative_logprob=float(math.fsum(lps)), token_logprobs=lps)
            rows.append(r)
        return rows

    def report(self) -> dict[str, Any]:
        """The engine's figures for ``_report.json``."""
        stats = self.engine.stats
        scheduler = self.engine.scheduler
        return {
            "preemptions": scheduler.num_preemptions,
            "kv_blocks": self.engine.config.num_blocks,
            "kv_block_size": self.engine.config.block_size,
            "peak_kv_blocks_used": scheduler.peak_blocks_used,
            "evicted_kv_blocks": scheduler.num_evicted_blocks,
            "kv_waste": round(stats.waste, 4),
            "engine_steps": stats.steps,
            "device": str(self.place.device),
            "dtype": str(self.place.dtype).removeprefix("torch."),
            "attention_backend": self.place.backend,
            # the C kernels of batchgen.model.cpu_kernels ran (CPU, fp32, a compiler was found)
            "cpu_kernels": cpu_kernels.for_dtype(self.place.device, self.place.dtype) is not None,
        }


class JobRun:
    """State of one `batchgen run`: the output folder and its writer, the totals, and the
    executor: a :class:`RowGenerator` in this process (``executor.kind: local``) or a
    :class:`~batchgen.ray_executor.RayDriver` over Ray workers (``kind: ray``)."""

    def __init__(self, job: Job, fresh: bool, quiet: bool) -> None:
        self.job = job
        self.quiet = quiet
        self.info = read_model_info(job.model)
        self.dataset = InputDataset(job.input)
        self.driver: Any = None  # the RayDriver with executor.kind: ray
        # Settings that can still fail are checked before the output folder is touched (the
        # number of KV blocks is planned again once the model is loaded and memory is known).
        # With Ray, each worker checks its own placement when it starts.
        if job.executor.kind == "ray":
            _ray_executor()
        else:
            self.place = resolve_placement(job)
            plan_num_blocks(job, self.info, self.place)
        fp = fingerprint(job, model_identity(job.model), self.dataset.identity)
        self.folder = OutputFolder.open(job.output.path, fp, fresh)
        try:
            self._start(job)
        except BaseException:
            # Release the folder's lock now: a caller that keeps the exception (and with it this
            # half-built object) must not keep a later run on the same folder out.
            self._close_driver()
            self.folder.close()
            raise

    def _start(self, job: Job) -> None:
        """The rest of __init__, once the output folder is open and locked."""
        self.folder.set_total_rows(self.dataset.num_rows)
        self.done_ids = self.folder.completed_ids()
        self.totals = Totals()
        # Every row already committed (the fingerprint says they are this input's rows): there
        # is nothing to generate, so the tokenizer, the model and the engine are not loaded.
        self.nothing_to_do = len(self.done_ids) >= self.dataset.num_rows
        if self.nothing_to_do:
            return
        self.tokenizer = load_tokenizer(job.model)
        self.encoder = PromptEncoder(job, self.tokenizer)
        self.params = sampling_params(job)
        schema = output_schema(self.dataset.id_type, self.dataset.keep_fields, self.params.logprobs)
        # Checked before any model is loaded: results with other columns cannot be resumed.
        self.folder.check_schema(schema)
        if job.executor.kind == "ray":
            self.driver = _ray_executor().RayDriver(self)
        else:
            self.generator = RowGenerator(job, self.info, self.place, self.tokenizer)
        self.writer = self.folder.writer(schema, job.output.commit_rows, job.output.commit_seconds)

    def _close_driver(self) -> None:
        driver, self.driver = self.driver, None
        if driver is not None:
            driver.close()

    # -- feeding and results (the local executor) ---------------------------------------------

    def add(self, group: RowGroup) -> None:
        """Buffer one finished input row for the next commit."""
        self.writer.add_row_group(group)
        self.totals.add(group)

    def feed(self, rows: list[InputRow]) -> None:
        """Queue one window of rows: error rows are written at once, the rest become requests in
        depth-first trie order, identical prompts folded into one request."""
        for group in self.generator.feed(self.encoder.encode(rows)):
            self.add(group)

    def windows(self, window_rows: int | None = None) -> Iterator[list[InputRow]]:
        return self.dataset.iter_windows(
            window_rows or self.job.input.window_rows, skip_ids=self.done_ids
        )

    # -- the loop -----------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        """Generate the missing rows; commit as rows finish; write the report.

        The first SIGINT/SIGTERM stops admitting work: rows already finished are committed, the
        report is written (``finished: false``) and :class:`Interrupted` is raised. A second one
        exits 130 at once; the commit protocol keeps the folder consistent anyway (the next run
        removes a half-done commit). The folder's lock is released on return.
        """
        signals = _Signals()
        signals.install()
        try:
            report = self._nothing_to_do() if self.nothing_to_do else self._generate(signals)
        finally:
            signals.restore()
            self._close_driver()
            self.folder.close()
        if not report["finished"]:
            interrupted = Interrupted(
                f"interrupted; {report['rows']} rows saved this run, {report['rows_done']} of "
                f"{report['rows_total']} in all; run it again to resume"
            )
            interrupted.signum = signals.received  # the CLI keeps exiting at once on another
            raise interrupted
        return report

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

    def _generate(self, signals: _Signals) -> dict[str, Any]:
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
            if self.driver is not None:
                complete = self.driver.run(signals, bar, start)
            else:
                complete = self._run_local(signals, bar, start)
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

    def _run_local(self, signals: _Signals, bar: tqdm, start: float) -> bool:
        """Feed windows to the engine in this process and step it; True when every row ran."""
        windows = self.windows()
        exhausted = False
        # Keep enough queued for full batches; read the next window only when the queue runs low.
        low_water = 2 * self.job.engine.max_num_seqs
        gen = self.generator
        while not signals.stop:
            while not exhausted and not signals.stop and gen.num_waiting_targets < low_water:
                window = next(windows, None)
                if window is None:
                    exhausted = True
                else:
                    rows_before = self.totals.rows
                    self.feed(window)
                    bar.update(self.totals.rows - rows_before)
            if signals.stop:
                break
            if not gen.has_work():
                return True  # every window was read and every request has finished
            rows_before = self.totals.rows
            for group in gen.step():
                self.add(group)
            bar.update(self.totals.rows - rows_before)
            elapsed = time.perf_counter() - start
            bar.set_postfix(
                tok_s=f"{gen.engine.stats.sampled_tokens / max(elapsed, 1e-9):.0f}",
                cache=f"{100 * self.totals.hit_rate():.0f}%",
                refresh=False,
            )
            self.writer.maybe_commit()
        return False

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
        if self.nothing_to_do:
            return report  # no engine was built
        if self.driver is not None:
            report.update(self.driver.report())
        else:
            report.update(self.generator.report())
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


class RowProblem(Exception):
    """Why one input row cannot be generated; it becomes an error row (``str`` is the
    ``error`` column: one line)."""

    MAX_CHARS = 500

    @classmethod
    def of(cls, what: str, err: BaseException) -> RowProblem:
        """``what: <err as one line>``, cut to a readable length."""
        detail = " ".join(str(err).split()) or type(err).__name__
        text = f"{what}: {detail}"
        if len(text) > cls.MAX_CHARS:
            text = text[: cls.MAX_CHARS - 3] + "..."
        return cls(text)


def run(job: Job, fresh: bool = False, quiet: bool = False) -> dict[str, Any]:
    return JobRun(job, fresh, quiet).run()
