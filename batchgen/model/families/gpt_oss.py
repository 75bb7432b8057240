"""gpt-oss (``GptOssForCausalLM``): the Llama-family decoder with attention sinks, alternating
windowed and full layers, and a mixture of experts in every layer.

- attention: q/k/v/o biases; a learned sink logit per query head (one more softmax term with no
  value: :class:`batchgen.model.attention.AttentionBackend`'s ``sinks``); ``layer_types`` (by
  default even layers sliding, window ``sliding_window`` 128, odd layers full); YaRN RoPE;
- MoE: a router with a bias, softmax over the top-k logits; experts with biases and a clamped
  SwiGLU, ``(clamp(up, -L, L) + 1) * g * sigmoid(alpha * g)`` with ``g = clamp(gate, max=L)``
  (``swiglu_alpha`` 1.702, ``swiglu_limit`` 7), on :class:`FusedExperts`;
- checkpoints: transformers' layout (experts ``gate_up_proj [E, H, 2I]`` with gate and up
  columns interleaved, ``down_proj [E, I, H]``, biases), or MXFP4 experts (``*_blocks`` and
  ``*_scales``, ``quantization_config.quant_method: mxfp4``), dequantized at load.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from batchgen.errors import ModelError
from batchgen.model.architecture import Architecture, WeightPlan
from batchgen.model.attention import AttentionBackend
from batchgen.model.config import ModelConfig, layer_windows, parse_base, req_int
from batchgen.model.families.llama import LlamaDecoderLayer, attention_weights, model_weights
from batchgen.model.families.moe import MoeForCausalLM, SparseMoeBlock, moe_config
from batchgen.model.layers.backend import LayerBackend
from batchgen.model.layers.linear import Linear
from batchgen.model.layers.moe import FusedExperts

__all__ = ["ARCHITECTURE", "GptOssConfig", "clamped_swiglu_", "mxfp4_dequantize"]


@dataclass(frozen=True)
class GptOssConfig(ModelConfig):
    """gpt-oss's config: the base plus its experts' activation."""

    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0


def clamped_swiglu_(gate_up: Tensor, alpha: float, limit: float) -> Tensor:
    """gate_up ``[n, 2I]`` (gate, then up) -> ``(clamp(up, -L, L) + 1) * g * sigmoid(alpha * g)``
    with ``g = clamp(gate, max=L)``, ``[n, I]``, written into the first half of gate_up."""
    inter = gate_up.shape[1] // 2
    gate, up = gate_up[:, :inter], gate_up[:, inter:]
    gate.clamp_(max=limit)
    glu = gate * torch.sigmoid(gate * alpha)
    return gate.copy_(up.clamp(-limit, limit).add_(1).mul_(glu))


class GptOssMoeBlock(SparseMoeBlock):
    """The router (with a bias) and biased experts with the clamped SwiGLU."""

    def __init__(self, cfg: ModelConfig, layers: LayerBackend) -> None:
        super().__init__(cfg, layers)
        assert isinstance(cfg, GptOssConfig) and cfg.moe is not None
        self.gate = Linear(cfg.hidden_size, cfg.moe.num_experts, bias=True)
        act = functools.partial(clamped_swiglu_, alpha=cfg.swiglu_alpha, limit=cfg.swiglu_limit)
        self.experts = FusedExperts(
            cfg.moe.num_experts, cfg.hidden_size, cfg.moe.intermediate_size, layers, True, act
        )


class GptOssForCausalLM(MoeForCausalLM):
    """Parameter names: :class:`MoeForCausalLM`'s (router ``layers.{i}.mlp.gate.{weight,bias}``,
    experts ``layers.{i}.mlp.experts.{gate_up_proj,down_proj,gate_up_bias,down_bias}``) plus
    ``layers.{i}.self_attn.sinks`` [Hq]."""

    def make_layer(
        self, cfg: ModelConfig, index: int, attention: AttentionBackend[Any], layers: LayerBackend
    ) -> nn.Module:
        layer = LlamaDecoderLayer(cfg, attention, layers, GptOssMoeBlock(cfg, layers))
        layer.self_attn.sinks = nn.Parameter(torch.empty(cfg.num_heads))
        return layer


# --------------------------------------------------------------------------------------------
# config.json and weights
# --------------------------------------------------------------------------------------------


_DEFAULT_ROPE = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}


def _parse(raw: dict[str, Any], path: Path) -> GptOssConfig:
    num_layers = req_int(raw, "num_hidden_layers", path)
    layer_types = raw.get("layer_types") or [
        "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers)
    ]
    quant = raw.get("quantization_config")
    if quant and quant.get("quant_method") != "mxfp4":
        raise ModelError(
            f"unsupported quantization {quant.get('quant_method')!r} in {path}; supported: mxfp4"
        )
    if not (raw.get("rope_parameters") or raw.get("rope_scaling")):  # transformers' default
        raw = raw | {"rope_parameters": _DEFAULT_ROPE}
    base = parse_base(
        raw,
        path,
        max_position_embeddings=131072,
        window=layer_windows(layer_types, raw.get("sliding_window", 128)),
        rope_theta=150000.0,
        rms_norm_eps=1e-5,
    )
    bias = bool(raw.get("attention_bias", True))
    base = dataclasses.replace(base, qkv_bias=bias, o_bias=bias)
    moe = moe_config(
        {k: v for k, v in raw.items() if k not in ("decoder_sparse_step", "mlp_only_layers")},
        path,
        base.num_layers,
        num_experts=128,
        top_k=4,
        intermediate_size=base.intermediate_size,
        renormalize=True,  # softmax over the top-k logits
    )
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
    return GptOssConfig(
        **(fields | {"moe": moe}),
        swiglu_alpha=float(raw.get("swiglu_alpha", 1.702)),
        swiglu_limit=float(raw.get("swiglu_limit", 7.0)),
    )


# e2m1 (fp4) values of the 16 codes
_FP4 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def mxfp4_dequantize(blocks: Tensor, scales: Tensor, dtype: torch.dtype) -> Tensor:
    """MXFP4 ``blocks [..., G, 16]`` (two fp4 codes a byte, the low nibble first) and ``scales
    [..., G]`` (power-of-two exponents biased by 127), as integers in any dtype, -> ``[..., G *
    32]`` in ``dtype``: each group of 32 values is its codes' e2m1 values times ``2^(scale -
    127)``."""
    codes = blocks.to(torch.int32)
    lut = torch.tensor(_FP4, dtype=torch.float32, device=blocks.device)
    values = torch.stack((lut[codes & 0x0F], lut[codes >> 4]), dim=-1)  # [..., G, 16, 2]
    values = values.flatten(-2)  # [..., G, 32]
    exponents = scales.to(torch.int32) - 127
    out = torch.ldexp(values, exponents[..., None].float())
    return out.flatten(-2).to(dtype)


def _deinterleave(t: Tensor, dim: int) -> Tensor:
    """gate/up interleaved along ``dim`` (gate at even indices) -> all gates, then all ups."""
    idx = torch.arange(t.shape[dim], device=t.device)
    order = torch.cat((idx[0::2], idx[1::2]))
    return t.index_select(dim, order).contiguous()


def _weights(cfg: ModelConfig, has: Callable[[str], bool]) -> WeightPlan:
    assert cfg.moe is not None
    h, inter, e_count, hq = (
        cfg.hidden_size,
        cfg.moe.intermediate_size,
        cfg.moe.num_experts,
        cfg.num_heads,
    )

    def layer(i: int, plan: WeightPlan) -> None:
        attention_weights(cfg, i, plan)
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        src, shapes, tf = plan.sources, plan.shapes, plan.transforms
        src[ours + "self_attn.sinks"] = [hf + "self_attn.sinks"]
        shapes[hf + "self_attn.sinks"] = (hq,)
        mlp, mine = hf + "mlp.", ours + "mlp."
        for p, shape in (("weight", (e_count, h)), ("bias", (e_count,))):
            src[mine + f"gate.{p}"] = [mlp + f"router.{p}"]
            shapes[mlp + f"router.{p}"] = shape
        ex = mlp + "experts."
        src[mine + "experts.gate_up_bias"] = [ex + "gate_up_proj_bias"]
        shapes[ex + "gate_up_proj_bias"] = (e_count, 2 * inter)
        tf[mine + "experts.gate_up_bias"] = lambda p: _deinterleave(p[0], 1)
        src[mine + "experts.down_bias"] = [ex + "down_proj_bias"]
        shapes[ex + "down_proj_bias"] = (e_count, h)
        if has(ex + "gate_up_proj_blocks"):  # MXFP4: [E, rows, cols / 32, 16] and [.., cols / 32]
            for name, rows, cols in (("gate_up_proj", 2 * inter, h), ("down_proj", h, inter)):
                src[mine + "experts." + name] = [ex + name + "_blocks", ex + name + "_scales"]
                shapes[ex + name + "_blocks"] = (e_count, rows, cols // 32, 16)
                shapes[ex + name + "_scales"] = (e_count, rows, cols // 32)
            tf[mine + "experts.gate_up_proj"] = lambda p: _deinterleave(
                mxfp4_dequantize(p[0], p[1], p[0].dtype), 1
            )
            tf[mine + "experts.down_proj"] = lambda p: mxfp4_dequantize(p[0], p[1], p[0].dtype)
            return
        # transformers' layout: [E, H, 2I] (x @ W) with gate and up interleaved, [E, I, H]
        src[mine + "experts.gate_up_proj"] = [ex + "gate_up_proj"]
        shapes[ex + "gate_up_proj"] = (e_count, h, 2 * inter)
        tf[mine + "experts.gate_up_proj"] = lambda p: _deinterleave(p[0].transpose(1, 2), 1)
        src[mine + "experts.down_proj"] = [ex + "down_proj"]
        shapes[ex + "down_proj"] = (e_count, inter, h)
        tf[mine + "experts.down_proj"] = lambda p: p[0].transpose(1, 2).contiguous()

    return model_weights(cfg, layer)


ARCHITECTURE = Architecture("GptOssForCausalLM", _parse, GptOssForCausalLM, _weights)
