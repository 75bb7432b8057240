"""transformers as the independent reference: greedy continuations and teacher-forced logits of
the tiny models (fp32), and the architectures the engine and job tests build."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

# arch -> make_tiny_model kwargs: GQA with a head_dim that is not hidden/heads (llama), MHA with
# tied embeddings (mistral), MQA (qwen2), q/k norms with 8 heads (qwen3)
ARCHS: dict[str, dict] = {
    "llama": dict(num_heads=4, num_kv_heads=2, head_dim=24),
    "mistral": dict(num_heads=4, num_kv_heads=4, tie_word_embeddings=True),
    "qwen2": dict(num_heads=4, num_kv_heads=1),
    "qwen3": dict(num_heads=8, num_kv_heads=2, head_dim=16),
}

# Mixture-of-experts arch -> make_tiny_model kwargs (2 layers, hidden 64): Qwen3-MoE with 8
# experts, top 2, renormalized, layer 1 dense (mlp_only_layers); Qwen2-MoE with 6 experts, top
# 3, not renormalized, a shared expert, layer 0 dense (decoder_sparse_step 2); Mixtral with 4
# experts, top 2, both layers sparse.
MOE_ARCHS: dict[str, dict] = {
    "qwen3_moe": dict(
        num_heads=8,
        num_kv_heads=2,
        head_dim=16,
        config_overrides=dict(
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            mlp_only_layers=[1],
        ),
    ),
    "qwen2_moe": dict(
        num_heads=4,
        num_kv_heads=2,
        config_overrides=dict(
            num_experts=6,
            num_experts_per_tok=3,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            decoder_sparse_step=2,
        ),
    ),
    "mixtral": dict(
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=48,
        config_overrides=dict(num_local_experts=4, num_experts_per_tok=2),
    ),
}

# Sliding-window arch -> tiny_model kwargs (arch included; 2 layers, hidden 64, windows of 16
# tokens): Mistral with every layer windowed (GQA 4:2), Qwen2 with layer 0 sliding and layer 1
# full (MHA 4:4); Gemma 2 and 3 with a local and a global layer, query_pre_attn_scalar not
# head_dim, Gemma 2's softcaps low enough to matter, Gemma 3's two RoPE bases
_GEMMA = dict(
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    tie_word_embeddings=True,
    config_overrides=dict(
        sliding_window=16,
        layer_types=["sliding_attention", "full_attention"],
        query_pre_attn_scalar=24,
    ),
)
WINDOW_ARCHS: dict[str, dict] = {
    "gemma2": _GEMMA
    | dict(
        arch="gemma2",
        config_overrides=_GEMMA["config_overrides"]
        | dict(attn_logit_softcapping=5.0, final_logit_softcapping=10.0),
    ),
    "gemma3": _GEMMA | dict(arch="gemma3"),
    "mistral_window": dict(
        arch="mistral", num_heads=4, num_kv_heads=2, config_overrides=dict(sliding_window=16)
    ),
    "qwen2_window": dict(
        arch="qwen2",
        num_heads=4,
        num_kv_heads=4,
        config_overrides=dict(
            use_sliding_window=True,
            sliding_window=16,
            layer_types=["sliding_attention", "full_attention"],
        ),
    ),
}

# Phi-3 with a window of 16, half of each head rotated and LongRoPE from position 32 on (its
# logits past 32 are transformers' as generation computes them: hf_logits_decoding)
PHI3: dict = dict(
    arch="phi3",
    num_heads=4,
    num_kv_heads=2,
    max_position_embeddings=128,
    config_overrides=dict(
        sliding_window=16,
        original_max_position_embeddings=32,
        rope_parameters=dict(
            rope_type="longrope",
            rope_theta=10000.0,
            partial_rotary_factor=0.5,
            short_factor=[1.0, 1.3, 2.1, 3.7],
            long_factor=[1.7, 2.9, 4.3, 9.1],
        ),
    ),
)


# gpt-oss: 4 experts, top 2, biases, a sliding (16) and a full layer, sinks, YaRN
GPT_OSS: dict = dict(
    arch="gpt_oss",
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    intermediate_size=32,
    config_overrides=dict(
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=16,
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=150000.0,
            factor=4.0,
            beta_fast=32.0,
            beta_slow=1.0,
            truncate=False,
            original_max_position_embeddings=128,
        ),
    ),
)


def hf_model(model: str | Path, dtype: torch.dtype = torch.float32):
    """transformers' model of a model folder, or of a ``.gguf`` file (read by transformers' own
    GGUF loader: dequantized into ``dtype``), in eval mode."""
    from transformers import AutoModelForCausalLM

    path = Path(model)
    if path.suffix == ".gguf":
        hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    else:
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return hf.eval()


def hf_greedy(model_dir: Path, prompt_ids: list[list[int]], max_new: int) -> list[list[int]]:
    """transformers' greedy ``generate`` of each prompt alone: the new token ids (up to
    ``max_new``, ending early at the model's EOS)."""
    hf = hf_model(model_dir)
    outs = []
    for ids in prompt_ids:
        x = torch.tensor([ids])
        with torch.no_grad():
            y = hf.generate(
                x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=max_new
            )
        outs.append(y[0, len(ids) :].tolist())
    return outs


def hf_logits_decoding(model_dir: Path, seqs: list[list[int]], prompt: int) -> list[torch.Tensor]:
    """transformers' teacher-forced logits of each sequence alone as generation computes them:
    the first ``prompt`` tokens in one forward pass, then one token per pass through its cache
    (for RoPE types whose tables depend on the pass's length: LongRoPE)."""
    hf = hf_model(model_dir)
    outs = []
    with torch.no_grad():
        for s in seqs:
            first = hf(torch.tensor([s[:prompt]]), use_cache=True)
            rows, cache = [first.logits[0]], first.cache
            for tok in s[prompt:]:
                step = hf(torch.tensor([[tok]]), cache=cache, use_cache=True)
                rows.append(step.logits[0])
                cache = step.cache
            outs.append(torch.cat(rows).float())
    return outs


def hf_logits(model_dir: Path | Any, seqs: list[list[int]]) -> list[torch.Tensor]:
    """transformers' teacher-forced logits of each sequence alone, ``[len, vocab]`` fp32;
    ``model_dir``: a model folder or ``.gguf`` file, or a model :func:`hf_model` already read."""
    hf = hf_model(model_dir) if isinstance(model_dir, str | Path) else model_dir
    with torch.no_grad():
        return [hf(torch.tensor([s])).logits[0].float() for s in seqs]
