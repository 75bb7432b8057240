"""gpt-oss (``GptOssForCausalLM``) against transformers on a tiny random model: 4 experts (top 2)
with biases and the clamped SwiGLU, a router bias, attention sinks, a sliding (16-token) and a
full layer, YaRN.

- teacher-forced logits through the paged cache past the window, in both kernel paths;
- greedy output through the CLI equals transformers' ``generate``, prompts of two windows;
- an MXFP4 checkpoint loads the experts transformers' own dequantization gives.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from batchgen.model.attention import TorchAttention
from batchgen.model.loader import load_model
from batchgen.model.registry import read_model_config
from batchgen.tiny_model import make_prompts
from tests.hf_reference import GPT_OSS, hf_greedy, hf_logits
from tests.jobkit import run_job, write_job
from tests.optional import require
from tests.test_model import assert_close_logits, load, run_paged
from tests.test_windows import window_schedules
from tests.ties import compare_samples


@pytest.fixture(scope="module")
def gpt_oss_dir(tiny_model) -> Path:
    return tiny_model(**GPT_OSS)


def test_config(gpt_oss_dir: Path) -> None:
    cfg = read_model_config(gpt_oss_dir)[0]
    assert cfg.windows == (16, 0) and cfg.qkv_bias and cfg.o_bias
    assert cfg.moe is not None and cfg.moe.sparse_layers == (0, 1) and cfg.moe.renormalize
    assert cfg.rope.rope_type == "yarn" and not cfg.rope.truncate


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
def test_paged_logits_match_transformers(native: bool, gpt_oss_dir: Path) -> None:
    model, info = load(gpt_oss_dir, native)
    gen = torch.Generator().manual_seed(5)
    schedules = window_schedules()
    seqs = [torch.randint(0, info.vocab_size, (sum(c),), generator=gen).tolist() for c in schedules]
    ours = run_paged(model, seqs, schedules, 4, gen)
    for o, r in zip(ours, hf_logits(gpt_oss_dir, seqs), strict=True):
        assert_close_logits(o, r)


@pytest.mark.parametrize("path", ["native", "torch", "triton"])
def test_greedy_job_matches_transformers_generate(
    path: str, gpt_oss_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prompts of 2-4 windows, chunked prefill, 10 new tokens; ``torch``: without the C
    kernels; ``triton``: the Triton attention kernel (interpreted on a CPU) with its sinks."""
    from transformers import AutoTokenizer

    if path == "native":
        require("cpu_kernels")
    elif path == "torch":
        monkeypatch.setenv("BATCHGEN_CPU_KERNEL", "0")
    tok = AutoTokenizer.from_pretrained(gpt_oss_dir)
    prompts = make_prompts(3, seed=41, min_words=12, max_words=30)
    sampling = {"temperature": 0, "max_tokens": 10}
    engine = {"block_size": 4, "max_num_batched_tokens": 24, "max_num_seqs": 2}
    if path == "triton":
        engine["attention_backend"] = "triton"
    rows = run_job(write_job(tmp_path, gpt_oss_dir, prompts, sampling=sampling, engine=engine))
    ids = [tok(p)["input_ids"] for p in prompts]
    assert min(len(i) for i in ids) > 32
    expected = hf_greedy(gpt_oss_dir, ids, 10)
    ref = [{"id": i, "sample_index": 0, "token_ids": e} for i, e in enumerate(expected)]
    compare_samples(
        rows, ref, model=gpt_oss_dir, prompts=dict(enumerate(prompts)), sampling=sampling
    )


def test_mxfp4_checkpoint_loads_the_dequantized_experts(gpt_oss_dir: Path, tmp_path: Path) -> None:
    """Random MXFP4 experts (codes and scales) in one checkpoint, transformers' dequantization
    of them (``convert_moe_packed_tensors``, its layout) in another: the same model."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    cfg = read_model_config(gpt_oss_dir)[0]
    assert cfg.moe is not None
    e, h, inter = cfg.moe.num_experts, cfg.hidden_size, cfg.moe.intermediate_size
    state = load_file(gpt_oss_dir / "model.safetensors")
    packed, plain = dict(state), dict(state)
    gen = torch.Generator().manual_seed(6)
    for i in range(cfg.num_layers):
        for name, rows, cols in (("gate_up_proj", 2 * inter, h), ("down_proj", h, inter)):
            key = f"model.layers.{i}.mlp.experts.{name}"
            blocks = torch.randint(0, 256, (e, rows, cols // 32, 16), generator=gen)
            blocks = blocks.to(torch.uint8)
            scales = torch.randint(122, 130, (e, rows, cols // 32), generator=gen).to(torch.uint8)
            del packed[key]
            packed[key + "_blocks"], packed[key + "_scales"] = blocks, scales
            plain[key] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    dirs = {}
    for label, tensors in (("mxfp4", packed), ("plain", plain)):
        d = tmp_path / label
        shutil.copytree(gpt_oss_dir, d)
        save_file({k: v.contiguous() for k, v in tensors.items()}, d / "model.safetensors")
        dirs[label] = d
    raw = json.loads((dirs["mxfp4"] / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "mxfp4"}
    (dirs["mxfp4"] / "config.json").write_text(json.dumps(raw))
    cpu = torch.device("cpu")
    a, _ = load_model(dirs["mxfp4"], cpu, torch.float32, TorchAttention(False), native=False)
    b, _ = load_model(dirs["plain"], cpu, torch.float32, TorchAttention(False), native=False)
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name
