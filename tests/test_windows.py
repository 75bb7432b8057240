"""Sliding-window attention against transformers, past the window: Mistral (every layer
windowed), Qwen2 (sliding and full layers by ``layer_types``), Gemma 2 (softcaps) and Gemma 3
(q/k norms, two RoPE bases), with windows of 16 tokens.

- the C kernel's windowed paths (per token and tiled) and the PyTorch plan against a direct
  definition of windowed attention;
- teacher-forced logits through the paged cache (prefills longer than the window, extends and
  decodes across its edge) in both kernel paths;
- whole jobs through the CLI: greedy output equals transformers' ``generate`` with prompts a few
  windows long; prompts sharing a prefix longer than the window give the same tokens with the
  prefix cache on and off, and n samples forked past the window's edge are those of one sample
  per row.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from batchgen.model.attention import AttentionMetadata, TorchAttention
from batchgen.model.registry import parse_config, read_model_config
from batchgen.tiny_model import make_prompts
from tests.hf_reference import WINDOW_ARCHS, hf_greedy, hf_logits
from tests.jobkit import run_job, samples_with_and_without_prefix_cache, write_job
from tests.optional import require
from tests.test_model import assert_close_logits, load, run_paged
from tests.ties import compare_samples

WINDOW = 16


@pytest.fixture(scope="module")
def window_dirs(tiny_model) -> dict[str, Path]:
    return {arch: tiny_model(**kw) for arch, kw in WINDOW_ARCHS.items()}


def test_config_windows_per_layer(window_dirs: dict[str, Path]) -> None:
    mistral = read_model_config(window_dirs["mistral_window"])[0]
    assert mistral.windows == (WINDOW, WINDOW) and mistral.max_model_len == 512
    qwen2 = read_model_config(window_dirs["qwen2_window"])[0]
    assert qwen2.windows == (WINDOW, 0) and qwen2.window(1) is None
    gemma3 = read_model_config(window_dirs["gemma3"])[0]
    assert gemma3.windows == (WINDOW, 0) and gemma3.qk_norm and gemma3.tie_word_embeddings
    assert (gemma3.rope.theta, gemma3.local_rope.theta) == (1e6, 1e4)
    gemma2 = read_model_config(window_dirs["gemma2"])[0]
    assert (gemma2.attn_softcap, gemma2.final_softcap, gemma2.local_rope) == (5.0, 10.0, None)
    # a hub-style Gemma 3 config: no layer_types (five local layers to one global), the local
    # base and the global scaling in the legacy keys
    raw = json.loads((window_dirs["gemma3"] / "config.json").read_text())
    for key in ("layer_types", "rope_parameters"):
        del raw[key]
    raw |= {
        "num_hidden_layers": 7,
        "hidden_act": "gelu_pytorch_tanh",
        "rope_theta": 1e6,
        "rope_local_base_freq": 1e4,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
    }
    cfg = parse_config(raw, Path("config.json"))
    assert cfg.windows == (WINDOW,) * 5 + (0, WINDOW)
    # the MoE Qwens' rules without layer_types (transformers' config classes): Qwen2-MoE the
    # even layers below max_window_layers, Qwen3-MoE every layer
    base = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 6, "vocab_size": 512,
            "intermediate_size": 64, "use_sliding_window": True, "sliding_window": WINDOW,
            "max_window_layers": 3}  # fmt: skip
    q2 = parse_config(base | {"architectures": ["Qwen2MoeForCausalLM"]}, Path("config.json"))
    assert q2.windows == (WINDOW, 0, WINDOW, 0, 0, 0)
    q3 = parse_config(base | {"architectures": ["Qwen3MoeForCausalLM"]}, Path("config.json"))
    assert q3.windows == (WINDOW,) * 6
    qwen2 = parse_config(base | {"architectures": ["Qwen2ForCausalLM"]}, Path("config.json"))
    assert qwen2.windows == (0, 0, 0, WINDOW, WINDOW, WINDOW)
    assert (cfg.rope.rope_type, cfg.rope.factor, cfg.rope.theta) == ("linear", 8.0, 1e6)
    assert (cfg.local_rope.rope_type, cfg.local_rope.theta) == ("default", 1e4)


# --------------------------------------------------------------------------------------------
# attention against its definition
# --------------------------------------------------------------------------------------------


def windowed_reference(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    first_pos: int,
    window: int | None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One sequence: q ``[Lq, Hq, D]`` at positions first_pos.., keys/values ``[Lk, Hkv, D]``
    (positions 0..), each row sees keys ``p-W+1 .. p`` (None: ``0 .. p``), scores capped by
    ``softcap * tanh(s / softcap)``, one more softmax term ``exp(sinks[h])`` per head; fp32."""
    lq, hq, _ = q.shape
    lk, hkv, _ = keys.shape
    k = keys.repeat_interleave(hq // hkv, dim=1)
    v = values.repeat_interleave(hq // hkv, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * q.shape[-1] ** -0.5
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    pos = torch.arange(first_pos, first_pos + lq)[:, None]
    kpos = torch.arange(lk)[None, :]
    visible = (kpos <= pos) & (kpos > pos - (window or lk + first_pos + lq))
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks[:, None, None].expand(-1, lq, 1)], dim=-1)
        return torch.einsum("hqk,khd->qhd", scores.softmax(-1)[..., :-1], v.float())
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.float())


