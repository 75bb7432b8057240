"""Host <-> device copies of each step's small tensors through reused buffers.

Uploads. A step needs about seven small integer tensors (token ids, positions, slots, block
tables, ...) and the sampler a few more. Made one by one from Python lists they cost as many
pageable copies, and on CUDA a pageable copy waits for the stream to drain (it cannot overlap
the previous step). Here each dtype's lists are packed into one host buffer and uploaded with one
copy. On CUDA the buffers are pinned and the copies asynchronous; each dtype has a small ring of
buffers, and an event per buffer keeps the host from rewriting it before its previous copy has
run (with ``_RING`` buffers that copy is a step or two old: the wait is free).

Readback. The sampled tokens (and logprobs) of a step come back through two pinned buffer pairs
used in turn (``Readback``): the copy of step N+1 is queued while the host still reads step N's,
and an event per copy says when it has landed. On a CPU the tensors are read directly.
"""

from __future__ import annotations

import itertools
from array import array
from collections.abc import Sequence

import torch

__all__ = ["PendingReadback", "Readback", "Staging"]

_TYPECODE = {torch.int64: "q", torch.int32: "i", torch.float32: "f"}
_RING = 8  # upload buffers per dtype on CUDA (a step makes up to three int64 uploads)


def _pinned(dtype: torch.dtype, numel: int, old: torch.Tensor | None) -> torch.Tensor:
    """``old`` if it holds ``numel``, else a larger pinned buffer (grows by powers of two)."""
    if old is not None and old.numel() >= numel:
        return old
    size = 1 << max(12, (numel - 1).bit_length())
    return torch.empty(size, dtype=dtype, pin_memory=True)


class Staging:
    """Reusable upload buffers for one engine's device (one instance per engine)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pinned = device.type == "cuda"
        # dtype -> ring of (host buffer, event of its last copy or None)
        self._ring: dict[torch.dtype, list[tuple[torch.Tensor | None, torch.cuda.Event | None]]]
        self._ring = {}
        self._turn: dict[torch.dtype, int] = {}

    def upload(self, dtype: torch.dtype, parts: Sequence[Sequence[float]]) -> list[torch.Tensor]:
        """``parts`` (lists of numbers) as 1-D ``dtype`` tensors on the device, in one copy."""
        lengths = [len(p) for p in parts]
        total = sum(lengths)
        flat = array(_TYPECODE[dtype], itertools.chain.from_iterable(parts))
        if not self.pinned:  # a CPU engine: fresh tensors (views of a reused buffer would alias)
            packed = (
                torch.frombuffer(flat, dtype=dtype).clone()
                if total
                else torch.empty(0, dtype=dtype)
            )
        else:
            ring = self._ring.setdefault(dtype, [(None, None)] * _RING)
            turn = self._turn.get(dtype, 0)
            self._turn[dtype] = (turn + 1) % _RING
            host, done = ring[turn]
            if done is not None:
                done.synchronize()  # the previous upload from this buffer has been read
            host = _pinned(dtype, total, host)
            if total:
                host[:total].copy_(torch.frombuffer(flat, dtype=dtype))
            packed = host[:total].to(self.device, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            ring[turn] = (host, event)
        return list(packed.split(lengths))


class PendingReadback:
    """One step's sampled tokens (and logprobs) on their way to the host."""

    def __init__(
        self,
        tokens: torch.Tensor,
        logprobs: torch.Tensor | None,
        event: torch.cuda.Event | None,
        slot: list[bool] | None,
    ) -> None:
        self._tokens = tokens  # [S] int64, on the host (pinned) or on a CPU device
        self._logprobs = logprobs  # [S] float32 or None
        self._event = event
        self._slot = slot  # the Readback slot's busy flag, cleared once read

    def result(self) -> tuple[list[int], list[float] | None]:
        """The tokens and logprobs as lists (waits for the copy; call once)."""
        if self._event is not None:
            self._event.synchronize()
        tokens = self._tokens.tolist()
        logprobs = self._logprobs.tolist() if self._logprobs is not None else None
        if self._slot is not None:
            self._slot[0] = False
        return tokens, logprobs


class Readback:
    """Device-to-host copies of the sampled tokens of each step, read a step later (see the
    module docstring). At most two may be pending at once."""

    def __init__(self, device: torch.device) -> None:
        self.pinned = device.type == "cuda"
        # per slot: [busy], int64 token buffer, float32 logprob buffer
        self._busy = [[False], [False]]
        self._tokens: list[torch.Tensor | None] = [None, None]
        self._logprobs: list[torch.Tensor | None] = [None, None]
        self._turn = 0

    def start(self, tokens: torch.Tensor, logprobs: torch.Tensor | None) -> PendingReadback:
        """Queue the copies of ``tokens`` ([S] int64) and ``logprobs`` ([S] float32 or None)."""
        if not self.pinned:
            return PendingReadback(tokens, logprobs, None, None)
        slot = self._turn
        self._turn ^= 1
        assert not self._busy[slot][0], "a third readback while two are pending"
        n = tokens.shape[0]
        host_t = self._tokens[slot] = _pinned(torch.int64, n, self._tokens[slot])
        host_t[:n].copy_(tokens, non_blocking=True)
        host_lp = None
        if logprobs is not None:
            host_lp = self._logprobs[slot] = _pinned(torch.float32, n, self._logprobs[slot])
            host_lp[:n].copy_(logprobs, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._busy[slot][0] = True
        return PendingReadback(
            host_t[:n], host_lp[:n] if host_lp is not None else None, event, self._busy[slot]
        )
