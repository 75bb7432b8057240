"""Qwen3-MoE (``Qwen3MoeForCausalLM``, e.g. Qwen3-30B-A3B): Qwen3 attention (per-head q/k
RMSNorm, ``attention_bias`` on q/k/v/o), and in sparse layers a softmax router over
``num_experts``, the top ``num_experts_per_tok`` experts (weights renormalized when
``norm_topk_prob``), experts of width ``moe_intermediate_size``; dense SwiGLU layers of
``intermediate_size`` where ``decoder_sparse_step`` / ``mlp_only_layers`` say so. Checkpoint
names: ``mlp.gate.weight``, ``mlp.experts.{e}.{gate,up,down}_proj.weight`` (or transformers'
fused ``mlp.experts.gate_up_proj`` / ``down_proj``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from batchgen.model.architecture import Architecture, WeightPlan
from batchgen.model.config import ModelConfig, parse_base
from batchgen.model.families.moe import ExpertNames, MoeForCausalLM, moe_config, moe_weights

__all__ = ["ARCHITECTURE"]

_NAMES = ExpertNames(block="mlp.", gate="gate_proj", up="up_proj", down="down_proj")


def _parse(raw: dict[str, Any], path: Path) -> ModelConfig:
    # transformers windows every layer when use_sliding_window is set (no layer_types)
    window = raw.get("sliding_window") if raw.get("use_sliding_window") else None
    base = parse_base(raw, path, max_position_embeddings=32768, window=window)
    bias = bool(raw.get("attention_bias", False))
    moe = moe_config(
        raw,
        path,
        base.num_layers,
        num_experts=128,
        top_k=8,
        intermediate_size=raw.get("moe_intermediate_size", 768),
        renormalize=bool(raw.get("norm_topk_prob", False)),
    )
    return dataclasses.replace(base, qkv_bias=bias, o_bias=bias, qk_norm=True, moe=moe)


def _weights(cfg: ModelConfig, has: Callable[[str], bool]) -> WeightPlan:
    return moe_weights(cfg, has, _NAMES)


ARCHITECTURE = Architecture("Qwen3MoeForCausalLM", _parse, MoeForCausalLM, _weights)
