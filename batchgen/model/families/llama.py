"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over a paged KV cache: the model math, the
four architectures' config parsers and their Hugging Face weight names.

The differences between the four architectures are flags of ``ModelConfig``:

- Qwen2: bias on the q/k/v projections (not on o_proj);
- Qwen3: RMSNorm over each head of q and k (``q_norm``/``k_norm``) before RoPE;
- Llama: optional ``attention_bias`` (q/k/v/o) and ``mlp_bias``;
- Mistral: a sliding window in every layer (Qwen2/Qwen3: in the layers ``layer_types`` calls
  sliding); a windowed layer attends to its window's keys only, through the step's attention plan
  for that window (the cache keeps every position: prefix reuse is unchanged).

Tokens are flat: a step is the concatenation of every sequence's new tokens, ``input_ids [T]``,
``positions [T]``; no batch dimension, no padding. q/k/v are fused into one projection, and gate/up
into another (fewer, larger matmuls). How each layer computes (C kernels, MKL-packed GEMMs or
PyTorch ops) is decided once when the model is built, by the ``LayerBackend`` it is given (see
:mod:`batchgen.model.layers`); attention is the ``AttentionBackend``'s.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from batchgen.model.architecture import Architecture, WeightPlan
from batchgen.model.attention import AttentionBackend, AttentionMetadata
from batchgen.model.config import ModelConfig, parse_base, qwen_windows
from batchgen.model.layers.activation import silu_mul
from batchgen.model.layers.backend import LayerBackend
from batchgen.model.layers.linear import (
    Linear,
    PackedLayer,
    pack_linear,
    pack_linears_,
)
from batchgen.model.layers.norm import rms_norm
from batchgen.model.layers.rotary import Rotary, rotation

__all__ = [
    "ARCHITECTURES",
    "layer_plans",
    "LlamaAttention",
    "LlamaDecoderLayer",
    "LlamaForCausalLM",
    "LlamaMLP",
    "attention_weights",
    "dense_mlp_weights",
    "model_weights",
]


class LlamaAttention(nn.Module):
    """Fused q/k/v projection, optional per-head q/k norm, RoPE, paged attention, o_proj."""

    def __init__(
        self, cfg: ModelConfig, attention: AttentionBackend[Any][Any], layers: LayerBackend
    ) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.attention = attention
        self.rope_ = rotation(layers)
        self.rotary_dim = cfg.rotary_dim  # the first dimensions of each head; < D: partial
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.q_norm = rms_norm(cfg.head_dim, cfg.rms_norm_eps, layers) if cfg.qk_norm else None
        self.k_norm = rms_norm(cfg.head_dim, cfg.rms_norm_eps, layers) if cfg.qk_norm else None
        self.sinks: nn.Parameter | None = None  # [Hq] sink logits (gpt-oss sets them)

    def forward(
        self,
        h: Tensor,
        cos: Tensor,
        sin: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        plan: Any,
        residual: Tensor,
        k_scale: Tensor | None = None,
        v_scale: Tensor | None = None,
        keep: Tensor | None = None,
    ) -> Tensor:
        """h ``[T, hidden]`` normed input -> ``residual += o_proj(attention)``, in place.
        cos/sin ``[T, D/2]``; caches ``[num_blocks, block_size, Hkv, D]``; ``plan``: this step's
        ``attention.prepare`` result; scales ``[num_blocks, block_size, Hkv]`` of a quantized
        cache, else None. ``keep [K]`` int64 (None: every row): o_proj runs at these rows only
        and ``residual`` is ``[K, hidden]``; every row's K/V is stored all the same."""
        t = h.shape[0]
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(h)  # [T, (Hq + 2 Hkv) * D]
        v = qkv[:, self.q_size + self.kv_size :].view(t, hkv, d)
        if self.q_norm is None:
            # q and k rotated together, in place in qkv (ours alone)
            qk = qkv[:, : self.q_size + self.kv_size].view(t, hq + hkv, d)
            if self.rotary_dim < d:
                self.rope_(qk[..., : self.rotary_dim], cos, sin)
            else:
                self.rope_(qk, cos, sin)
            q, k = qk[:, :hq], qk[:, hq:]  # [T, Hq, D], [T, Hkv, D]
        else:
            assert self.k_norm is not None
            q = self.q_norm(qkv[:, : self.q_size].view(t, hq, d))  # [T, Hq, D]
            k = self.k_norm(qkv[:, self.q_size : self.q_size + self.kv_size].view(t, hkv, d))
            q, k = self.rope_(q, cos, sin), self.rope_(k, cos, sin)
        extra = {} if k_scale is None else {"k_scale": k_scale, "v_scale": v_scale}
        if self.sinks is not None:
            extra["sinks"] = self.sinks
        o = self.attention.forward(q, k, v, k_cache, v_cache, plan, self.scale, **extra)
        o = o.reshape(t, self.q_size)
        if keep is not None:
            o = o[keep]  # [K, Hq * D]
        if o.shape[0] == 0:
            return residual
        return self.o_proj.add_(residual, o)


