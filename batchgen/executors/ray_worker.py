"""The body of a Ray actor of ``executor.kind: ray``: one engine on one model (a
:class:`~batchgen.executors.local.RowGenerator`), running the shards the driver sends and
streaming finished input rows back in :class:`Delivery` s (see :mod:`batchgen.executors.ray`)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import ray

from batchgen.executors.local import RowGenerator
from batchgen.job import Job
from batchgen.model.hub import localize
from batchgen.model.loader import load_tokenizer
from batchgen.model.registry import read_model_info
from batchgen.plan import resolve_placement
from batchgen.prompts import EncodedRow
from batchgen.schema import RowGroup

# A worker hands back finished rows at least this often (for the progress bar).
DELIVERY_SECONDS = 1.0
# A worker pauses when this many of its deliveries wait unread by the driver: the rows in flight
# stay bounded, and a worker never runs a whole shard ahead of what the driver has seen.
DELIVERIES_AHEAD = 4


@dataclass
class Delivery:
    """What a worker streams back: finished input rows and its engine's figures since the last
    delivery (``peak_kv_blocks_used`` is a level, not a delta)."""

    groups: list[RowGroup]
    stats: dict[str, float]
    pid: int


class Worker:
    """The body of a Ray actor: one :class:`RowGenerator`, loaded on first use (so a restarted
    actor, whose constructor Ray runs again, loads its model when work arrives)."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self.generator: RowGenerator | None = None
        self.reported: dict[str, int] = {}

    def pid(self) -> int:
        return os.getpid()

    def load(self) -> dict[str, Any]:
        """Load the model and build the engine (once); where and how it runs."""
        if self.generator is None:
            # The driver's model folder, or (no shared filesystem) the same hub commit from
            # this node's Hugging Face cache.
            job = self.job.model_copy(update={"model": localize(self.job.model)})
            info = read_model_info(job.model)
            self.generator = RowGenerator(
                job, info, resolve_placement(job), load_tokenizer(job.model)
            )
        report = self.generator.report()
        return {
            "pid": os.getpid(),
            "node": ray.util.get_node_ip_address(),
            "max_model_len": self.generator.max_model_len,
            **{
                k: report[k]
                for k in (
                    "device",
                    "dtype",
                    "kv_cache_dtype",
                    "attention_backend",
                    "cpu_kernels",
                    "kv_blocks",
                    "kv_block_size",
                )
            },
        }

    @ray.method(_generator_backpressure_num_objects=DELIVERIES_AHEAD)
    def run(
        self,
        shard: list[EncodedRow],
        only: frozenset[Any] | None,
        commit_rows: int,
        commit_seconds: float,
    ) -> Iterator[Delivery]:
        """Generate the rows of ``shard`` (those with ids in ``only``, when given) and yield
        them in deliveries of about ``commit_rows`` output rows, or every ``commit_seconds`` (at
        most :data:`DELIVERY_SECONDS`)."""
        self.load()
        gen = self.generator
        assert gen is not None
        rows = shard if only is None else [e for e in shard if e.row.id in only]
        buffer = gen.feed(rows)
        last = time.monotonic()
        every = min(commit_seconds, DELIVERY_SECONDS)
        while gen.has_work():
            buffer += gen.step()
            samples = sum(len(g) for g in buffer)
            if buffer and (samples >= commit_rows or time.monotonic() - last >= every):
                yield Delivery(buffer, self._stats(), os.getpid())
                buffer = []
                last = time.monotonic()
        yield Delivery(buffer, self._stats(), os.getpid())

    def _stats(self) -> dict[str, float]:
        assert self.generator is not None
        engine = self.generator.engine
        now = {
            "engine_steps": engine.stats.steps,
            "sampled_tokens": engine.stats.sampled_tokens,
            "preemptions": engine.scheduler.num_preemptions,
            "evicted_kv_blocks": engine.scheduler.num_evicted_blocks,
            "constrained_samples": engine.stats.constrained_samples,
            "complete_samples": engine.stats.complete_samples,
            "mask_s": engine.stats.mask_seconds,
            "overlapped_steps": engine.stats.overlapped_steps,
            "discarded_tokens": engine.stats.discarded_tokens,
        }
        delta = {k: v - self.reported.get(k, 0) for k, v in now.items()}
        self.reported = now
        delta["peak_kv_blocks_used"] = engine.scheduler.peak_blocks_used
        return delta
