"""``engine.device: cuda:N``: every engine step runs with ``cuda:N`` current (Triton launches on
the current device). Checked without a GPU by recording what the guard enters."""

from __future__ import annotations

import contextlib

import torch

from batchgen.engine import device as device_mod
from batchgen.engine.device import device_guard
from batchgen.engine.request import SamplingParams
from tests.test_engine import generate, make_engine, random_prompts


class FakeCudaDevice:
    """Stands in for ``torch.cuda.device``: records the devices made current."""

    entered: list[torch.device] = []

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def __enter__(self) -> None:
        FakeCudaDevice.entered.append(self.device)

    def __exit__(self, *exc: object) -> None:
        return None


def test_guard_makes_an_indexed_cuda_device_current(monkeypatch) -> None:
    FakeCudaDevice.entered = []
    monkeypatch.setattr(torch.cuda, "device", FakeCudaDevice)
    with device_guard(torch.device("cuda:1")):
        assert FakeCudaDevice.entered == [torch.device("cuda:1")]
    for dev in ("cpu", "cuda"):  # no index: whatever is current stays current
        with device_guard(torch.device(dev)):
            pass
    assert FakeCudaDevice.entered == [torch.device("cuda:1")]


def test_every_engine_step_runs_inside_the_guard(tiny_model, monkeypatch) -> None:
    engine = make_engine(tiny_model("llama", num_layers=1))
    entered: list[torch.device] = []
    inside = [False]

    @contextlib.contextmanager
    def recording_guard(device: torch.device):
        entered.append(device)
        inside[0] = True
        try:
            yield
        finally:
            inside[0] = False

    forward = engine.model.forward

    def checked_forward(*args, **kwargs):
        assert inside[0], "the model ran outside the device guard"
        return forward(*args, **kwargs)

    engine.model.forward = checked_forward
    monkeypatch.setattr("batchgen.engine.engine.device_guard", recording_guard)
    generate(engine, random_prompts([3, 5]), SamplingParams(temperature=0.0, max_tokens=3))
    assert entered and entered == [engine.device] * engine.stats.steps
    assert device_mod.device_guard is device_guard  # the real guard is what the engine imports


def test_cuda_graphs_on_is_refused_on_a_cpu(tiny_model, tmp_path) -> None:
    from tests.jobkit import invoke, one_line, write_job

    job = write_job(tmp_path, tiny_model("llama", num_layers=1), ["a b"],
                    engine={"device": "cpu", "cuda_graphs": "on"})  # fmt: skip
    line = one_line(invoke("run", job), 2, "engine.cuda_graphs", "'on'", "CUDA device")
    assert "cpu" in line


def test_cuda_graphs_and_overlap_read_yaml_booleans(tmp_path) -> None:
    """``cuda_graphs: off`` / ``on`` unquoted are YAML booleans; they mean the words (the same
    for ``overlap``)."""
    from batchgen.jobfile import load_job
    from tests.jobkit import write_job_file

    for key in ("cuda_graphs", "overlap"):
        for text, want in (("off", "off"), ("on", "on"), ("auto", "auto")):
            job = {"model": "m", "input": {"path": "p.parquet"}, "output": {"path": "o"}}
            path = write_job_file(tmp_path, job)
            path.write_text(path.read_text() + f"engine:\n  {key}: {text}\n")
            assert getattr(load_job(path).engine, key) == want


def test_overlap_auto_is_on_only_on_cuda() -> None:
    import torch

    from batchgen.plan import resolve_overlap

    assert resolve_overlap("auto", torch.device("cuda:1"))
    assert not resolve_overlap("auto", torch.device("cpu"))
    assert resolve_overlap("on", torch.device("cpu"))
    assert not resolve_overlap("off", torch.device("cuda"))