def layer_plans(
    attention: AttentionBackend[Any],
    cfg: ModelConfig,
    meta: AttentionMetadata,
    kv_cache: Tensor,
    dtype: torch.dtype,
    softcap: float | None = None,
) -> list[Any]:
    """Each layer's attention plan of the step, prepared once per distinct window (in the
    model's ``dtype``, which a quantized cache's is not; ``softcap``: the model's attention
    logit cap)."""
    plans: dict[int | None, Any] = {}
    out = []
    for i in range(cfg.num_layers):
        w = cfg.window(i)
        if w not in plans:
            extra = {} if softcap is None else {"softcap": softcap}
            plans[w] = attention.prepare(meta, kv_cache, cfg.num_heads, dtype, window=w, **extra)
        out.append(plans[w])
    return out


# rows per MLP pass on the CPU (see LlamaMLP.forward): _MLP_ROWS, or _MLP_WIDE_ROWS where the
# [_MLP_ROWS, 2I] intermediate would pass _MLP_WIDE_BYTES
_MLP_ROWS = 1024
_MLP_WIDE_ROWS = 160
_MLP_WIDE_BYTES = 16 << 20


def mlp_rows(intermediate: int, dtype: torch.dtype) -> int:
    """Rows per MLP pass on the CPU for an MLP of width ``intermediate`` in ``dtype``."""
    wide = 2 * intermediate * dtype.itemsize * _MLP_ROWS > _MLP_WIDE_BYTES
    return min(_MLP_ROWS, _MLP_WIDE_ROWS) if wide else _MLP_ROWS


def in_row_slices(
    forward: Callable[[Tensor, Tensor], Tensor], x: Tensor, residual: Tensor, max_rows: int | None
) -> Tensor:
    """``forward(x, residual)`` (which adds into ``residual`` in place) over ``x [T, hidden]`` in
    slices of at most ``max_rows`` rows (None: all at once); returns ``residual``."""
    t = x.shape[0]
    if max_rows is None or t <= max_rows:
        return forward(x, residual)
    for i in range(0, t, max_rows):
        forward(x[i : i + max_rows], residual[i : i + max_rows])
    return residual


class LlamaMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up fused; ``intermediate`` overrides the
    config's width (a MoE model's shared expert)."""

    def __init__(
        self, cfg: ModelConfig, layers: LayerBackend, intermediate: int | None = None
    ) -> None:
        super().__init__()
        inter = cfg.intermediate_size if intermediate is None else intermediate
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * inter, bias=cfg.mlp_bias)
        self.down_proj = Linear(inter, cfg.hidden_size, bias=cfg.mlp_bias)
        self.silu_mul_ = silu_mul(layers)
        # On the CPU, long steps (prefill chunks) go through in slices of this many rows: the
        # [rows, 2I] intermediate then stays in cache between the two GEMMs and SwiGLU (on the
        # benchmark model the MLP ran at 237 GFLOP/s over 8192 rows at once, 283 in 1024-row
        # slices, AVX-512; on an AVX2-only EPYC in fp32 it ran 3-5% faster in slices of 1024
        # than of 512, while Qwen2.5-0.5B's, I = 4864, ran 1.15x as fast in slices of 160 as of
        # 320 and 1.20x as of 1024). None: all rows at once.
        cpu = layers.device.type == "cpu"
        self.max_rows = mlp_rows(inter, layers.dtype) if cpu else None

    def forward(self, x: Tensor, residual: Tensor) -> Tensor:
        """x ``[T, hidden]`` normed input -> ``residual += mlp(x)``, in place."""
        return in_row_slices(self._forward, x, residual, self.max_rows)

    def _forward(self, x: Tensor, residual: Tensor) -> Tensor:
        act = self.silu_mul_(self.gate_up_proj(x))  # [T, 2I] -> [T, I], in place
        return self.down_proj.add_(residual, act)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x)). ``mlp`` is any module with
    ``forward(x, residual) -> residual += f(x)`` (a dense SwiGLU, or a MoE model's experts)."""

    def __init__(
        self,
        cfg: ModelConfig,
        attention: AttentionBackend[Any][Any],
        layers: LayerBackend,
        mlp: nn.Module,
    ) -> None:
        super().__init__()
        self.input_layernorm = rms_norm(cfg.hidden_size, cfg.rms_norm_eps, layers)
        self.self_attn = LlamaAttention(cfg, attention, layers)
        self.post_attention_layernorm = rms_norm(cfg.hidden_size, cfg.rms_norm_eps, layers)
        self.mlp = mlp

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
        # x [T, hidden] is the residual stream, owned by the model's forward: updated in place.
        # With ``keep [K]`` the result is that of the kept rows only, [K, hidden] (a new tensor).
        h = self.input_layernorm(x)
        if keep is not None:
            x = x[keep]
        self.self_attn(h, cos, sin, k_cache, v_cache, plan, x, k_scale, v_scale, keep)
        if x.shape[0] == 0:
            return x
        return self.mlp(self.post_attention_layernorm(x), residual=x)


