"""Whether this CPU multiplies bf16 matrices natively: what ``engine.dtype: auto`` decides by.

CPUs with AMX (Intel Sapphire Rapids and later) or AVX512-BF16 (also AMD Zen 4 and later) run
bf16 GEMMs through oneDNN about three times faster than fp32 ones; CPUs without them emulate
bf16 and run it far slower than fp32. The answer comes from torch's own CPU checks (which for
AMX also ask the kernel for the tile state), else from the flags in ``/proc/cpuinfo``. It depends
on the machine only, never on timing, so the same machine always resolves ``auto`` the same way.

``BATCHGEN_CPU_ISA=avx2`` takes an AVX-512 CPU for an AVX2-only one (:func:`avx2_only`): no native
bf16 here, and the C kernels built without AVX-512 (:mod:`batchgen.model.cpu_kernels`). It is
how the AVX2 code paths and an AVX2 CPU's choices are run on an AVX-512 machine; the libraries
under torch take their own caps (``scripts/bench.py --cpu-isa avx2`` sets them all).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["ISA_ENV", "Bf16Support", "avx2_only", "bf16_support"]

log = logging.getLogger(__name__)

# the environment variable of the instruction-set cap, and the one cap it takes
ISA_ENV = "BATCHGEN_CPU_ISA"
_CAPS = ("avx2",)

# instruction set -> (torch's check, the /proc/cpuinfo flag)
_FEATURES = (
    ("AMX-BF16", "_is_amx_tile_supported", "amx_bf16"),
    ("AVX512-BF16", "_is_avx512_bf16_supported", "avx512_bf16"),
)


@dataclass(frozen=True)
class Bf16Support:
    """``native``: bf16 matrix instructions are usable here; ``features``: which of AMX-BF16 and
    AVX512-BF16 were found (empty when none)."""

    features: tuple[str, ...]

    @property
    def native(self) -> bool:
        return bool(self.features)

    def describe(self) -> str:
        """``"AMX-BF16, AVX512-BF16"`` or ``"no AMX-BF16 or AVX512-BF16"``."""
        if self.native:
            return ", ".join(self.features)
        return "no " + " or ".join(name for name, _, _ in _FEATURES)


def _cpuinfo_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return set()


def avx2_only() -> bool:
    """Whether ``BATCHGEN_CPU_ISA=avx2`` caps this process at AVX2 (read at each call; an unknown
    value is logged and ignored)."""
    value = os.environ.get(ISA_ENV, "").strip().lower()
    if value and value not in _CAPS:
        log.warning("%s=%r is not a cap this build knows (%s): ignored", ISA_ENV, value, *_CAPS)
    return value == "avx2"


def bf16_support() -> Bf16Support:
    """This CPU's bf16 matrix instructions (x86 only: other CPUs report none; none under the
    AVX2 cap)."""
    if avx2_only():
        return Bf16Support(())
    flags: set[str] | None = None
    found = []
    for name, torch_check, flag in _FEATURES:
        check: Callable[[], bool] | None = getattr(torch.cpu, torch_check, None)
        if check is not None:
            ok = bool(check())
        else:
            flags = _cpuinfo_flags() if flags is None else flags
            ok = flag in flags
        if ok:
            found.append(name)
    return Bf16Support(tuple(found))
