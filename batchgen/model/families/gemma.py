"""Gemma 2 and Gemma 3 (text) decoders: the Llama-family attention and MLP with Gemma's changes.

- local (sliding-window) and global layers by ``layer_types`` (default: Gemma 2 alternates,
  starting local; Gemma 3 has five local layers to one global); Gemma 3's two RoPE bases (local
  layers: ``rope_local_base_freq`` / ``rope_parameters.sliding_attention``, global ones:
  ``rope_theta`` / ``rope_parameters.full_attention``, with its scaling);
- RMSNorm of ``(1 + weight)`` (:class:`OffsetRMSNorm`), before and after attention and before
  and after the MLP: ``x += post_attn_norm(attn(norm(x)))``, ``x += post_ff_norm(mlp(pre_ff_norm(x)))``;
- Gemma 3: per-head q/k norms before RoPE;
- GeGLU MLP (``gelu_tanh(gate) * up``), embeddings scaled by ``sqrt(hidden)`` (rounded to the
  model dtype), attention scale ``query_pre_attn_scalar ** -0.5``;
- Gemma 2 (and Gemma 3 configs that set them): attention logits capped by
  ``c * tanh(s / c)`` (``attn_logit_softcapping``) and the final logits likewise
  (``final_logit_softcapping``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from batchgen.errors import ModelError
from batchgen.model.architecture import Architecture, WeightPlan
from batchgen.model.attention import AttentionBackend
from batchgen.model.config import (
    ModelConfig,
    RopeConfig,
    layer_windows,
    parse_base,
    parse_rope,
    req_int,
)
from batchgen.model.families.llama import (
    LlamaAttention,
    LlamaForCausalLM,
    LlamaMLP,
    attention_weights,
    dense_mlp_weights,
    model_weights,
)
from batchgen.model.layers.activation import gelu_tanh_mul_
from batchgen.model.layers.backend import LayerBackend
from batchgen.model.layers.norm import OffsetRMSNorm
from batchgen.model.layers.rotary import Rotary

__all__ = ["ARCHITECTURES", "GemmaConfig", "GemmaForCausalLM"]


@dataclass(frozen=True)
class GemmaConfig(ModelConfig):
    """A Gemma model's config: the base plus Gemma's own settings."""

    query_pre_attn_scalar: float = 256.0
    local_rope: RopeConfig | None = None  # windowed layers' RoPE; None: ``rope`` everywhere
    attn_softcap: float | None = None
    final_softcap: float | None = None


def _gemma_cfg(cfg: ModelConfig) -> GemmaConfig:
    assert isinstance(cfg, GemmaConfig)
    return cfg


class GemmaAttention(LlamaAttention):
    """Llama's attention with Gemma's scale and ``(1 + weight)`` q/k norms."""

    def __init__(self, cfg: ModelConfig, attention: AttentionBackend[Any], layers: LayerBackend):
        super().__init__(cfg, attention, layers)
        self.scale = _gemma_cfg(cfg).query_pre_attn_scalar ** -0.5
        if cfg.qk_norm:
            self.q_norm = OffsetRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = OffsetRMSNorm(cfg.head_dim, cfg.rms_norm_eps)


class GemmaMLP(LlamaMLP):
    """GeGLU: down(gelu_tanh(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig, layers: LayerBackend) -> None:
        super().__init__(cfg, layers)
        self.silu_mul_ = gelu_tanh_mul_


class GemmaDecoderLayer(nn.Module):
    """Norms before and after both attention and the MLP (sandwich norms)."""

    def __init__(
        self, cfg: ModelConfig, attention: AttentionBackend[Any], layers: LayerBackend
    ) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = OffsetRMSNorm(h, eps)
        self.self_attn = GemmaAttention(cfg, attention, layers)
        self.post_attention_layernorm = OffsetRMSNorm(h, eps)
        self.pre_feedforward_layernorm = OffsetRMSNorm(h, eps)
        self.mlp = GemmaMLP(cfg, layers)
        self.post_feedforward_layernorm = OffsetRMSNorm(h, eps)

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        plan: Any,
        k_scale: Tensor | None = None,
        v_scale: Tensor | None = None,
        keep: Tensor | None = None,
    ) -> Tensor:
        # x [T, hidden]; with ``keep [K]`` the result is that of the kept rows only (see
        # LlamaDecoderLayer). The attention and the MLP add into a residual: given zeros, they
        # return their output.
        h = self.input_layernorm(x)
        if keep is not None:
            x = x[keep]
        a = self.self_attn(
            h, cos, sin, k_cache, v_cache, plan, torch.zeros_like(x), k_scale, v_scale, keep
        )
        if x.shape[0] == 0:
            return x
        x = x + self.post_attention_layernorm(a)
        m = self.mlp(self.pre_feedforward_layernorm(x), residual=torch.zeros_like(x))
        return x + self.post_feedforward_layernorm(m)


