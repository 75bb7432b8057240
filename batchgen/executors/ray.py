"""``executor.kind: ray``: one job on many engines, as Ray actors, with the local contract.

The process that runs ``batchgen run`` is the *driver*. It alone reads the input and writes the
output folder; the *workers* (Ray actors, one engine each) only generate.

- **Plan.** The driver's job loop reads the input in rounds of ``window_rows`` rows per worker
  and tokenizes them; :mod:`batchgen.executors.sharding` groups the rows of a round by the leading
  blocks of their prompts and assigns the groups to workers.
- **Run.** Each worker runs a :class:`~batchgen.executors.local.RowGenerator` (the local executor's model
  loading, engine, feeding and result rows) over its shard, and streams finished input rows (all
  n samples of a row) back in deliveries, about every ``output.commit_rows`` / ``commit_seconds``,
  through a Ray generator (at least every second, for the progress bar), pausing while
  ``DELIVERIES_AHEAD`` of its deliveries wait unread by the driver. Shards travel through
  Ray's object store; each worker keeps one shard queued behind the one it runs, so it does not
  wait for the driver between shards.
- **Write.** The job loop hands the rows to the same :class:`~batchgen.results.PartWriter` as a
  local run, so the commit protocol and its guarantees are unchanged: a row is in the output iff
  a committed part lists it, and a resumed run (with any executor) skips committed ids.
- **Faults.** Actors are created with ``max_restarts`` (Ray restarts a worker process that died;
  the new process loads its model again) and ``max_task_retries=0``: Ray would replay a failed
  generator from the start and expects the same deliveries, which time-cut deliveries are not. Instead
  the driver resubmits the shard (still in the object store) with the ids it has not received
  yet; a row it already holds is never accepted again. A worker that dies while it loads its
  model loads it again once restarted. A worker that is dead for good (restarts
  used up) passes its shards to the least-loaded live worker. If the driver dies, its actors die
  with it (Ray ends the actors of a dead owner); the next ``batchgen run`` resumes from the
  committed parts, exactly once.

Results equal the local executor's: a sample's random stream comes from (seed, id,
sample_index) (:func:`batchgen.engine.noise.rng_key`), never from its worker or neighbours.
"""

from __future__ import annotations

import array
import contextlib
import logging
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import (
    ActorDiedError,
    ActorUnavailableError,
    NodeDiedError,
    RayActorError,
    RayTaskError,
    WorkerCrashedError,
)

from batchgen.errors import BatchgenError, JobError
from batchgen.executors.ray_worker import Delivery, Worker
from batchgen.executors.sharding import Planner, PrefixGroup, common_prefix
from batchgen.fingerprint import numerics
from batchgen.job import ExecutorConfig, Job
from batchgen.prompts import EncodedRow
from batchgen.schema import RowGroup, Totals

QUEUED_SHARDS = 2  # a new round is planned when a worker holds fewer shards (running + queued)
REPORTED_GROUPS = 100  # prefix groups listed per worker in the report (all are counted)
PREVIEW_CHARS = 60
# ActorUnavailableError (a RayActorError in current Ray, named for clarity) is what a call gets
# while Ray restarts the actor: a restart in progress, not a lost worker.
WORKER_LOST = (RayActorError, ActorUnavailableError, WorkerCrashedError, NodeDiedError)


# -- the driver -----------------------------------------------------------------------------------


@dataclass(eq=False)
class _Slot:
    """The driver's view of one worker."""

    index: int
    handle: Any
    info: dict[str, Any]
    alive: bool = True
    pids: list[int] = field(default_factory=list)  # its processes so far (a restart adds one)
    rerun_rows: int = 0  # rows resubmitted after a worker died
    queued: int = 0  # shards submitted and not finished
    outstanding: int = 0  # cost of the rows assigned and not received
    totals: Totals = field(default_factory=Totals)
    stats: dict[str, float] = field(default_factory=dict)
    groups: list[dict[str, Any]] = field(default_factory=list)  # for the report
    num_groups: int = 0


@dataclass(eq=False)
class _Task:
    """One shard on one worker. ``remaining``: id -> cost of the rows not received yet; an id
    is in the ``remaining`` of one task at most, and leaves it when its row is accepted."""

    slot: _Slot
    shard: Any  # ObjectRef of list[EncodedRow]
    remaining: dict[Any, int]
    groups: list[dict[str, Any]]


def _unwrap(err: RayTaskError) -> BaseException:
    """A worker's own error: a BatchgenError (an invalid job: exit 2) as itself."""
    cause = getattr(err, "cause", None)
    return cause if isinstance(cause, BatchgenError) else err


