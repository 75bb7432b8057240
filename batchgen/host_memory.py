"""Host memory allocator settings for CPU runs.

Every step allocates its activations afresh (tens of MB at a time on prefill steps). glibc's
malloc serves blocks that large with ``mmap`` and returns them to the kernel on ``free``, so the
next step's allocation faults in fresh, zero-filled pages again: on a prompt-heavy CPU job that
is over a million page faults and seconds of kernel time. :func:`keep_freed_memory` makes glibc
serve every block from its heap and never trim the heap, so later steps reuse pages that are
already mapped. The process keeps its peak footprint until it exits, which suits a batch job.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys

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
