"""scripts/gpu_check.sh, dry-run on the CPU (tiny shapes, Triton interpreted): every step runs
and writes its figures, so the one GPU run it is prepared for does not fail on a typo."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # about 80 s on two cores
@pytest.mark.timeout(900)
def test_gpu_check_dry_run(tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PYTHONPATH")}
    proc = subprocess.run(
        ["bash", str(REPO / "scripts" / "gpu_check.sh"), str(out), "--cpu-dry-run"],
        env={**env, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=850,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary) == {"tests", "kernels", "checks"}
    assert all(v.startswith("rc=0 ") for v in summary.values()), summary
    checks = json.loads((out / "checks.json").read_text())
    assert checks["dry_run"] is True
    for key in (
        "sampler",
        "parity",
        "kv_sizing",
        "throughput",
        "profile",
        "variants",
        "graphs",
        "overlap",
    ):
        assert checks[key].get("ok") is not False, (key, checks[key])
    models = checks["parity"]["models"]
    assert len(models) == 2 and all(set(m) == {"float32", "bfloat16"} for m in models.values())
    assert checks["throughput"]["engine_tokens_per_s"] > 0
    kernels = json.loads((out / "kernels.json").read_text())
    assert any(r["kernel"] == "attention/mixed" for r in kernels["results"])
    assert "passed" in (out / "pytest.log").read_text()
