"""Shared test setup.

The session's device mode (tests/devices.py: CPU with Triton interpreted, or GPU with Triton
compiled) must be set before torch initialises CUDA and before any module decorated with
@triton.jit is imported, hence here at the top.
"""

from tests import devices

devices.configure_environment()

import torch  # noqa: E402

if devices.GPU_SESSION and not torch.cuda.is_available():
    raise RuntimeError(f"{devices.GPU_ENV}=1 but torch sees no CUDA device")

torch.set_num_threads(min(2, torch.get_num_threads()))


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """``tiny_model(arch="llama", **kwargs) -> Path``: a random model + tokenizer, made once per
    distinct arguments in a session (see batchgen.tiny_model.make_tiny_model)."""
    from batchgen.tiny_model import make_tiny_model

    made: dict[tuple, object] = {}

    def make(arch: str = "llama", **kwargs):
        key = (arch, repr(sorted(kwargs.items())))  # values may be dicts (config_overrides)
        if key not in made:
            made[key] = make_tiny_model(tmp_path_factory.mktemp(f"model-{arch}"), arch, **kwargs)
        return made[key]

    return make


def pytest_collection_modifyitems(config, items) -> None:
    """Skip, by name, the tests this session's device mode does not run (tests/devices.py)."""
    for item in items:
        reason = devices.skip_reason({m.name for m in item.iter_markers()})
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=reason))


def pytest_terminal_summary(terminalreporter) -> None:
    """Which optional paths this session could run, and how many samples the near-tie
    comparison exempted (tests/ties.py)."""
    from tests import optional, ties

    tr = terminalreporter
    tr.section("batchgen optional paths")
    mode = (
        "GPU (Triton compiled)" if devices.GPU_SESSION else "CPU (CUDA hidden, Triton interpreted)"
    )
    tr.write_line(f"session: {mode}")
    for line in optional.summary():
        tr.write_line(line)
    s = ties.STATS
    if s.samples:
        tr.write_line(
            f"near-tie exemptions: {s.exempt} of {s.samples} samples compared "
            f"({100 * s.exempt / s.samples:.2f}%), {s.positions} tokens compared"
        )
