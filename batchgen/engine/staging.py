"""Host-to-device uploads of a step's integer tensors through reused staging buffers.

A step needs about seven small integer tensors (token ids, positions, slots, block tables, ...).
Made one by one from Python lists they cost seven pageable copies; here the int64 ones are packed
into one host buffer and the int32 ones into another, each uploaded with one copy. On CUDA the
buffers are pinned and the copies asynchronous; an event per buffer keeps the host from
rewriting it before its previous copy has run.
"""

from __future__ import annotations

import itertools
from array import array
from collections.abc import Sequence

import torch

__all__ = ["Staging"]

_TYPECODE = {torch.int64: "q", torch.int32: "i"}


class Staging:
    """Reusable upload buffers for one engine's device (one instance per engine)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pinned = device.type == "cuda"
        self._host: dict[torch.dtype, torch.Tensor] = {}
        self._copied: dict[torch.dtype, torch.cuda.Event] = {}

    def _buffer(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        buf = self._host.get(dtype)
        if buf is None or buf.numel() < numel:
            size = 1 << max(12, (numel - 1).bit_length())  # grows by powers of two
            buf = torch.empty(size, dtype=dtype, pin_memory=self.pinned)
            self._host[dtype] = buf
        return buf

    def upload(self, dtype: torch.dtype, parts: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """``parts`` (lists of ints) as 1-D ``dtype`` tensors on the device, in one copy."""
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
            done = self._copied.get(dtype)
            if done is not None:
                done.synchronize()  # the previous upload from this buffer has been read
            host = self._buffer(dtype, total)
            if total:
                host[:total].copy_(torch.frombuffer(flat, dtype=dtype))
            packed = host[:total].to(self.device, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._copied[dtype] = event
        return list(packed.split(lengths))