# (q_len, seq_len) per sequence: decodes before, at and past the window, a fresh prefill within
# and past it, extends across its edge, short and long
STEP = [(1, 5), (1, 16), (1, 40), (12, 12), (45, 45), (6, 30), (20, 37), (3, 17)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2)])
@pytest.mark.parametrize(
    "window,softcap,sink",
    [(WINDOW, None, False), (None, 2.0, False), (WINDOW, 2.0, False), (WINDOW, None, True),
     (None, None, True)],
    ids=["w", "cap", "w-cap", "w-sink", "sink"],
)  # fmt: skip
def test_windowed_attention_matches_the_definition(
    native: bool,
    dtype: torch.dtype,
    hq: int,
    hkv: int,
    window: int | None,
    softcap: float | None,
    sink: bool,
) -> None:
    """Windowed and softcapped attention (Gemma 2's), and gpt-oss's sinks, in the C kernels and
    the PyTorch plan."""
    if native:
        require("cpu_kernels")
    d, bs = 64, 4
    gen = torch.Generator().manual_seed(hq)
    sinks = torch.randn(hq, generator=gen) if sink else None
    blocks_of = [math.ceil(k / bs) for _, k in STEP]
    num_blocks = sum(blocks_of) + 3
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    cache = torch.full((2, num_blocks, bs, hkv, d), float("nan"), dtype=dtype)
    tables = torch.zeros(len(STEP), max(blocks_of), dtype=torch.int32)
    qs, ks, vs, slots, want = [], [], [], [], []
    start = 0
    for b, (q_len, k_len) in enumerate(STEP):
        table = perm[start : start + blocks_of[b]]
        start += blocks_of[b]
        tables[b, : len(table)] = torch.tensor(table)
        keys = torch.randn(k_len, hkv, d, generator=gen).to(dtype)
        values = torch.randn(k_len, hkv, d, generator=gen).to(dtype)
        q = torch.randn(q_len, hq, d, generator=gen).to(dtype)
        for p in range(k_len):  # the cached prefix is in the cache; the new rows come as k, v
            slot = table[p // bs] * bs + p % bs
            if p < k_len - q_len:
                cache[0].view(-1, hkv, d)[slot] = keys[p]
                cache[1].view(-1, hkv, d)[slot] = values[p]
            else:
                slots.append(slot)
        qs.append(q)
        ks.append(keys[k_len - q_len :])
        vs.append(values[k_len - q_len :])
        want.append(windowed_reference(q, keys, values, k_len - q_len, window, softcap, sinks))
    cu = [0]
    for q_len, _ in STEP:
        cu.append(cu[-1] + q_len)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        block_tables=tables,
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
        seq_lens=torch.tensor([k for _, k in STEP], dtype=torch.int32),
        max_seqlen_q=max(q for q, _ in STEP),
        max_seqlen_k=max(k for _, k in STEP),
    )
    attn = TorchAttention(native)
    plan = attn.prepare(meta, cache[None], hq, window=window, softcap=softcap)
    assert (plan.kernels is not None) == native
    out = attn.forward(
        torch.cat(qs), torch.cat(ks), torch.cat(vs), cache[0], cache[1], plan, d**-0.5,
        sinks=sinks,
    )  # fmt: skip
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    for b, w in enumerate(want):
        err = (out[cu[b] : cu[b + 1]].float() - w).abs().max().item()
        assert err <= tol, (b, STEP[b], err)


# --------------------------------------------------------------------------------------------
# the models against transformers
# --------------------------------------------------------------------------------------------


