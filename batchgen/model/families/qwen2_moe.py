"""Qwen2-MoE (``Qwen2MoeForCausalLM``, e.g. Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2 attention
(bias on q/k/v unless ``qkv_bias`` is false, none on o), and in sparse layers a softmax router,
the top ``num_experts_per_tok`` experts (renormalized when ``norm_topk_prob``) of width
``moe_intermediate_size``, plus a shared expert of width ``shared_expert_intermediate_size``
that every token goes through, scaled by ``sigmoid(shared_expert_gate(x))``. Checkpoint names:
``mlp.gate.weight``, ``mlp.experts.{e}.{gate,up,down}_proj.weight`` (or transformers' fused
``mlp.experts.gate_up_proj`` / ``down_proj``), ``mlp.shared_expert.{gate,up,down}_proj.weight``,
``mlp.shared_expert_gate.weight``."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from batchgen.model.architecture import Architecture, WeightPlan
from batchgen.model.config import ModelConfig, parse_base, qwen_windows
from batchgen.model.families.moe import ExpertNames, MoeForCausalLM, moe_config, moe_weights

__all__ = ["ARCHITECTURE"]

_NAMES = ExpertNames(block="mlp.", gate="gate_proj", up="up_proj", down="down_proj")


def _parse(raw: dict[str, Any], path: Path) -> ModelConfig:
    # without layer_types, transformers windows the even layers below max_window_layers
    first = raw.get("max_window_layers", 28)
    windows = qwen_windows(raw, lambda i: i % 2 == 0 and i < first)
    base = parse_base(raw, path, max_position_embeddings=32768, window=windows)
    moe = moe_config(
        raw,
        path,
        base.num_layers,
        num_experts=60,
        top_k=4,
        intermediate_size=raw.get("moe_intermediate_size", 1408),
        renormalize=bool(raw.get("norm_topk_prob", False)),
        shared_expert_intermediate_size=raw.get("shared_expert_intermediate_size", 5632),
    )
    return dataclasses.replace(base, qkv_bias=bool(raw.get("qkv_bias", True)), moe=moe)


def _weights(cfg: ModelConfig, has: Callable[[str], bool]) -> WeightPlan:
    return moe_weights(cfg, has, _NAMES)


ARCHITECTURE = Architecture("Qwen2MoeForCausalLM", _parse, MoeForCausalLM, _weights)
