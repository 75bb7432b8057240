"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over a paged KV cache.

One readable file, our own modules. The differences between the four architectures are flags of
``ModelConfig``:

- Qwen2: bias on the q/k/v projections (not on o_proj);
- Qwen3: RMSNorm over each head of q and k (``q_norm``/``k_norm``) before RoPE;
- Llama: optional ``attention_bias`` (q/k/v/o) and ``mlp_bias``;
- Mistral: a sliding window, which we do not implement: the loader caps the usable context at the
  window instead (within the window, windowed and full causal attention are the same).

Tokens are flat: a step is the concatenation of every sequence's new tokens, ``input_ids [T]``,
``positions [T]``; no batch dimension, no padding. q/k/v are fused into one projection, and gate/up
into another (fewer, larger matmuls).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from batchgen.model import cpu_kernels
from batchgen.model.attention import AttentionBackend, AttentionMetadata
from batchgen.model.cpu_kernels import CpuKernels
from batchgen.model.packed_linear import linear, linear_add_, pack_, packing_available

__all__ = ["RopeConfig", "ModelConfig", "LlamaForCausalLM", "rope_inv_freq"]

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters (HF ``rope_parameters`` / legacy ``rope_scaling``)."""

    rope_type: str = "default"
    theta: float = 10000.0
    factor: float = 1.0
    # llama3
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    # yarn
    attention_factor: float | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True


@dataclass(frozen=True)
class ModelConfig:
    """Everything needed to build the modules (parsed from config.json by the loader)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_model_len: int  # positions 0..max_model_len-1 are usable (RoPE tables cover them)
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    rope: RopeConfig


def rope_inv_freq(
    rope: RopeConfig, head_dim: int, max_position_embeddings: int
) -> tuple[Tensor, float]:
    """Inverse frequencies ``[head_dim/2]`` (fp32) and the cos/sin scale (``attention_factor``).

    Follows the published definitions of each scaling type. ``dynamic`` (NTK) rescales only
    beyond ``max_position_embeddings``, which our length cap never reaches: it equals ``default``.
    """
    dim = head_dim
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if rope.rope_type in ("default", "dynamic"):
        return inv_freq, 1.0
    if rope.rope_type == "linear":
        return inv_freq / rope.factor, 1.0
    original = rope.original_max_position_embeddings or max_position_embeddings
    if rope.rope_type == "llama3":
        low_wavelen = original / rope.low_freq_factor
        high_wavelen = original / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        # long wavelengths are divided by the factor, short ones kept, the middle interpolated
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (original / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    if rope.rope_type == "yarn":
        factor = rope.factor

        def mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if rope.attention_factor is not None:
            attention_factor = rope.attention_factor
        elif rope.mscale and rope.mscale_all_dim:
            attention_factor = mscale(factor, rope.mscale) / mscale(factor, rope.mscale_all_dim)
        else:
            attention_factor = mscale(factor)

        def correction_dim(rotations: float) -> float:
            return (dim * math.log(original / (rotations * 2 * math.pi))) / (
                2 * math.log(rope.theta)
            )

        low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
        if rope.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        extrapolation = 1 - ramp  # 1: keep the frequency, 0: interpolate (divide by factor)
        pos_freqs = rope.theta ** (torch.arange(0, dim, 2).float() / dim)
        inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
        return inv, float(attention_factor)
    raise ValueError(f"unsupported rope type {rope.rope_type!r}")


class RMSNorm(nn.Module):
    """RMSNorm over the last dimension, computed in fp32, then scaled in the input dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        native = _native(x)
        if native is not None and x.stride(-1) == 1 and self.weight.dtype == torch.float32:
            return native.rms_norm(x, self.weight, self.eps)  # one pass over x
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def _native(x: Tensor) -> CpuKernels | None:
    """The C kernels for CPU fp32 tensors, when they could be built; else None (PyTorch ops)."""
    return cpu_kernels.for_dtype(x.device, x.dtype)


def rope_(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate-half RoPE in place; returns x. x ``[T, H, D]`` (heads of a row contiguous, any row
    stride: a column slice of qkv); cos/sin ``[T, D/2]`` (the halves of HF's tables).

    ``x1*c - x2*s`` and ``x2*c + x1*s`` equal HF's ``x*cos + rotate_half(x)*sin`` exactly.
    """
    native = _native(x)
    if native is not None and x.stride(2) == 1 and x.stride(1) == x.shape[2]:
        native.rope_(x, cos, sin)
        return x
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None], sin[:, None]  # [T, 1, D/2]
    x1_old = x1.clone()
    x1.mul_(c).sub_(x2 * s)
    x2.mul_(c).add_(x1_old * s)
    return x


class LlamaAttention(nn.Module):
    """Fused q/k/v projection, optional per-head q/k norm, RoPE, paged attention, o_proj."""

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.backend = backend
        self.qkv_proj = nn.Linear(
            cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias
        )
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(
        self,
        h: Tensor,
        cos: Tensor,
        sin: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        meta: AttentionMetadata,
        residual: Tensor,
    ) -> Tensor:
        """h ``[T, hidden]`` normed input -> ``residual += o_proj(attention)``, in place."""
        t = h.shape[0]
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = linear(h, self.qkv_proj)  # [T, (Hq + 2 Hkv) * D]
        v = qkv[:, self.q_size + self.kv_size :].view(t, hkv, d)
        if self.q_norm is None:
            # q and k rotated together, in place in qkv (ours alone)
            qk = rope_(qkv[:, : self.q_size + self.kv_size].view(t, hq + hkv, d), cos, sin)
            q, k = qk[:, :hq], qk[:, hq:]  # [T, Hq, D], [T, Hkv, D]
        else:
            assert self.k_norm is not None
            q = self.q_norm(qkv[:, : self.q_size].view(t, hq, d))
            k = self.k_norm(qkv[:, self.q_size : self.q_size + self.kv_size].view(t, hkv, d))
            q, k = rope_(q, cos, sin), rope_(k, cos, sin)
        o = self.backend.forward(q, k, v, k_cache, v_cache, meta, self.scale)  # [T, Hq, D]
        return linear_add_(residual, o.reshape(t, self.q_size), self.o_proj)


