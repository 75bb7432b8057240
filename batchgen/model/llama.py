"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over a paged KV cache: the model math.

The differences between the four architectures are flags of ``ModelConfig``:

- Qwen2: bias on the q/k/v projections (not on o_proj);
- Qwen3: RMSNorm over each head of q and k (``q_norm``/``k_norm``) before RoPE;
- Llama: optional ``attention_bias`` (q/k/v/o) and ``mlp_bias``;
- Mistral: a sliding window, which we do not implement: the loader caps the usable context at the
  window instead (within the window, windowed and full causal attention are the same).

Tokens are flat: a step is the concatenation of every sequence's new tokens, ``input_ids [T]``,
``positions [T]``; no batch dimension, no padding. q/k/v are fused into one projection, and gate/up
into another (fewer, larger matmuls). How each layer computes (C kernels, MKL-packed GEMMs or
PyTorch ops) is decided once when the model is built, by the ``LayerBackend`` it is given (see
:mod:`batchgen.model.layers`); attention is the ``AttentionBackend``'s.
"""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F
from torch import Tensor, nn

from batchgen.model.attention import AttentionBackend, AttentionMetadata
from batchgen.model.config import ModelConfig
from batchgen.model.layers.activation import silu_mul
from batchgen.model.layers.backend import LayerBackend
from batchgen.model.layers.linear import (
    Linear,
    OneDnnLinear,
    PackedLinear,
    pack_linear,
    pack_linears_,
)
from batchgen.model.layers.norm import rms_norm
from batchgen.model.layers.rotary import Rotary, rotation

__all__ = ["LlamaForCausalLM"]


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
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.q_norm = rms_norm(cfg.head_dim, cfg.rms_norm_eps, layers) if cfg.qk_norm else None
        self.k_norm = rms_norm(cfg.head_dim, cfg.rms_norm_eps, layers) if cfg.qk_norm else None

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
    ) -> Tensor:
        """h ``[T, hidden]`` normed input -> ``residual += o_proj(attention)``, in place.
        cos/sin ``[T, D/2]``; caches ``[num_blocks, block_size, Hkv, D]``; ``plan``: this step's
        ``attention.prepare`` result; scales ``[num_blocks, block_size, Hkv]`` of a quantized
        cache, else None."""
        t = h.shape[0]
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(h)  # [T, (Hq + 2 Hkv) * D]
        v = qkv[:, self.q_size + self.kv_size :].view(t, hkv, d)
        if self.q_norm is None:
            # q and k rotated together, in place in qkv (ours alone)
            qk = self.rope_(qkv[:, : self.q_size + self.kv_size].view(t, hq + hkv, d), cos, sin)
            q, k = qk[:, :hq], qk[:, hq:]  # [T, Hq, D], [T, Hkv, D]
        else:
            assert self.k_norm is not None
            q = self.q_norm(qkv[:, : self.q_size].view(t, hq, d))  # [T, Hq, D]
            k = self.k_norm(qkv[:, self.q_size : self.q_size + self.kv_size].view(t, hkv, d))
            q, k = self.rope_(q, cos, sin), self.rope_(k, cos, sin)
        scales = {} if k_scale is None else {"k_scale": k_scale, "v_scale": v_scale}
        o = self.attention.forward(q, k, v, k_cache, v_cache, plan, self.scale, **scales)
        return self.o_proj.add_(residual, o.reshape(t, self.q_size))


# rows per MLP pass on the CPU (see LlamaMLP.forward)
_MLP_ROWS = 1024


class LlamaMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up fused."""

    def __init__(self, cfg: ModelConfig, layers: LayerBackend) -> None:
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.silu_mul_ = silu_mul(layers)
        # On the CPU, long steps (prefill chunks) go through in slices of this many rows: the
        # [rows, 2I] intermediate then stays in cache between the two GEMMs and SwiGLU (on the
        # benchmark model the MLP ran at 237 GFLOP/s over 8192 rows at once, 283 in 1024-row
        # slices). None: all rows at once.
        self.max_rows = _MLP_ROWS if layers.device.type == "cpu" else None

    def forward(self, x: Tensor, residual: Tensor) -> Tensor:
        """x ``[T, hidden]`` normed input -> ``residual += mlp(x)``, in place."""
        t = x.shape[0]
        if self.max_rows is None or t <= self.max_rows:
            return self._forward(x, residual)
        for i in range(0, t, self.max_rows):
            self._forward(x[i : i + self.max_rows], residual[i : i + self.max_rows])
        return residual

    def _forward(self, x: Tensor, residual: Tensor) -> Tensor:
        act = self.silu_mul_(self.gate_up_proj(x))  # [T, 2I] -> [T, I], in place
        return self.down_proj.add_(residual, act)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(
        self, cfg: ModelConfig, attention: AttentionBackend[Any][Any], layers: LayerBackend
    ) -> None:
        super().__init__()
        self.input_layernorm = rms_norm(cfg.hidden_size, cfg.rms_norm_eps, layers)
        self.self_attn = LlamaAttention(cfg, attention, layers)
        self.post_attention_layernorm = rms_norm(cfg.hidden_size, cfg.rms_norm_eps, layers)
        self.mlp = LlamaMLP(cfg, layers)

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
    ) -> Tensor:
        # x [T, hidden] is the residual stream, owned by the model's forward: updated in place
        h = self.input_layernorm(x)
        self.self_attn(h, cos, sin, k_cache, v_cache, plan, x, k_scale, v_scale)
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
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.rotary = Rotary(cfg.rope, cfg.head_dim, cfg.max_model_len)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, attention, layers) for _ in range(cfg.num_layers)
        )
        self.norm = rms_norm(cfg.hidden_size, cfg.rms_norm_eps, layers)
        self.lm_head: Linear | PackedLinear | OneDnnLinear | None = (
            None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        )

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        kv_cache: Tensor,
        meta: AttentionMetadata,
        kv_scales: Tensor | None = None,
    ) -> Tensor:
        """input_ids ``[T]`` int64, positions ``[T]`` int64, kv_cache
        ``[L, 2, num_blocks, block_size, Hkv, D]`` and, for a quantized (int8 / fp8) cache, its
        scales ``kv_scales [L, 2, num_blocks, block_size, Hkv]`` fp32 -> hidden ``[T, hidden]``
        after the final norm.
        """
        x = self.embed_tokens(input_ids)  # [T, hidden]
        # once per step; the model's dtype, which a quantized cache's is not
        plan = self.attention.prepare(meta, kv_cache, self.cfg.num_heads, x.dtype)
        cos, sin = self.rotary(positions, x.dtype)  # [T, D/2]
        for i, layer in enumerate(self.layers):
            scales = () if kv_scales is None else (kv_scales[i, 0], kv_scales[i, 1])
            x = layer(x, cos, sin, kv_cache[i, 0], kv_cache[i, 1], plan, *scales)
        return self.norm(x)

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
