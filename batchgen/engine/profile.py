"""Where a run's time goes, per phase of the engine's steps (``BATCHGEN_PROFILE=1``).

:class:`StepProfile` sums wall-clock seconds per phase. Phases are exclusive: time spent in a
phase opened inside another counts for the inner one only, so the phases of a step add up to the
step. The engine opens ``schedule``, ``build`` (block copies and the step's tensors), ``forward``
(the model, less the phases below), ``lm_head``, ``sample`` and ``complete`` (reading the tokens
back, stop checks, the scheduler's bookkeeping); :func:`instrument` opens ``gemm`` in every
linear layer, ``experts`` in a mixture of experts' expert compute and ``attention`` (and
``attention_plan``) in the attention backend, so ``forward`` keeps the other kernels (embedding,
norms, RoPE, SwiGLU, the KV store where attention does not do it). What the executor and the
runner do between steps (prompts in, rows out, Parquet) is the run's time less the steps'.

On a CPU every kernel runs on the calling thread, so wall-clock time per phase is the kernels'
time. On CUDA the profile synchronizes the device at each phase's end, which serializes what
overlap would hide: a CUDA profile says where the time goes, not how fast the run is.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

__all__ = ["NO_PROFILE", "NoProfile", "StepProfile", "instrument"]


class _Span:
    __slots__ = ("profile", "name")

    def __init__(self, profile: StepProfile, name: str) -> None:
        self.profile, self.name = profile, name

    def __enter__(self) -> None:
        self.profile._open()

    def __exit__(self, *exc: object) -> None:
        self.profile._close(self.name)


class _NoSpan:
    def __enter__(self) -> None:
        pass

    def __exit__(self, *exc: object) -> None:
        pass


class StepProfile:
    """Exclusive seconds and calls per phase. ``sync``: called before each clock read (CUDA:
    ``torch.cuda.synchronize``; None on a CPU)."""

    enabled = True

    def __init__(self, sync: Callable[[], None] | None = None) -> None:
        self.sync = sync
        # keyed by (step kind, phase); the kind is the engine's label of the running step
        self.seconds: dict[tuple[str, str], float] = {}
        self.calls: dict[tuple[str, str], int] = {}
        self.steps: dict[str, int] = {}
        self.kind = "step"
        # one [start, seconds of the phases inside] per open phase, innermost last
        self._stack: list[list[float]] = []

    def begin_step(self, kind: str) -> None:
        """The phases from here on belong to a step of ``kind`` (``decode``: every sequence
        adds one token; ``prefill``: some add more)."""
        self.kind = kind
        self.steps[kind] = self.steps.get(kind, 0) + 1

    def add(self, name: str, seconds: float) -> None:
        """``seconds`` measured by the caller, outside any open phase, for phase ``name``."""
        key = (self.kind, name)
        self.seconds[key] = self.seconds.get(key, 0.0) + seconds
        self.calls[key] = self.calls.get(key, 0) + 1

    def span(self, name: str) -> _Span:
        """A context manager timing phase ``name`` (re-entrant, nestable)."""
        return _Span(self, name)

    def _open(self) -> None:
        if self.sync is not None:
            self.sync()
        self._stack.append([time.perf_counter(), 0.0])

    def _close(self, name: str) -> None:
        if self.sync is not None:
            self.sync()
        start, inner = self._stack.pop()
        elapsed = time.perf_counter() - start
        key = (self.kind, name)
        self.seconds[key] = self.seconds.get(key, 0.0) + elapsed - inner
        self.calls[key] = self.calls.get(key, 0) + 1
        if self._stack:
            self._stack[-1][1] += elapsed

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` timed as phase ``name``."""

        def timed(*args: Any, **kwargs: Any) -> Any:
            with self.span(name):
                return fn(*args, **kwargs)

        return timed

    def summary(self) -> dict[str, Any]:
        """``{kind: {"steps": N, "phases": {phase: {"s": seconds, "calls": calls, "ms_per_step":
        ...}}}}`` per step kind, phases by time, largest first."""
        out: dict[str, Any] = {}
        for kind, steps in self.steps.items():
            mine = [(name, s) for (k, name), s in self.seconds.items() if k == kind]
            phases = {
                name: {
                    "s": round(s, 4),
                    "calls": self.calls[kind, name],
                    "ms_per_step": round(1000 * s / steps, 4),
                }
                for name, s in sorted(mine, key=lambda kv: -kv[1])
            }
            out[kind] = {"steps": steps, "phases": phases}
        return out


class NoProfile:
    """The profile of an unprofiled engine: spans that do nothing."""

    enabled = False
    _span = _NoSpan()

    def begin_step(self, kind: str) -> None:
        pass

    def span(self, name: str) -> _NoSpan:
        return self._span


NO_PROFILE = NoProfile()


def instrument(model: Any, attention: Any, profile: StepProfile) -> None:
    """Time ``model``'s linear layers but the LM head (``gemm``), expert compute (``experts``) and the attention
    backend ``attention`` (``attention``, ``attention_plan``) in ``profile``, by wrapping those
    objects' methods in place (the model's code is unchanged)."""
    import torch.nn as nn

    from batchgen.model.layers.linear import PackedLayer
    from batchgen.model.layers.moe import FusedExperts

    head = getattr(model, "lm_head", None)  # the engine times it as lm_head
    for module in model.modules():
        if module is head:
            continue
        if isinstance(module, nn.Linear | PackedLayer):
            module.forward = profile.wrap("gemm", module.forward)
            module.add_ = profile.wrap("gemm", module.add_)
        elif isinstance(module, FusedExperts):
            module.forward = profile.wrap("experts", module.forward)
    attention.forward = profile.wrap("attention", attention.forward)
    attention.prepare = profile.wrap("attention_plan", attention.prepare)