class LlamaForCausalLM(nn.Module):
    """The decoder stack plus the LM head (tied to the embedding when the config says so).

    Parameter names (our state dict): ``embed_tokens.weight``, ``layers.{i}.input_layernorm.weight``,
    ``layers.{i}.self_attn.qkv_proj.{weight,bias}``, ``layers.{i}.self_attn.o_proj.{weight,bias}``,
    ``layers.{i}.self_attn.{q,k}_norm.weight``, ``layers.{i}.post_attention_layernorm.weight``,
    ``layers.{i}.mlp.gate_up_proj.{weight,bias}``, ``layers.{i}.mlp.down_proj.{weight,bias}``,
    ``norm.weight``, ``lm_head.weight`` (absent when tied).
    """

    def __init__(
        self, cfg: ModelConfig, attention: AttentionBackend[Any][Any], layers: LayerBackend
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.attention = attention
        self.layer_backend = layers
        # built without a random init (``_weight``): the loader assigns the weights, and an init
        # under the meta device imports torch._dynamo (0.85 s of every run's start-up)
        self.embed_tokens = nn.Embedding(
            cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size, cfg.hidden_size)
        )
        self.rotary = Rotary(cfg.rope, cfg.rotary_dim, cfg.max_model_len)
        self.layers = nn.ModuleList(
            self.make_layer(cfg, i, attention, layers) for i in range(cfg.num_layers)
        )
        self.norm = self.make_norm(cfg, layers)
        self.lm_head: Linear | PackedLayer | None = (
            None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        )

    def make_layer(
        self, cfg: ModelConfig, index: int, attention: AttentionBackend[Any], layers: LayerBackend
    ) -> nn.Module:
        """Decoder layer ``index`` (another family's block overrides this)."""
        return LlamaDecoderLayer(cfg, attention, layers, self.make_mlp(cfg, index, layers))

    @staticmethod
    def make_norm(cfg: ModelConfig, layers: LayerBackend) -> nn.Module:
        """The final norm."""
        return rms_norm(cfg.hidden_size, cfg.rms_norm_eps, layers)

    @staticmethod
    def make_mlp(cfg: ModelConfig, index: int, layers: LayerBackend) -> nn.Module:
        """The MLP of layer ``index``: a dense SwiGLU (a MoE model overrides this)."""
        return LlamaMLP(cfg, layers)

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        kv_cache: Tensor,
        meta: AttentionMetadata,
        kv_scales: Tensor | None = None,
        keep: Tensor | None = None,
    ) -> Tensor:
        """input_ids ``[T]`` int64, positions ``[T]`` int64, kv_cache
        ``[L, 2, num_blocks, block_size, Hkv, D]`` and, for a quantized (int8 / fp8) cache, its
        scales ``kv_scales [L, 2, num_blocks, block_size, Hkv]`` fp32 -> hidden ``[T, hidden]``
        after the final norm.

        ``keep [K]`` int64, sorted and unique (None: every row): the rows whose hidden states are
        wanted; the result is theirs, ``[K, hidden]``. The last layer computes its o_proj, MLP
        and residual at those rows only (in a prefill, one row per sequence that samples); every
        layer still stores every row's K/V. A row's values are those it has without ``keep``
        wherever a GEMM's rows do not depend on how many there are (batchgen's own kernels).
        """
        x = self.embed(input_ids)  # [T, hidden]
        plans = layer_plans(self.attention, self.cfg, meta, kv_cache, x.dtype, self.attn_softcap)
        ropes = self.layer_ropes(positions, x.dtype)
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            scales = (None, None) if kv_scales is None else (kv_scales[i, 0], kv_scales[i, 1])
            cos, sin = ropes[i]
            rows = keep if i == last else None
            x = layer(x, cos, sin, kv_cache[i, 0], kv_cache[i, 1], plans[i], *scales, rows)
        return self.norm(x) if x.shape[0] else x

    # the attention logit cap of every layer (Gemma 2 sets one)
    attn_softcap: float | None = None

    def embed(self, input_ids: Tensor) -> Tensor:
        """input_ids ``[T]`` -> the input embeddings ``[T, hidden]``."""
        return self.embed_tokens(input_ids)

    def layer_ropes(self, positions: Tensor, dtype: torch.dtype) -> list[tuple[Tensor, Tensor]]:
        """Each layer's RoPE cos/sin ``[T, D/2]`` of the step (one table for all here)."""
        rope = self.rotary(positions, dtype)
        return [rope] * self.cfg.num_layers

    def pack_weights(self) -> int:
        """Pre-pack the linear weights for the layer backend's GEMM (MKL or oneDNN), if it has
        one; a tied LM head gets a packed copy of the embedding. Returns how many were packed."""
        gemm = self.layer_backend.gemm
        if gemm is None:
            return 0
        count = pack_linears_(self, gemm)
        if self.lm_head is None:  # packed as a copy; the embedding keeps its own weight
            self.lm_head = pack_linear(self.embed_tokens.weight, None, gemm)
            count += 1
        return count

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """hidden ``[S, hidden]`` -> logits ``[S, vocab]`` float32."""
        if self.lm_head is None:
            return F.linear(hidden, self.embed_tokens.weight).float()
        return self.lm_head(hidden).float()


