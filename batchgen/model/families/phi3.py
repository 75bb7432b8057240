"""Phi-3 and Phi-4-mini (``Phi3ForCausalLM``): the Llama-family decoder with Phi's checkpoint
layout and RoPE.

- q/k/v come fused in the checkpoint (``qkv_proj``), and so do gate/up (``gate_up_proj``, gate
  first): our fused parameters take them as they are;
- ``partial_rotary_factor``: RoPE rotates the first fraction of each head's dimensions only
  (Phi-4-mini: 3/4);
- LongRoPE (``rope_type`` ``longrope``, legacy ``su``): per-frequency short factors below
  ``original_max_position_embeddings``, long ones from there on, cos/sin scaled by
  ``sqrt(1 + ln(factor) / ln(original))`` (see :class:`batchgen.model.layers.rotary.Rotary`);
- ``sliding_window``, when set, in every layer (as Mistral).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from batchgen.model.architecture import Architecture, WeightPlan
from batchgen.model.config import ModelConfig, parse_base
from batchgen.model.families.llama import LlamaForCausalLM, model_weights

__all__ = ["ARCHITECTURE"]


def _parse(raw: dict[str, Any], path: Path) -> ModelConfig:
    params = raw.get("rope_parameters") or raw.get("rope_scaling")
    if isinstance(params, dict) and (params.get("rope_type") or params.get("type")) in (
        "su",
        "yarn",
    ):
        # transformers reads Phi-3's older names for LongRoPE so
        params = {k: v for k, v in params.items() if k != "type"} | {"rope_type": "longrope"}
        raw = {k: v for k, v in raw.items() if k != "rope_scaling"} | {"rope_parameters": params}
    return parse_base(
        raw,
        path,
        max_position_embeddings=4096,
        window=raw.get("sliding_window"),
        rms_norm_eps=1e-5,
        partial_rotary=True,
    )


def _weights(cfg: ModelConfig, has: Callable[[str], bool]) -> WeightPlan:
    """Llama's parameters from Phi's fused tensors."""
    h, d, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d

    def layer(i: int, plan: WeightPlan) -> None:
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        names = {
            "input_layernorm.weight": (h,),
            "post_attention_layernorm.weight": (h,),
            "self_attn.qkv_proj.weight": (q + 2 * kv, h),
            "self_attn.o_proj.weight": (h, q),
            "mlp.gate_up_proj.weight": (2 * inter, h),
            "mlp.down_proj.weight": (h, inter),
        }
        for name, shape in names.items():
            plan.sources[ours + name] = [hf + name]
            plan.shapes[hf + name] = shape

    return model_weights(cfg, layer)


ARCHITECTURE = Architecture("Phi3ForCausalLM", _parse, LlamaForCausalLM, _weights)