class GemmaForCausalLM(LlamaForCausalLM):
    """The Gemma 2 / 3 decoder stack (parameter names as Llama's, plus each layer's
    ``pre_feedforward_layernorm`` and ``post_feedforward_layernorm``)."""

    def __init__(
        self, cfg: ModelConfig, attention: AttentionBackend[Any], layers: LayerBackend
    ) -> None:
        super().__init__(cfg, attention, layers)
        gcfg = _gemma_cfg(cfg)
        self.attn_softcap = gcfg.attn_softcap
        self.rotary_local = (
            None
            if gcfg.local_rope is None
            else Rotary(gcfg.local_rope, cfg.head_dim, cfg.max_model_len)
        )

    def make_layer(
        self, cfg: ModelConfig, index: int, attention: AttentionBackend[Any], layers: LayerBackend
    ) -> nn.Module:
        return GemmaDecoderLayer(cfg, attention, layers)

    @staticmethod
    def make_norm(cfg: ModelConfig, layers: LayerBackend) -> nn.Module:
        return OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def embed(self, input_ids: Tensor) -> Tensor:
        """The embeddings times ``sqrt(hidden)``, that factor rounded to their dtype (as HF)."""
        x = self.embed_tokens(input_ids)
        return x * torch.tensor(self.cfg.hidden_size**0.5, dtype=x.dtype)

    def layer_ropes(self, positions: Tensor, dtype: torch.dtype) -> list[tuple[Tensor, Tensor]]:
        """Windowed (local) layers take the local table, if the config has one."""
        rope = self.rotary(positions, dtype)
        local = rope if self.rotary_local is None else self.rotary_local(positions, dtype)
        return [local if self.cfg.window(i) else rope for i in range(self.cfg.num_layers)]

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """hidden ``[S, hidden]`` -> logits ``[S, vocab]`` float32, capped when the config
        says so."""
        logits = super().compute_logits(hidden)
        cap = _gemma_cfg(self.cfg).final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap


# --------------------------------------------------------------------------------------------
# config.json and weight names
# --------------------------------------------------------------------------------------------


def _parse(raw: dict[str, Any], path: Path, *, gemma3: bool) -> GemmaConfig:
    act = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise ModelError(
            f"unsupported hidden_activation {act!r} in {path}; supported: gelu_pytorch_tanh"
        )
    if raw.get("use_bidirectional_attention"):
        raise ModelError(f"unsupported config.json {path}: use_bidirectional_attention")
    num_layers = req_int(raw, "num_hidden_layers", path)
    layer_types = raw.get("layer_types")
    if layer_types is None:  # HF's defaults: Gemma 3 five local to one global, Gemma 2 alternating
        period = raw.get("sliding_window_pattern", 6) if gemma3 else 2
        layer_types = [
            "sliding_attention" if (i + 1) % period else "full_attention" for i in range(num_layers)
        ]
    if len(layer_types) != num_layers:
        raise ModelError(f"invalid config.json {path}: {len(layer_types)} layer_types")
    max_pos = raw.get("max_position_embeddings") or (131072 if gemma3 else 8192)
    params = raw.get("rope_parameters")
    per_type = isinstance(params, dict) and (
        "full_attention" in params or "sliding_attention" in params
    )
    common = {k: v for k, v in raw.items() if k not in ("hidden_act", "rope_parameters")}
    local_rope = None
    if gemma3:
        if per_type:
            assert isinstance(params, dict)
            global_raw = common | {"rope_parameters": params.get("full_attention") or {}}
            local_raw = {"rope_parameters": params.get("sliding_attention") or {}}
        else:
            global_raw = raw
            local_raw = {"rope_theta": raw.get("rope_local_base_freq", 10000.0)}
        common = global_raw | {"hidden_act": "silu"}
        local_rope = parse_rope(local_raw, path, max_pos, 10000.0)
    elif per_type:
        raise ModelError(f"unsupported config.json {path}: per-layer-type rope_parameters")
    else:
        common = {**raw, "hidden_act": "silu"}
    base = parse_base(
        common,
        path,
        max_position_embeddings=max_pos,
        window=layer_windows(layer_types, raw.get("sliding_window", 4096)),
        rope_theta=1e6 if gemma3 else 10000.0,
    )
    bias = bool(raw.get("attention_bias", False))
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
    fields |= dict(
        qkv_bias=bias,
        o_bias=bias,
        qk_norm=gemma3,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
    )
    return GemmaConfig(
        **fields,
        query_pre_attn_scalar=float(raw.get("query_pre_attn_scalar", 256)),
        local_rope=local_rope,
        attn_softcap=_opt_cap(raw.get("attn_logit_softcapping", None if gemma3 else 50.0)),
        final_softcap=_opt_cap(raw.get("final_logit_softcapping", None if gemma3 else 30.0)),
    )


def _opt_cap(value: Any) -> float | None:
    return float(value) if value else None


def _weights(cfg: ModelConfig, has: Callable[[str], bool]) -> WeightPlan:
    """Llama's names plus the norms after attention and around the MLP."""

    def layer(i: int, plan: WeightPlan) -> None:
        attention_weights(cfg, i, plan)
        dense_mlp_weights(cfg, f"model.layers.{i}.mlp.", f"layers.{i}.mlp.", plan)
        for norm in ("pre_feedforward_layernorm", "post_feedforward_layernorm"):
            plan.sources[f"layers.{i}.{norm}.weight"] = [f"model.layers.{i}.{norm}.weight"]
            plan.shapes[f"model.layers.{i}.{norm}.weight"] = (cfg.hidden_size,)

    return model_weights(cfg, layer)


def _parse_gemma2(raw: dict[str, Any], path: Path) -> ModelConfig:
    return _parse(raw, path, gemma3=False)


def _parse_gemma3(raw: dict[str, Any], path: Path) -> ModelConfig:
    return _parse(raw, path, gemma3=True)


ARCHITECTURES = (
    Architecture("Gemma2ForCausalLM", _parse_gemma2, GemmaForCausalLM, _weights),
    Architecture("Gemma3ForCausalLM", _parse_gemma3, GemmaForCausalLM, _weights),
)
