"""Running on a chosen CUDA device: Triton launches on the *current* device, so every step of an
engine on ``cuda:N`` runs inside a guard that makes ``cuda:N`` current."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["device_guard"]


@contextlib.contextmanager
def device_guard(device: torch.device) -> Iterator[None]:
    """Make ``device`` the current CUDA device for the block (restored after); a no-op for
    non-CUDA devices. ``cuda`` without an index means the current device and is left as it is."""
    if device.type != "cuda" or device.index is None:
        yield
        return
    with torch.cuda.device(device):
        yield
