"""Which device a test session runs on, decided once, before torch or Triton start.

A session is either a CPU session (the default, `make test`) or a GPU session
(``BATCHGEN_TEST_GPU=1``; scripts/gpu_check.sh starts one):

- CPU session: CUDA is hidden (``CUDA_VISIBLE_DEVICES=""``) and Triton runs under its interpreter
  (``TRITON_INTERPRET=1``), so ``device: auto`` means the CPU, exact-token checks see the numerics
  they were written for, and the Triton backend works on CPU tensors. Tests marked ``gpu`` skip.
- GPU session: Triton compiles for the GPU, so nothing may run Triton on CPU tensors; only tests
  marked ``gpu`` (need CUDA) or ``kernel`` (Triton kernels on :data:`KERNEL_DEVICE`, interpreted
  on the CPU or compiled on the GPU) run, the rest skip.

Triton decides interpreted or compiled when a ``@triton.jit`` decorator runs, so the two modes
cannot share a process.
"""

from __future__ import annotations

import os

GPU_ENV = "BATCHGEN_TEST_GPU"
GPU_SESSION = os.environ.get(GPU_ENV) == "1"


def configure_environment() -> None:
    """Set the variables of this session's mode; call before importing torch or triton."""
    if GPU_SESSION:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        os.environ["TRITON_INTERPRET"] = "1"


def kernel_device() -> str:
    """Where the ``kernel`` tests put their tensors: ``cuda`` in a GPU session, else ``cpu``."""
    return "cuda" if GPU_SESSION else "cpu"


def skip_reason(markers: set[str]) -> str | None:
    """Why a test with these marker names does not run in this session (None: it runs)."""
    if GPU_SESSION and not markers & {"gpu", "kernel"}:
        return f"CPU test: a GPU session ({GPU_ENV}=1) runs only tests marked gpu or kernel"
    if not GPU_SESSION and "gpu" in markers:
        return (
            f"needs a GPU session: {GPU_ENV}=1 on a CUDA machine (scripts/gpu_check.sh runs them)"
        )
    return None
