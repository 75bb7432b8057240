"""The allocator setting for CPU runs: freed activations are reused without new page faults."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from batchgen import host_memory

# Allocate and fill a 64 MiB tensor 40 times (as every prefill step does with its activations);
# print the minor page faults that took.
_PROBE = """
import resource, sys, torch
from batchgen.host_memory import keep_freed_memory
applied = keep_freed_memory() if sys.argv[1] == "on" else False
torch.ones(1)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(40):
    x = torch.empty(16 << 20)
    x.fill_(1.0)
    del x
print(applied, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _probe(mode: str) -> tuple[bool, int]:
    env = {k: v for k, v in os.environ.items() if k not in host_memory._ENV}
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, env=env, check=True
    ).stdout.split()
    return out[0] == "True", int(out[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc settings")
def test_freed_activations_are_reused_without_page_faults() -> None:
    applied, faults_on = _probe("on")
    if not applied:
        pytest.skip("this libc has no mallopt (not glibc)")
    _, faults_off = _probe("off")
    pages = (64 << 20) // 4096
    assert faults_off >= 20 * pages  # glibc's default: fresh pages for every allocation
    # the heap grows over the first few allocations (5-8 times their pages here), then its pages
    # are reused: a fraction of the faults, however many allocations follow
    assert faults_on * 2 <= faults_off


def test_user_settings_in_the_environment_win(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(host_memory, "_done", False)
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "131072")
    assert host_memory.keep_freed_memory() is False