# --------------------------------------------------------------------------------------------
# Hugging Face weight names (config.json's tensor names -> our parameters)
# --------------------------------------------------------------------------------------------


def attention_weights(cfg: ModelConfig, i: int, plan: WeightPlan) -> None:
    """Add layer ``i``'s norms and attention (q/k/v fused; biases and q/k norms as the config
    says) to ``plan``."""
    h, d = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
    hf, ours = f"model.layers.{i}.", f"layers.{i}."
    attn = hf + "self_attn."
    src, shapes = plan.sources, plan.shapes
    src[ours + "input_layernorm.weight"] = [hf + "input_layernorm.weight"]
    src[ours + "post_attention_layernorm.weight"] = [hf + "post_attention_layernorm.weight"]
    src[ours + "self_attn.qkv_proj.weight"] = [attn + f"{p}_proj.weight" for p in "qkv"]
    src[ours + "self_attn.o_proj.weight"] = [attn + "o_proj.weight"]
    shapes |= {
        hf + "input_layernorm.weight": (h,),
        hf + "post_attention_layernorm.weight": (h,),
        attn + "q_proj.weight": (q, h),
        attn + "k_proj.weight": (kv, h),
        attn + "v_proj.weight": (kv, h),
        attn + "o_proj.weight": (h, q),
    }
    if cfg.qkv_bias:
        src[ours + "self_attn.qkv_proj.bias"] = [attn + f"{p}_proj.bias" for p in "qkv"]
        shapes |= {attn + "q_proj.bias": (q,), attn + "k_proj.bias": (kv,)}
        shapes |= {attn + "v_proj.bias": (kv,)}
    if cfg.o_bias:
        src[ours + "self_attn.o_proj.bias"] = [attn + "o_proj.bias"]
        shapes[attn + "o_proj.bias"] = (h,)
    if cfg.qk_norm:
        src[ours + "self_attn.q_norm.weight"] = [attn + "q_norm.weight"]
        src[ours + "self_attn.k_norm.weight"] = [attn + "k_norm.weight"]
        shapes |= {attn + "q_norm.weight": (d,), attn + "k_norm.weight": (d,)}


