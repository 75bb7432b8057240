"""Mixtral (``MixtralForCausalLM``, e.g. Mixtral-8x7B): Mistral attention (no biases; an attention
window only when ``sliding_window`` is set), and in every layer a softmax router over
``num_local_experts`` (8), the top ``num_experts_per_tok`` (2) experts, their weights a softmax
over the selected experts' logits (the top-k probabilities renormalized), experts of width
``intermediate_size``. RoPE theta defaults to 1e6. Checkpoint names:
``block_sparse_moe.gate.weight``, ``block_sparse_moe.experts.{e}.w1/w3/w2.weight`` (gate, up,
down), or transformers' fused ``mlp.gate.weight``, ``mlp.experts.gate_up_proj`` / ``down_proj``."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from batchgen.model.architecture import Architecture, WeightPlan
from batchgen.model.config import ModelConfig, parse_base
from batchgen.model.families.moe import ExpertNames, MoeForCausalLM, moe_config, moe_weights

__all__ = ["ARCHITECTURE"]

_NAMES = ExpertNames(block="block_sparse_moe.", gate="w1", up="w3", down="w2")


def _parse(raw: dict[str, Any], path: Path) -> ModelConfig:
    base = parse_base(
        raw,
        path,
        max_position_embeddings=4096 * 32,
        window=raw.get("sliding_window"),
        rope_theta=1e6,
        rms_norm_eps=1e-5,
    )
    # every layer sparse: Mixtral has no decoder_sparse_step or mlp_only_layers
    raw_experts = {
        k: v for k, v in raw.items() if k not in ("decoder_sparse_step", "mlp_only_layers")
    }
    moe = moe_config(
        raw_experts,
        path,
        base.num_layers,
        num_experts=8,
        top_k=2,
        intermediate_size=base.intermediate_size,
        renormalize=True,
    )
    return dataclasses.replace(base, moe=moe)


def _weights(cfg: ModelConfig, has: Callable[[str], bool]) -> WeightPlan:
    return moe_weights(cfg, has, _NAMES)


ARCHITECTURE = Architecture("MixtralForCausalLM", _parse, MoeForCausalLM, _weights)
