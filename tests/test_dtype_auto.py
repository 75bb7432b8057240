"""``engine.dtype: auto``: bf16 on CPUs with bf16 matrix instructions, float32 on other CPUs,
said by ``validate`` and ``.batchgen/report.json``. Both kinds of CPU are simulated on whatever CPU runs
the tests (the choice is patched where :mod:`batchgen.plan` reads it)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from batchgen.model import cpu_features
from batchgen.model.cpu_features import Bf16Support, bf16_support
from batchgen.plan import auto_dtype
from batchgen.tiny_model import make_prompts
from tests.jobkit import invoke, manifest_of, read_results, run_cli, write_job

AMX = Bf16Support(("AMX-BF16", "AVX512-BF16"))
NONE = Bf16Support(())


def test_support_falls_back_to_the_cpuinfo_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without torch's checks the flags of /proc/cpuinfo decide, feature by feature."""
    for name in ("_is_amx_tile_supported", "_is_avx512_bf16_supported"):
        monkeypatch.delattr(torch.cpu, name, raising=False)
    monkeypatch.setattr(cpu_features, "_cpuinfo_flags", lambda: {"avx512f", "avx512_bf16"})
    assert bf16_support() == Bf16Support(("AVX512-BF16",))
    monkeypatch.setattr(cpu_features, "_cpuinfo_flags", lambda: {"avx2", "fma"})
    support = bf16_support()
    assert not support.native
    assert support.describe() == "no AMX-BF16 or AVX512-BF16"


def test_support_follows_torch_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False, raising=False)
    assert bf16_support() == Bf16Support(("AMX-BF16",))
    assert bf16_support().describe() == "AMX-BF16"


@pytest.mark.parametrize(
    "support, dtype, words",
    [
        (AMX, torch.bfloat16, "multiplies bf16 natively (AMX-BF16, AVX512-BF16)"),
        (NONE, torch.float32, "no AMX-BF16 or AVX512-BF16, so bf16 would be slow"),
    ],
    ids=["amx", "avx2"],
)
def test_auto_dtype_on_a_cpu(monkeypatch: pytest.MonkeyPatch, support, dtype, words) -> None:
    monkeypatch.setattr("batchgen.plan.bf16_support", lambda: support)
    got, reason = auto_dtype(torch.device("cpu"))
    assert got == dtype
    assert reason.startswith("auto: ") and words in reason, reason


@pytest.mark.parametrize("support", [AMX, NONE], ids=["amx", "avx2"])
def test_validate_and_report_say_which_dtype_and_why(
    tiny_model, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, support: Bf16Support
) -> None:
    monkeypatch.setattr("batchgen.plan.bf16_support", lambda: support)
    dtype = "bfloat16" if support.native else "float32"
    job = write_job(
        tmp_path,
        tiny_model("llama"),
        make_prompts(3, seed=5, min_words=2, max_words=6),
        sampling={"max_tokens": 4, "temperature": 0},
        engine={"dtype": "auto", "device": "cpu"},
    )
    result = invoke("validate", job)
    assert result.exit_code == 0, result.output
    (device_line,) = [ln for ln in result.stdout.splitlines() if ln.startswith("device:")]
    assert f"cpu {dtype} (auto: this CPU " in device_line, device_line
    assert support.describe() in device_line, device_line

    run_cli("run", str(job), "--quiet")
    out = tmp_path / "out"
    report = json.loads((out / ".batchgen" / "report.json").read_text())
    assert report["dtype"] == dtype
    assert report["dtype_reason"].startswith("auto: this CPU ")
    assert support.describe() in report["dtype_reason"]
    assert manifest_of(out)["fingerprint"]["numerics"] == f"dtype={dtype},kv_cache_dtype={dtype}"
    assert len(read_results(out)) == 3


def test_an_explicit_dtype_says_so(tiny_model, tmp_path: Path) -> None:
    job = write_job(
        tmp_path, tiny_model("llama"), ["a b c"], engine={"dtype": "float32", "device": "cpu"}
    )
    result = invoke("validate", job)
    assert result.exit_code == 0, result.output
    assert "device:   cpu float32 (set in the job)" in result.stdout
