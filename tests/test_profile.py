"""BATCHGEN_PROFILE=1: exclusive phase times, and a profiled job's report (same outputs, phases
per step kind that add up to no more than the run)."""

from __future__ import annotations

import json
import time

from batchgen.engine.profile import StepProfile
from tests.jobkit import run_job, write_job


def test_nested_phases_are_exclusive() -> None:
    p = StepProfile()
    p.begin_step("decode")
    with p.span("forward"):
        time.sleep(0.02)
        with p.span("gemm"):
            time.sleep(0.03)
        with p.span("gemm"):
            time.sleep(0.01)
    p.add("schedule", 0.5)
    s = p.summary()["decode"]
    assert s["steps"] == 1
    fwd, gemm = s["phases"]["forward"], s["phases"]["gemm"]
    assert gemm["calls"] == 2 and 0.04 <= gemm["s"] < 0.07
    assert 0.02 <= fwd["s"] < 0.035  # the GEMMs inside are not counted again
    assert s["phases"]["schedule"] == {"s": 0.5, "calls": 1, "ms_per_step": 500.0}
    assert list(s["phases"]) == ["schedule", "gemm", "forward"]  # largest first


def test_step_kinds_are_kept_apart() -> None:
    p = StepProfile()
    for kind in ("prefill", "decode", "decode"):
        p.begin_step(kind)
        p.add("sample", 0.25)
    s = p.summary()
    assert s["prefill"]["steps"] == 1 and s["decode"]["steps"] == 2
    assert s["decode"]["phases"]["sample"]["s"] == 0.5
    assert s["decode"]["phases"]["sample"]["ms_per_step"] == 250.0



def test_profiled_job_reports_its_phases(tmp_path, tiny_model, monkeypatch) -> None:
    model = tiny_model()
    prompts = [f"profile row {i} " * (1 + i % 5) for i in range(6)]
    sampling = {"n": 2, "max_tokens": 6, "temperature": 0.0}
    plain = run_job(write_job(tmp_path / "plain", model, prompts, sampling=sampling))
    monkeypatch.setenv("BATCHGEN_PROFILE", "1")
    profiled = run_job(write_job(tmp_path / "prof", model, prompts, sampling=sampling))
    key = lambda r: (r["id"], r["sample_index"])  # noqa: E731
    assert [r["token_ids"] for r in sorted(plain, key=key)] == [
        r["token_ids"] for r in sorted(profiled, key=key)
    ]
    report = json.loads((tmp_path / "prof" / "out" / ".batchgen" / "report.json").read_text())
    prof = report["profile"]
    assert set(prof) == {"prefill", "decode"}
    assert sum(k["steps"] for k in prof.values()) == report["engine_steps"]
    for kind in prof.values():
        assert {"gemm", "attention", "forward", "lm_head", "sample"} <= set(kind["phases"])
    in_steps = sum(p["s"] for k in prof.values() for p in k["phases"].values())
    assert 0 < in_steps <= report["elapsed_s"]
    # the unprofiled report has no profile
    plain_report = tmp_path / "plain" / "out" / ".batchgen" / "report.json"
    assert "profile" not in json.loads(plain_report.read_text())
