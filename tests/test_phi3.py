"""Phi-3 (``Phi3ForCausalLM``: Phi-3, Phi-4-mini) against transformers: fused checkpoint tensors,
half of each head rotated, LongRoPE (short factors below position 32, long ones after) and a
window of 16 tokens, on a tiny random model.

- teacher-forced logits through the paged cache, prompts within the original length and
  decoding past it (transformers run as generation runs it: LongRoPE's factor set is chosen per
  forward pass), in both kernel paths;
- greedy output through the CLI equals transformers' ``generate`` below position 32, and its
  forward passes one token at a time past it (``generate`` recomputes the sequence with the long
  factors there, which a cache whose keys never change cannot: docs/models.md);
- the config: legacy ``su`` LongRoPE, and refusals.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from batchgen.errors import ModelError
from batchgen.model.registry import parse_config, read_model_config
from batchgen.tiny_model import make_prompts
from tests.hf_reference import PHI3, hf_greedy, hf_logits_decoding
from tests.jobkit import run_job, write_job
from tests.optional import require
from tests.test_model import assert_close_logits, load, run_paged
from tests.ties import compare_samples

ORIGINAL = 32  # original_max_position_embeddings: LongRoPE's long factors from here on


@pytest.fixture(scope="module")
def phi3_dir(tiny_model) -> Path:
    return tiny_model(**PHI3)


def test_config(phi3_dir: Path) -> None:
    cfg = read_model_config(phi3_dir)[0]
    assert cfg.rope.rope_type == "longrope" and cfg.rotary_dim == 8
    assert cfg.rope.factor == 4.0 and cfg.windows == (16, 16)
    raw = json.loads((phi3_dir / "config.json").read_text())
    legacy = {k: v for k, v in raw.items() if k != "rope_parameters"}
    legacy["rope_scaling"] = raw["rope_parameters"] | {"type": "su"}
    del legacy["rope_scaling"]["rope_type"]
    assert parse_config(legacy, Path("config.json")).rope == cfg.rope
    bad = raw | {"rope_parameters": raw["rope_parameters"] | {"short_factor": [1.0, 2.0]}}
    with pytest.raises(ModelError, match="2 longrope factors for 8 rotated dimensions"):
        parse_config(bad, Path("config.json"))
    # partial rotation stays refused where the architecture does not rotate part of a head
    llama = raw | {"architectures": ["LlamaForCausalLM"]}
    llama["rope_parameters"] = {"rope_type": "default", "partial_rotary_factor": 0.5}
    with pytest.raises(ModelError, match="unsupported partial_rotary_factor 0.5"):
        parse_config(llama, Path("config.json"))


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
def test_paged_logits_match_transformers(native: bool, phi3_dir: Path) -> None:
    """Prompts of 5 to 30 tokens (one or two chunks), then decode steps to position 44."""
    model, info = load(phi3_dir, native)
    gen = torch.Generator().manual_seed(3)
    prompts = [[30], [12, 18], [5, 25], [20, 10]]
    schedules = [p + [1] * 14 for p in prompts]
    seqs = [torch.randint(0, info.vocab_size, (sum(c),), generator=gen).tolist() for c in schedules]
    ours = run_paged(model, seqs, schedules, 4, gen)
    assert all(len(s) > ORIGINAL for s in seqs)
    for o, r in zip(ours, hf_logits_decoding(phi3_dir, seqs, 30), strict=True):
        assert_close_logits(o, r)


def hf_greedy_incremental(
    model_dir: Path, prompt_ids: list[list[int]], max_new: int
) -> list[list[int]]:
    """Greedy continuations by transformers' forward passes through its cache, one token per
    pass: LongRoPE's long factors for the tokens from position 32 on, the cached keys before
    kept (``generate`` instead recomputes the whole sequence with the long factors once it
    passes position 32: see docs/models.md)."""
    from tests.hf_reference import hf_model

    hf = hf_model(model_dir)
    outs = []
    with torch.no_grad():
        for ids in prompt_ids:
            step = hf(torch.tensor([ids]), use_cache=True)
            new: list[int] = []
            while True:
                new.append(int(step.logits[0, -1].argmax()))
                if len(new) == max_new or new[-1] in hf.generation_config.eos_token_id:
                    break
                step = hf(torch.tensor([[new[-1]]]), cache=step.cache, use_cache=True)
            outs.append(new)
    return outs


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
@pytest.mark.parametrize("past", [False, True], ids=["within", "past"])
def test_greedy_job_matches_transformers(
    native: bool, past: bool, phi3_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``within``: prompts of 6-12 tokens and up to 20 new ones, all below position 32 (short
    factors), against ``generate``. ``past``: prompts of 17-31 tokens and 20 new ones, past the
    window and past position 32, against transformers' forward passes one token at a time."""
    from transformers import AutoTokenizer

    if native:
        require("cpu_kernels")
    else:
        monkeypatch.setenv("BATCHGEN_CPU_KERNEL", "0")
    tok = AutoTokenizer.from_pretrained(phi3_dir)
    prompts = make_prompts(12, seed=31, min_words=2, max_words=14)
    ids = [tok(p)["input_ids"] for p in prompts]
    low, high = (16, ORIGINAL) if past else (5, 13)
    keep = [i for i, x in enumerate(ids) if low < len(x) < high][:4]
    assert len(keep) >= 3
    prompts, ids = [prompts[i] for i in keep], [ids[i] for i in keep]
    max_new = 20 if past else ORIGINAL - max(len(x) for x in ids)
    sampling = {"temperature": 0, "max_tokens": max_new}
    engine = {"block_size": 4, "max_num_batched_tokens": 16, "max_num_seqs": 3}
    rows = run_job(write_job(tmp_path, phi3_dir, prompts, sampling=sampling, engine=engine))
    expected = (hf_greedy_incremental if past else hf_greedy)(phi3_dir, ids, max_new)
    ref = [{"id": i, "sample_index": 0, "token_ids": e} for i, e in enumerate(expected)]
    compare_samples(rows, ref, model=phi3_dir, prompts=dict(enumerate(prompts)), sampling=sampling)