def window_schedules() -> list[list[int]]:
    """Chunks per sequence (block size 4, window 16): prefills within and past the window,
    extends across its edge, decodes past it."""
    return [
        [45, 1, 1, 1],  # a fresh prefill of nearly three windows
        [10, 20, 1, 1, 1],  # within, then across the edge
        [1] * 3 + [30, 1, 1],  # decodes, then a long extend
        [5, 5, 5, 5, 1, 1, 1],  # short extends over the edge (per-token kernel)
        [16, 16, 1, 1],  # exactly a window, twice
    ]


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
@pytest.mark.parametrize("arch", sorted(WINDOW_ARCHS))
def test_paged_logits_match_transformers(arch: str, native: bool, window_dirs) -> None:
    model_dir = window_dirs[arch]
    model, info = load(model_dir, native)
    gen = torch.Generator().manual_seed(len(arch))
    schedules = window_schedules()
    seqs = [torch.randint(0, info.vocab_size, (sum(c),), generator=gen).tolist() for c in schedules]
    ours = run_paged(model, seqs, schedules, 4, gen)
    for o, r in zip(ours, hf_logits(model_dir, seqs), strict=True):
        assert_close_logits(o, r)


# --------------------------------------------------------------------------------------------
# whole jobs through the CLI
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
@pytest.mark.parametrize("arch", sorted(WINDOW_ARCHS))
def test_greedy_job_matches_transformers_generate(
    arch: str, native: bool, window_dirs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prompts of 2-4 windows (chunked prefill of 24-token steps, up to 3 sequences per step),
    12 new tokens; transformers runs each prompt alone. ``torch``: without the C kernels."""
    if native:
        require("cpu_kernels")
    else:
        monkeypatch.setenv("BATCHGEN_CPU_KERNEL", "0")
    from transformers import AutoTokenizer

    model = window_dirs[arch]
    tok = AutoTokenizer.from_pretrained(model)
    prompts = make_prompts(4, seed=21, min_words=12, max_words=30)
    sampling = {"temperature": 0, "max_tokens": 12}
    engine = {"block_size": 4, "max_num_batched_tokens": 24, "max_num_seqs": 3}
    rows = run_job(write_job(tmp_path, model, prompts, sampling=sampling, engine=engine))
    report = json.loads((tmp_path / "out" / ".batchgen" / "report.json").read_text())
    assert report["cpu_kernels"] is native
    ids = [tok(p)["input_ids"] for p in prompts]
    assert min(len(i) for i in ids) > 2 * WINDOW
    expected = hf_greedy(model, ids, 12)
    ref = [{"id": i, "sample_index": 0, "token_ids": e} for i, e in enumerate(expected)]
    compare_samples(rows, ref, model=model, prompts=dict(enumerate(prompts)), sampling=sampling)


def test_prefix_cache_and_forks_across_the_window(window_dirs, tmp_path: Path) -> None:
    """Prompts sharing a prefix longer than the window, n=3 seeded samples forked from one
    prefill: the same samples with the prefix cache on (the prefix computed once) and off, one
    sequence per 5-token step."""
    model = window_dirs["qwen2_window"]
    prefix = " ".join(make_prompts(1, seed=22, min_words=20, max_words=20))
    prompts = make_prompts(3, seed=23, min_words=2, max_words=8, prefix=prefix)
    sampling = {"temperature": 0.9, "max_tokens": 24, "n": 3, "seed": 5, "ignore_eos": True}
    a = samples_with_and_without_prefix_cache(tmp_path, model, prompts, sampling)
    assert len({tuple(r["token_ids"]) for r in a if r["id"] == 0}) > 1  # samples differ
    assert sum(r["num_cached_tokens"] for r in a if r["sample_index"] == 0) > WINDOW


def test_triton_backend_greedy_job_matches_transformers(window_dirs, tmp_path: Path) -> None:
    """Gemma 2 (a local and a global layer, softcaps) on ``attention_backend: triton``: prompts
    of two to three windows, greedy, against ``generate``."""
    from transformers import AutoTokenizer

    model = window_dirs["gemma2"]
    tok = AutoTokenizer.from_pretrained(model)
    prompts = make_prompts(2, seed=24, min_words=16, max_words=24)
    sampling = {"temperature": 0, "max_tokens": 4}
    engine = {"block_size": 4, "max_num_batched_tokens": 32, "attention_backend": "triton"}
    rows = run_job(write_job(tmp_path, model, prompts, sampling=sampling, engine=engine))
    report = json.loads((tmp_path / "out" / ".batchgen" / "report.json").read_text())
    assert report["attention_backend"] == "triton"
    ids = [tok(p)["input_ids"] for p in prompts]
    assert min(len(i) for i in ids) > 2 * WINDOW
    expected = hf_greedy(model, ids, 4)
    ref = [{"id": i, "sample_index": 0, "token_ids": e} for i, e in enumerate(expected)]
    compare_samples(rows, ref, model=model, prompts=dict(enumerate(prompts)), sampling=sampling)
