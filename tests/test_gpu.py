"""The CUDA path end to end (GPU sessions only: ``BATCHGEN_TEST_GPU=1``, tests/devices.py).

fp32 on CUDA (Triton attention with IEEE dots, the torch sampler on the GPU) must give the CPU's
tokens exactly, up to near-tie flips that an independent reference confirms (tests/ties.py).
bf16 is compared statistically in tests/test_bf16.py (its ``cuda`` case).
"""

from __future__ import annotations

import json

import pytest

from batchgen.tiny_model import make_prompts
from tests.hf_reference import ARCHS
from tests.jobkit import run_job, write_job
from tests.optional import require
from tests.ties import compare_samples

pytestmark = pytest.mark.gpu

SAMPLINGS = {
    "greedy": {"temperature": 0, "max_tokens": 16, "ignore_eos": True, "n": 2},
    "top_k": {"temperature": 0.8, "top_k": 20, "max_tokens": 16, "ignore_eos": True, "n": 2,
              "seed": 5},
    "top_p": {"temperature": 1.0, "top_p": 0.9, "max_tokens": 12, "ignore_eos": True, "seed": 1},
}  # fmt: skip


# every architecture greedy and with top-k; top-p once, on an explicit device index
CASES = [(a, s, "cuda") for a in sorted(ARCHS) for s in ("greedy", "top_k")]
CASES.append(("llama", "top_p", "cuda:0"))


@pytest.mark.parametrize("arch, sampling, device", CASES)
def test_fp32_cuda_matches_cpu(arch, sampling, device, tiny_model, tmp_path) -> None:
    require("cuda")
    model = tiny_model(arch, **ARCHS[arch])
    prompts = make_prompts(12, seed=2, min_words=3, max_words=40)
    params = SAMPLINGS[sampling]
    engine = {"dtype": "float32", "block_size": 4, "max_num_seqs": 6}
    cpu = run_job(write_job(tmp_path / "cpu", model, prompts, sampling=params,
                            engine={**engine, "device": "cpu"}))  # fmt: skip
    gpu = run_job(write_job(tmp_path / "gpu", model, prompts, sampling=params,
                            engine={**engine, "device": device}))  # fmt: skip
    report = json.loads((tmp_path / "gpu" / "out" / ".batchgen" / "report.json").read_text())
    assert report["device"].startswith("cuda") and report["attention_backend"] == "triton"
    assert report["dtype"] == "float32"
    compare_samples(gpu, cpu, model=model, prompts=dict(enumerate(prompts)), sampling=params)


@pytest.mark.parametrize("graphs", ["off", "on"])
def test_overlap_on_cuda_gives_the_same_samples(graphs, tiny_model, tmp_path) -> None:
    """``engine.overlap`` on against off on CUDA (pinned readback, tokens filled on the device,
    with and without CUDA graphs): the same tokens, finish reasons and texts, EOS-free and with
    stop tokens that end samples early (the token drawn after them is discarded)."""
    require("cuda")
    model = tiny_model("llama", **ARCHS["llama"])
    prompts = make_prompts(12, seed=4, min_words=3, max_words=40)
    params = {"temperature": 0.8, "top_k": 20, "max_tokens": 16, "n": 2, "seed": 3,
              "logprobs": True, "stop_token_ids": list(range(40, 60))}  # fmt: skip
    engine = {"dtype": "float32", "block_size": 4, "max_num_seqs": 6, "device": "cuda",
              "cuda_graphs": graphs}  # fmt: skip
    rows, reports = {}, {}
    for mode in ("off", "on"):
        out = tmp_path / mode
        job = write_job(out, model, prompts, sampling=params, engine={**engine, "overlap": mode})
        rows[mode] = {(r["id"], r["sample_index"]): r for r in run_job(job)}
        reports[mode] = json.loads((out / "out" / ".batchgen" / "report.json").read_text())
    for key, want in rows["off"].items():
        got = rows["on"][key]
        assert (got["token_ids"], got["finish_reason"], got["text"]) == (
            want["token_ids"], want["finish_reason"], want["text"]
        ), key  # fmt: skip
        assert abs(got["cumulative_logprob"] - want["cumulative_logprob"]) < 1e-3, key
    assert rows["on"].keys() == rows["off"].keys()
    assert reports["off"]["overlapped_steps"] == 0 and reports["on"]["overlapped_steps"] > 0