# rows per MLP pass on the CPU (see LlamaMLP.forward)
_MLP_ROWS = 1024


class LlamaMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up fused."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: Tensor, residual: Tensor) -> Tensor:
        """x ``[T, hidden]`` normed input -> ``residual += mlp(x)``, in place.

        On the CPU, long steps (prefill chunks) go through in slices of ``_MLP_ROWS`` rows: the
        ``[rows, 2I]`` intermediate then stays in cache between the two GEMMs and SwiGLU (on the
        benchmark model the MLP ran at 237 GFLOP/s over 8192 rows at once, 283 in 1024-row slices).
        """
        t = x.shape[0]
        if t <= _MLP_ROWS or x.device.type != "cpu":
            return self._forward(x, residual)
        for i in range(0, t, _MLP_ROWS):
            self._forward(x[i : i + _MLP_ROWS], residual[i : i + _MLP_ROWS])
        return residual

    def _forward(self, x: Tensor, residual: Tensor) -> Tensor:
        gate_up = linear(x, self.gate_up_proj)  # [T, 2I]
        native = _native(gate_up)
        if native is not None and gate_up.is_contiguous():
            act = native.silu_mul_(gate_up)  # one pass, in place
        else:
            gate, up = gate_up[:, : self.intermediate_size], gate_up[:, self.intermediate_size :]
            # in place: no new [T, I] buffers (inference only; gate_up is ours alone)
            act = F.silu(gate, inplace=True).mul_(up)
        return linear_add_(residual, act, self.down_proj)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg, backend)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg)

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        meta: AttentionMetadata,
    ) -> Tensor:
        # x is the residual stream, owned by the model's forward: updated in place
        self.self_attn(self.input_layernorm(x), cos, sin, k_cache, v_cache, meta, residual=x)
        return self.mlp(self.post_attention_layernorm(x), residual=x)


class LlamaForCausalLM(nn.Module):
    """The decoder stack plus the LM head (tied to the embedding when the config says so).

    Parameter names (our state dict): ``embed_tokens.weight``, ``layers.{i}.input_layernorm.weight``,
    ``layers.{i}.self_attn.qkv_proj.{weight,bias}``, ``layers.{i}.self_attn.o_proj.{weight,bias}``,
    ``layers.{i}.self_attn.{q,k}_norm.weight``, ``layers.{i}.post_attention_layernorm.weight``,
    ``layers.{i}.mlp.gate_up_proj.{weight,bias}``, ``layers.{i}.mlp.down_proj.{weight,bias}``,
    ``norm.weight``, ``lm_head.weight`` (absent when tied).
    """

    def __init__(self, cfg: ModelConfig, attention: AttentionBackend) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, attention) for _ in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        )
        # RoPE tables [max_model_len, D/2], fp32, always built on the CPU first (explicit device,
        # so that building the modules on the meta device still yields real tables).
        with torch.device("cpu"):
            cos, sin = self._rope_tables(cfg)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    @staticmethod
    def _rope_tables(cfg: ModelConfig) -> tuple[Tensor, Tensor]:
        inv_freq, attention_factor = rope_inv_freq(cfg.rope, cfg.head_dim, cfg.max_model_len)
        pos = torch.arange(cfg.max_model_len, dtype=torch.float32)
        freqs = pos[:, None] * inv_freq[None, :]  # [max_len, D/2]
        return freqs.cos() * attention_factor, freqs.sin() * attention_factor

    def forward(
        self, input_ids: Tensor, positions: Tensor, kv_cache: Tensor, meta: AttentionMetadata
    ) -> Tensor:
        """input_ids ``[T]`` int64, positions ``[T]`` int64, kv_cache
        ``[L, 2, num_blocks, block_size, Hkv, D]`` -> hidden ``[T, hidden]`` after the final norm.
        """
        x = self.embed_tokens(input_ids)  # [T, hidden]
        cos = self.rope_cos.index_select(0, positions).to(x.dtype)  # [T, D/2]
        sin = self.rope_sin.index_select(0, positions).to(x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, kv_cache[i, 0], kv_cache[i, 1], meta)
        return self.norm(x)

    def pack_weights(self) -> int:
        """Pre-pack the linear weights for the CPU GEMM where possible (:mod:`packed_linear`);
        a tied LM head gets a packed copy of the embedding. Returns how many were packed."""
        embed = self.embed_tokens.weight
        if self.lm_head is None and packing_available(embed.device, embed.dtype):
            self.lm_head = nn.Linear(
                self.cfg.hidden_size, self.cfg.vocab_size, bias=False, device="meta"
            )
            self.lm_head.weight = embed  # packed as a copy; the embedding keeps its own
        return pack_(self)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """hidden ``[S, hidden]`` -> logits ``[S, vocab]`` float32."""
        if self.lm_head is None:
            return F.linear(hidden, self.embed_tokens.weight).float()
        return linear(hidden, self.lm_head).float()
