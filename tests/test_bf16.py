"""bfloat16 end to end through the CLI, compared with transformers statistically.

bf16 rounds differently in every implementation, so tokens cannot be compared exactly. What is
compared instead, per architecture, on 16 prompts x 16 greedy tokens:

- batchgen's bf16 logprobs against transformers' float32 logprobs of the same tokens
  (teacher-forced): no further from them than transformers' own bf16 is (with a small margin);
- against transformers' bf16 logprobs of the same tokens: close (mean |difference|);
- greedy tokens against transformers' bf16 ``generate``: a large share identical, and the first
  divergence late on average.

Measured on the four tiny architectures (CPU: C kernels and oneDNN-packed GEMMs, prompts of seed
0; llama / mistral / qwen2 / qwen3): mean |ours - fp32| 0.119 / 0.115 / 0.094 / 0.032 nats against
transformers-bf16's 0.123 / 0.116 / 0.095 / 0.033; mean |ours - hf bf16| 0.029 / 0.030 / 0.030 /
0.025; identical greedy tokens 80% / 79% / 87% / 86%, median first divergence at the last of 16
tokens. A bf16 path with a real bug (a wrong rotary, a missing norm, a mis-cast cache) lands far
outside these bounds. The same test runs on CUDA where there is one.

The mixture-of-experts models (tests/hf_reference.py MOE_ARCHS; AMD EPYC with AVX512-BF16;
experts on F.linear, and the same figures with oneDNN-packed ones; mixtral / qwen2_moe /
qwen3_moe): mean |ours - fp32| 0.373 / 0.113 / 0.067 against transformers-bf16's 0.353 / 0.111 /
0.062; mean |ours - hf bf16| 0.092 / 0.029 / 0.038; identical greedy tokens 81% / 66% / 77%.
bf16 rounding moves them more than the dense models: where a token's router scores two experts
nearly alike, rounding can swap which one it uses, which changes that token's output by far more
than rounding alone. So for them the bound on |ours - hf bf16| grows with transformers' own bf16
error (0.1 + 0.2 x |hf bf16 - fp32|).
"""

from __future__ import annotations

import json
import statistics

import pytest
import torch

from batchgen.tiny_model import make_prompts
from tests.hf_reference import ARCHS, MOE_ARCHS
from tests.jobkit import run_job, write_job
from tests.optional import require

MAX_NEW = 16


def teacher_forced_logprobs(hf, ids: list[int], out: list[int]) -> list[float]:
    with torch.no_grad():
        lp = torch.log_softmax(hf(torch.tensor([ids + out])).logits[0].float(), dim=-1)
    return [lp[len(ids) - 1 + i, t].item() for i, t in enumerate(out)]


@pytest.mark.slow
@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)], ids=["cpu", "cuda"]
)
@pytest.mark.parametrize("arch", sorted(ARCHS) + sorted(MOE_ARCHS))
def test_bf16_job_tracks_transformers(arch, device, tiny_model, tmp_path) -> None:
    if device == "cuda":
        require("cuda")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = tiny_model(arch, **(ARCHS | MOE_ARCHS)[arch])
    tok = AutoTokenizer.from_pretrained(model)
    prompts = make_prompts(16, seed=0, min_words=3, max_words=30)  # any seed must pass
    sampling = {"temperature": 0, "max_tokens": MAX_NEW, "ignore_eos": True, "logprobs": True}
    job = write_job(
        tmp_path,
        model,
        prompts,
        sampling=sampling,
        engine={"dtype": "bfloat16", "device": device, "block_size": 4, "max_num_seqs": 6},
    )
    rows = run_job(job)
    report = json.loads((tmp_path / "out" / ".batchgen" / "report.json").read_text())
    assert report["dtype"] == "bfloat16" and report["device"].startswith(device)
    if device == "cpu":
        require("cpu_kernels")
        assert report["cpu_kernels"]  # the bf16 C kernels ran, not the PyTorch ops

    hf32 = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    hf16 = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16).eval()
    ours_vs_fp32, hf16_vs_fp32, ours_vs_hf16 = [], [], []
    same, firsts = 0, []
    for row, prompt in zip(rows, prompts, strict=True):
        ids = tok(prompt)["input_ids"]
        out = row["token_ids"]
        assert len(out) == MAX_NEW and row["finish_reason"] == "length"
        fp32 = teacher_forced_logprobs(hf32, ids, out)
        bf16 = teacher_forced_logprobs(hf16, ids, out)
        ours = row["token_logprobs"]
        ours_vs_fp32 += [abs(a - b) for a, b in zip(ours, fp32, strict=True)]
        hf16_vs_fp32 += [abs(a - b) for a, b in zip(bf16, fp32, strict=True)]
        ours_vs_hf16 += [abs(a - b) for a, b in zip(ours, bf16, strict=True)]
        x = torch.tensor([ids])
        with torch.no_grad():
            want = hf16.generate(
                x,
                attention_mask=torch.ones_like(x),
                do_sample=False,
                max_new_tokens=MAX_NEW,
                min_new_tokens=MAX_NEW,
            )[0, len(ids) :].tolist()
        same += sum(a == b for a, b in zip(out, want, strict=True))
        firsts.append(
            next((i for i, (a, b) in enumerate(zip(out, want, strict=True)) if a != b), MAX_NEW)
        )
    mean = statistics.fmean
    print(
        f"\n[bf16 {arch} {device}] mean |ours - fp32| {mean(ours_vs_fp32):.4f}, "
        f"|hf bf16 - fp32| {mean(hf16_vs_fp32):.4f}, |ours - hf bf16| {mean(ours_vs_hf16):.4f}; "
        f"identical greedy tokens {same / (MAX_NEW * len(rows)):.0%}, first divergences {firsts}"
    )
    # It really ran in bf16 (the report aside): float32 would be ~1e-6 from transformers' fp32.
    assert mean(ours_vs_fp32) >= 0.25 * mean(hf16_vs_fp32)
    assert mean(ours_vs_fp32) <= 1.5 * mean(hf16_vs_fp32) + 0.02
    router_flips = 0.2 * mean(hf16_vs_fp32) if arch in MOE_ARCHS else 0.0
    assert mean(ours_vs_hf16) <= 0.1 + router_flips
    assert same >= 0.6 * MAX_NEW * len(rows)
    assert statistics.median(firsts) >= MAX_NEW / 2
