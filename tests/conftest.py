"""Shared test setup.

Triton kernels run under Triton's CPU interpreter when no GPU is present; the variable must be set
before any module decorated with @triton.jit is imported, hence here at the top.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(min(2, torch.get_num_threads()))


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """``tiny_model(arch="llama", **kwargs) -> Path``: a random model + tokenizer, made once per
    distinct arguments in a session (see batchgen.tiny_model.make_tiny_model)."""
    from batchgen.tiny_model import make_tiny_model

    made: dict[tuple, object] = {}

    def make(arch: str = "llama", **kwargs):
        key = (arch, tuple(sorted(kwargs.items())))
        if key not in made:
            made[key] = make_tiny_model(tmp_path_factory.mktemp(f"model-{arch}"), arch, **kwargs)
        return made[key]

    return make


def pytest_terminal_summary(terminalreporter) -> None:
    """Which optional paths this session could run, and how many samples the near-tie
    comparison exempted (tests/ties.py)."""
    from tests import optional, ties

    tr = terminalreporter
    tr.section("batchgen optional paths")
    for line in optional.summary():
        tr.write_line(line)
    s = ties.STATS
    if s.samples:
        tr.write_line(
            f"near-tie exemptions: {s.exempt} of {s.samples} samples compared "
            f"({100 * s.exempt / s.samples:.2f}%), {s.positions} tokens compared"
        )
