"""Host memory for CPU runs: the allocator's settings, and zeroed buffers that cost nothing up front.

Every step allocates its activations afresh (tens of MB at a time on prefill steps). glibc's
malloc serves blocks that large with ``mmap`` and returns them to the kernel on ``free``, so the
next step's allocation faults in fresh, zero-filled pages again: on a prompt-heavy CPU job that
is over a million page faults and seconds of kernel time. :func:`keep_freed_memory` makes glibc
serve every block from its heap and never trim the heap, so later steps reuse pages that are
already mapped. The process keeps its peak footprint until it exits, which suits a batch job.

The KV cache is the other case: one large buffer, made once. From the heap, zeroing it faults its
pages in one at a time (1 GiB: 1.5-1.9 s on the benchmark's 2-core VM, about 6 us a page);
faulted in lazily during the run instead, the same faults land in the first steps (workload LS:
about 50,000 of them). :func:`mapped_zeros` maps it on its own with ``MAP_POPULATE``: the kernel
zero-fills every page in one call (1 GiB: 0.34 s there, once the VM has backed that memory) and
no step faults on it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import math
import mmap
import os
import sys

import torch

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1  # mallopt parameters (glibc's malloc.h)
_M_MMAP_THRESHOLD = -3
_LARGEST = 2**31 - 1  # mallopt takes an int
_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")
_done = False


def keep_freed_memory() -> bool:
    """Apply the settings once per process; True when they are in effect.

    A no-op (False) off Linux/glibc, and when the user tunes malloc through the environment
    (``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``, ``GLIBC_TUNABLES``): theirs win.
    """
    global _done
    if _done:
        return True
    if not sys.platform.startswith("linux") or any(v in os.environ for v in _ENV):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (e.g. musl has no mallopt)
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok = mallopt(_M_MMAP_THRESHOLD, _LARGEST) == 1 and mallopt(_M_TRIM_THRESHOLD, _LARGEST) == 1
    if not ok:
        log.debug("mallopt refused the settings; keeping the allocator's defaults")
    _done = ok
    return ok


def mapped_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A contiguous CPU tensor of zeros on an anonymous memory mapping of its own (page-aligned),
    its pages zero-filled by the kernel up front where ``MAP_POPULATE`` exists (Linux), else on
    first touch. The tensor keeps the mapping alive."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
    return torch.frombuffer(mmap.mmap(-1, nbytes, flags=flags), dtype=dtype).view(shape)