def dense_mlp_weights(
    cfg: ModelConfig, hf: str, ours: str, plan: WeightPlan, intermediate: int | None = None
) -> None:
    """Add a SwiGLU MLP (HF ``{hf}gate_proj``/``up_proj``/``down_proj``, our ``{ours}gate_up_proj``
    and ``down_proj``) of width ``intermediate`` (default: the config's) to ``plan``."""
    h = cfg.hidden_size
    inter = cfg.intermediate_size if intermediate is None else intermediate
    src, shapes = plan.sources, plan.shapes
    src[ours + "gate_up_proj.weight"] = [hf + "gate_proj.weight", hf + "up_proj.weight"]
    src[ours + "down_proj.weight"] = [hf + "down_proj.weight"]
    shapes |= {
        hf + "gate_proj.weight": (inter, h),
        hf + "up_proj.weight": (inter, h),
        hf + "down_proj.weight": (h, inter),
    }
    if cfg.mlp_bias:
        src[ours + "gate_up_proj.bias"] = [hf + "gate_proj.bias", hf + "up_proj.bias"]
        src[ours + "down_proj.bias"] = [hf + "down_proj.bias"]
        shapes |= {hf + "gate_proj.bias": (inter,), hf + "up_proj.bias": (inter,)}
        shapes |= {hf + "down_proj.bias": (h,)}


def model_weights(cfg: ModelConfig, layer: Callable[[int, WeightPlan], None]) -> WeightPlan:
    """The embedding, final norm and LM head (unless tied), plus ``layer(i, plan)`` for every
    layer."""
    h = cfg.hidden_size
    plan = WeightPlan(
        sources={
            "embed_tokens.weight": ["model.embed_tokens.weight"],
            "norm.weight": ["model.norm.weight"],
        },
        shapes={
            "model.embed_tokens.weight": (cfg.vocab_size, h),
            "model.norm.weight": (h,),
        },
    )
    if not cfg.tie_word_embeddings:
        plan.sources["lm_head.weight"] = ["lm_head.weight"]
        plan.shapes["lm_head.weight"] = (cfg.vocab_size, h)
    for i in range(cfg.num_layers):
        layer(i, plan)
    return plan


def _weights(cfg: ModelConfig, has: Callable[[str], bool]) -> WeightPlan:
    """Every dense layer: attention and one SwiGLU MLP."""

    def layer(i: int, plan: WeightPlan) -> None:
        attention_weights(cfg, i, plan)
        dense_mlp_weights(cfg, f"model.layers.{i}.mlp.", f"layers.{i}.mlp.", plan)

    return model_weights(cfg, layer)


# --------------------------------------------------------------------------------------------
# config.json -> ModelConfig (defaults: those of the HF config classes)
# --------------------------------------------------------------------------------------------


def _parse_llama(raw: dict[str, Any], path: Path) -> ModelConfig:
    # attention_bias covers q/k/v/o; only Llama has mlp_bias
    base = parse_base(raw, path, max_position_embeddings=2048, window=None)
    bias = bool(raw.get("attention_bias", False))
    mlp_bias = bool(raw.get("mlp_bias", False))
    return dataclasses.replace(base, qkv_bias=bias, o_bias=bias, mlp_bias=mlp_bias)


def _parse_mistral(raw: dict[str, Any], path: Path) -> ModelConfig:
    # no biases; a sliding window of 4096 unless the config says otherwise
    window = raw.get("sliding_window", 4096)
    return parse_base(raw, path, max_position_embeddings=4096 * 32, window=window)


def _parse_qwen2(raw: dict[str, Any], path: Path) -> ModelConfig:
    # q/k/v always have a bias, o_proj never
    base = parse_base(raw, path, max_position_embeddings=32768, window=qwen_windows(raw))
    return dataclasses.replace(base, qkv_bias=True)


def _parse_qwen3(raw: dict[str, Any], path: Path) -> ModelConfig:
    # per-head q/k RMSNorm; attention_bias covers q/k/v/o
    base = parse_base(raw, path, max_position_embeddings=32768, window=qwen_windows(raw))
    bias = bool(raw.get("attention_bias", False))
    return dataclasses.replace(base, qkv_bias=bias, o_bias=bias, qk_norm=True)


ARCHITECTURES = (
    Architecture("LlamaForCausalLM", _parse_llama, LlamaForCausalLM, _weights),
    Architecture("MistralForCausalLM", _parse_mistral, LlamaForCausalLM, _weights),
    Architecture("Qwen2ForCausalLM", _parse_qwen2, LlamaForCausalLM, _weights),
    Architecture("Qwen3ForCausalLM", _parse_qwen3, LlamaForCausalLM, _weights),
)