class RayExecutor:
    """The :class:`~batchgen.executors.Executor` of ``executor.kind: ray`` (see the module's
    docstring).

    Construction connects to (or starts) Ray, starts the workers and waits until each has
    loaded its model; :meth:`close` ends the workers (and a Ray cluster started here)."""

    def __init__(self, job: Job, tokenizer: Any) -> None:
        self.job = job
        self.tokenizer = tokenizer
        self.config: ExecutorConfig = job.executor
        self._ready: list[RowGroup] = []  # rows received, handed out by poll
        self.started_ray = False
        self.slots: list[_Slot] = []
        self.planner = Planner(job.engine.block_size, job.sampling.n, job.sampling.max_tokens)
        self.tasks: dict[Any, _Task] = {}  # ObjectRefGenerator -> task
        try:
            self._connect()
            num_workers, num_gpus = self._workers()
            actor = ray.remote(Worker).options(
                num_cpus=self.config.num_cpus,
                num_gpus=num_gpus,
                max_restarts=self.config.max_restarts,
                max_task_retries=0,
            )
            handles = [actor.remote(job) for _ in range(num_workers)]
            self.slots = [_Slot(i, h, {}) for i, h in enumerate(handles)]
            self._load_all()
        except BaseException:
            self.close()
            raise
        self.window_rows = job.input.window_rows * len(self.slots)

    def _connect(self) -> None:
        if ray.is_initialized():
            return  # e.g. a notebook or a test that started Ray: use it, leave it running
        address = self.config.address
        kwargs: dict[str, Any] = {"log_to_driver": False, "logging_level": logging.WARNING}
        if address is None:
            kwargs["include_dashboard"] = False
        try:
            ray.init(address=address, **kwargs)
        except Exception as err:  # noqa: BLE001 - ConnectionError, ValueError, ...
            where = "start a local Ray cluster" if address is None else f"connect to {address}"
            detail = " ".join(str(err).split())[:300]
            raise JobError(f"executor: cannot {where}: {detail}") from None
        self.started_ray = True

    def _workers(self) -> tuple[int, float]:
        """How many workers, and the GPUs of each."""
        ex = self.config
        res = ray.cluster_resources()
        gpus, cpus = float(res.get("GPU", 0)), float(res.get("CPU", 0))
        num_gpus = ex.num_gpus if ex.num_gpus is not None else (1.0 if gpus > 0 else 0.0)
        if ex.num_workers is not None:
            n = ex.num_workers
        elif num_gpus > 0:
            n = int(gpus // num_gpus)
        elif ex.num_cpus > 0:
            n = int(cpus // ex.num_cpus)
        else:
            raise JobError("executor.num_workers must be set when workers need no CPU and no GPU")
        if n < 1:
            raise JobError(
                f"executor: the Ray cluster has {gpus:g} GPUs and {cpus:g} CPUs, not enough for "
                f"one worker with num_gpus={num_gpus:g} and num_cpus={ex.num_cpus:g}"
            )
        if n * num_gpus > gpus or n * ex.num_cpus > cpus:
            print(
                f"batchgen: warning: {n} workers need {n * num_gpus:g} GPUs and "
                f"{n * ex.num_cpus:g} CPUs; the Ray cluster has {gpus:g} and {cpus:g} now: "
                "workers start as room appears",
                file=sys.stderr,
            )
        return n, num_gpus

    def _load_all(self) -> None:
        """Wait until every worker has loaded its model. A worker that dies meanwhile (its
        process killed while it loads) loads again once Ray has restarted it; one that is dead
        for good is left out while another one lives."""
        pending: dict[Any, _Slot] = {}
        for slot in self.slots:
            pid = self._restarted_pid(slot)  # its first process (a restart adds one)
            if pid is None:
                self._lost_while_loading(slot, "it did not start")
            else:
                self._seen(slot, pid)
                pending[self._submit_load(slot)] = slot
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1)
            slot = pending.pop(ready[0])
            try:
                info = self._get(ready[0])
            except WORKER_LOST as err:
                pid = self._restarted_pid(slot)
                if pid is None:
                    self._lost_while_loading(slot, " ".join(str(err).split())[:300])
                else:
                    self._seen(slot, pid)
                    pending[self._submit_load(slot)] = slot
                continue
            self._seen(slot, info["pid"])
            slot.info = info

    def _submit_load(self, slot: _Slot) -> Any:
        return slot.handle.load.remote()

    def _lost_while_loading(self, slot: _Slot, why: str) -> None:
        slot.alive = False
        if not any(s.alive for s in self.slots):
            raise RuntimeError(
                f"every Ray worker died while loading the model (each restarted up to "
                f"{self.config.max_restarts} times; the last error: {why})"
            )

    def _get(self, refs: Any) -> Any:
        try:
            return ray.get(refs)
        except RayTaskError as err:
            raise _unwrap(err) from None

    # -- the loop -----------------------------------------------------------------------------

    def has_work(self) -> bool:
        return bool(self.tasks) or bool(self._ready)

    def poll(self) -> list[RowGroup]:
        ready, _ = ray.wait(list(self.tasks), num_returns=1, timeout=0.2)
        for gen in ready:
            self._advance(gen)
        done, self._ready = self._ready, []
        return done

    def numerics(self) -> str:
        dtypes = sorted({s.info["dtype"] for s in self.slots if s.alive})
        if len(dtypes) > 1:
            raise JobError(
                f"executor: the Ray workers run in {' and '.join(dtypes)} (engine.dtype "
                f"{self.job.engine.dtype}); one job runs in one dtype: set engine.dtype"
            )
        kv = {s.info.get("kv_cache_dtype", dtypes[0]) for s in self.slots if s.alive}
        return numerics(dtypes[0], kv.pop() if len(kv) == 1 else None)

    def sampled_tokens(self) -> int:
        return sum(s.stats.get("sampled_tokens", 0) for s in self.slots)

    def wants_work(self) -> bool:
        """A live worker would soon run dry (and the shards in flight stay bounded, also when a
        round has fewer prefix groups than there are workers)."""
        live = [s for s in self.slots if s.alive]
        return any(s.queued < QUEUED_SHARDS for s in live) and sum(
            s.queued for s in live
        ) < QUEUED_SHARDS * len(live)

    def submit(self, rows: Sequence[EncodedRow]) -> None:
        # Tokens travel as compact arrays through Ray's object store.
        runnable = [
            EncodedRow(r.row, array.array("i", r.tokens), schema=r.schema) for r in rows if r.tokens
        ]
        if not runnable:
            return
        live = {s.index: s for s in self.slots if s.alive}
        load = {i: s.outstanding for i, s in live.items()}
        for index, groups in self.planner.plan(runnable, load).items():
            if not groups:
                continue
            slot = live[index]
            rows = [r for g in groups for r in g.rows]
            remaining = {r.row.id: self.planner.cost(r) for r in rows}
            text = len(slot.groups) < REPORTED_GROUPS  # decode only what the report shows
            entries = [self._entry(g, text) for g in groups]
            task = _Task(slot, ray.put(rows), remaining, entries)
            self._assign(task, slot)
            self._launch(task, only=None)

    def _entry(self, group: PrefixGroup, text: bool) -> dict[str, Any]:
        """A prefix group as the report lists it: its first row (in input order), its size, and
        the prompt tokens all its rows share (at least its key), with the start of their text."""
        shared = common_prefix([r.tokens for r in group.rows])  # type: ignore[misc]
        entry: dict[str, Any] = {
            "first_id": group.rows[0].row.id,
            "rows": len(group.rows),
            "shared_prefix_tokens": len(shared),
        }
        if len(shared) and text:
            decoded = self.tokenizer.decode(list(shared), skip_special_tokens=True)
            entry["shared_prefix"] = decoded[:PREVIEW_CHARS]
        return entry

    def _assign(self, task: _Task, slot: _Slot) -> None:
        task.slot = slot
        slot.outstanding += sum(task.remaining.values())
        slot.num_groups += len(task.groups)
        room = REPORTED_GROUPS - len(slot.groups)
        slot.groups += task.groups[: max(room, 0)]

    def _launch(self, task: _Task, only: frozenset[Any] | None) -> None:
        out = self.job.output
        gen = task.slot.handle.run.remote(task.shard, only, out.commit_rows, out.commit_seconds)
        self.tasks[gen] = task
        task.slot.queued += 1

    def _advance(self, gen: Any) -> None:
        """Take the next delivery of one ready shard; handle its end or its worker's death."""
        task = self.tasks[gen]
        try:
            delivery = ray.get(next(gen))
        except StopIteration:
            self._finish(gen)
            if task.remaining:
                raise RuntimeError(
                    f"Ray worker {task.slot.index} ended a shard without "
                    f"{len(task.remaining)} of its rows"
                ) from None
            return
        except WORKER_LOST as err:
            self._finish(gen)
            self._recover(task, err)
            return
        except RayTaskError as err:
            raise _unwrap(err) from None
        self._receive(task, delivery)

    def _finish(self, gen: Any) -> None:
        task = self.tasks.pop(gen)
        task.slot.queued -= 1

    def _receive(self, task: _Task, delivery: Delivery) -> None:
        slot = task.slot
        self._seen(slot, delivery.pid)
        for group in delivery.groups:
            cost = task.remaining.pop(group[0]["id"], None)
            if cost is None:
                continue  # already accepted (a resubmitted shard raced its first run): not twice
            slot.outstanding -= cost
            self._ready.append(group)
            slot.totals.add(group)
        for key, value in delivery.stats.items():
            if key == "peak_kv_blocks_used":
                slot.stats[key] = max(slot.stats.get(key, 0), value)
            else:
                slot.stats[key] = slot.stats.get(key, 0) + value

    def _recover(self, task: _Task, err: Exception) -> None:
        """The worker of ``task`` died: once Ray has restarted it, run the rows it had not
        delivered there again; if it is dead for good, on the least-loaded live worker."""
        slot = task.slot
        pid = self._restarted_pid(slot)
        if pid is None:
            slot.alive = False
            live = [s for s in self.slots if s.alive]
            if not live:
                raise RuntimeError(
                    f"every Ray worker died (each restarted up to {self.config.max_restarts} "
                    f"times; the last error: {' '.join(str(err).split())[:300]})"
                ) from err
            slot.outstanding -= sum(task.remaining.values())
            slot.num_groups -= len(task.groups)
            moved = {id(g) for g in task.groups}
            slot.groups = [g for g in slot.groups if id(g) not in moved]
            target = min(live, key=lambda s: (s.outstanding, s.index))
            self._assign(task, target)
        else:
            self._seen(slot, pid)
        if task.remaining:
            task.slot.rerun_rows += len(task.remaining)
            self._launch(task, only=frozenset(task.remaining))

    @staticmethod
    def _seen(slot: _Slot, pid: int) -> None:
        """Note the worker's current process (a new one means Ray restarted it)."""
        if pid not in slot.pids:
            slot.pids.append(pid)
            slot.info["pid"] = pid

    def _restarted_pid(self, slot: _Slot) -> int | None:
        """The worker's process id once Ray has it running again; None if it is dead for good."""
        for _ in range(60):
            try:
                return ray.get(slot.handle.pid.remote(), timeout=10)
            except ActorDiedError:
                return None
            except (ActorUnavailableError, RayActorError, ray.exceptions.GetTimeoutError):
                time.sleep(0.5)  # restarting, or temporarily unreachable
        return None

    # -- end ----------------------------------------------------------------------------------

    def report(self) -> dict[str, Any]:
        """The executor's part of ``.batchgen/report.json``: sums over workers, and each worker's
        share."""
        workers = []
        for s in self.slots:
            t = s.totals
            workers.append(
                {
                    "worker": s.index,
                    **s.info,
                    "alive": s.alive,
                    "restarts": len(s.pids) - 1,
                    "rerun_rows": s.rerun_rows,
                    "rows": t.rows,
                    "samples": t.samples,
                    "prompt_tokens": t.prompt_tokens,
                    "cached_prompt_tokens": t.cached_prompt_tokens,
                    "output_tokens": t.output_tokens,
                    "errors": t.errors,
                    "engine_steps": s.stats.get("engine_steps", 0),
                    "overlapped_steps": s.stats.get("overlapped_steps", 0),
                    "discarded_tokens": s.stats.get("discarded_tokens", 0),
                    "preemptions": s.stats.get("preemptions", 0),
                    "evicted_kv_blocks": s.stats.get("evicted_kv_blocks", 0),
                    "peak_kv_blocks_used": s.stats.get("peak_kv_blocks_used", 0),
                    "groups": s.num_groups,
                    "prefix_groups": s.groups,
                }
            )

        def total(key: str) -> int:
            return sum(int(w[key]) for w in workers)

        structured = None
        if self.job.sampling.structured is not None or self.job.input.schema_column is not None:
            structured = {
                "constrained_samples": sum(
                    int(s.stats.get("constrained_samples", 0)) for s in self.slots
                ),
                "complete_samples": sum(
                    int(s.stats.get("complete_samples", 0)) for s in self.slots
                ),
                "mask_s": round(sum(s.stats.get("mask_s", 0.0) for s in self.slots), 4),
            }
        return {
            "structured": structured,
            "preemptions": total("preemptions"),
            "engine_steps": total("engine_steps"),
            "overlapped_steps": total("overlapped_steps"),
            "discarded_tokens": total("discarded_tokens"),
            "evicted_kv_blocks": total("evicted_kv_blocks"),
            "worker_restarts": total("restarts"),
            "num_workers": len(workers),
            "ray_address": self.config.address,
            "workers": workers,
        }

    def close(self) -> None:
        """End the workers (freeing their devices at once), and Ray if it was started here."""
        self.tasks.clear()
        for slot in self.slots:
            with contextlib.suppress(Exception):
                ray.kill(slot.handle, no_restart=True)
        if self.started_ray:
            self.started_ray = False
            with contextlib.suppress(Exception):
                ray.shutdown()


__all__ = ["RayExecutor", "Worker"]
