"""Small helpers shared by the kernel wrappers (argument checks, interpreter detection)."""

from __future__ import annotations

import torch
from triton.runtime.interpreter import InterpretedFunction


def is_interpreted(kernel: object) -> bool:
    """True when ``kernel`` was decorated under ``TRITON_INTERPRET=1`` (runs on the CPU).

    Triton decides this when the ``@triton.jit`` decorator runs, i.e. when the kernel module is
    imported, so the environment variable at call time is irrelevant.
    """
    return isinstance(kernel, InterpretedFunction)


def check_launchable(kernel: object, tensor: torch.Tensor) -> None:
    """Fail clearly instead of with Triton's "0 active drivers" when no backend can run ``kernel``."""
    if tensor.device.type == "cpu" and not is_interpreted(kernel):
        raise RuntimeError(
            "Triton kernels need a GPU; for CPU tensors set TRITON_INTERPRET=1 before importing "
            "batchgen.kernels (tests/conftest.py does this)"
        )


def check_same_device(*tensors: torch.Tensor) -> None:
    """All kernel arguments must live on one device."""
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise ValueError(f"kernel arguments are on different devices: {sorted(map(str, devices))}")
