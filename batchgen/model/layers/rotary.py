"""Rotary position embedding (RoPE): the frequencies of each scaling type, the cos/sin tables,
and the in-place rotation, whose implementation :func:`rotation` chooses once."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor, nn

from batchgen.model.config import RopeConfig
from batchgen.model.cpu_kernels import CpuKernels
from batchgen.model.layers.backend import LayerBackend

__all__ = ["Rotary", "Rotation", "longrope_inv_freq", "rope_", "rope_inv_freq", "rotation"]

# x [T, H, D], cos/sin [T, D/2] -> x rotated in place
Rotation = Callable[[Tensor, Tensor, Tensor], Tensor]


def rope_inv_freq(
    rope: RopeConfig, head_dim: int, max_position_embeddings: int
) -> tuple[Tensor, float]:
    """Inverse frequencies ``[head_dim/2]`` (fp32) and the cos/sin scale (``attention_factor``).

    Follows the published definitions of each scaling type. ``dynamic`` (NTK) rescales only
    beyond ``max_position_embeddings``, which our length cap never reaches: it equals ``default``.
    """
    dim = head_dim
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if rope.freq_factors is not None:
        if len(rope.freq_factors) != dim // 2:
            raise ValueError(f"{len(rope.freq_factors)} RoPE frequency factors for head_dim {dim}")
        inv_freq = inv_freq / torch.tensor(rope.freq_factors, dtype=torch.float32)
    if rope.rope_type in ("default", "dynamic"):
        return inv_freq, 1.0
    if rope.rope_type == "longrope":
        return longrope_inv_freq(rope, dim, max_position_embeddings, long=False)
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


def longrope_inv_freq(
    rope: RopeConfig, dim: int, max_position_embeddings: int, long: bool
) -> tuple[Tensor, float]:
    """LongRoPE's inverse frequencies ``[dim/2]``, divided by its short or ``long`` factors, and
    its cos/sin scale (from ``factor``: ``sqrt(1 + ln(factor) / ln(original))`` above 1)."""
    original = rope.original_max_position_embeddings or max_position_embeddings
    attention_factor = rope.attention_factor
    if attention_factor is None:
        attention_factor = (
            1.0 if rope.factor <= 1.0 else math.sqrt(1 + math.log(rope.factor) / math.log(original))
        )
    factors = rope.long_factor if long else rope.short_factor
    assert factors is not None
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (torch.tensor(factors, dtype=torch.float32) * rope.theta**exponents)
    return inv_freq, float(attention_factor)


class Rotary(nn.Module):
    """The cos/sin tables of every usable position (fp32 ``[max_len, D/2]``, the halves of HF's
    tables, scaled by the rope type's attention factor); ``head_dim`` the rotated dimensions.

    LongRoPE: positions below ``original_max_position_embeddings`` take the short factors, the
    others the long ones. (Transformers chooses one set per forward pass, by its largest
    position: the same as here for a prompt within the original length and every token
    generated after it; a prompt longer than that is all long factors there.)"""

    def __init__(self, rope: RopeConfig, head_dim: int, max_len: int) -> None:
        super().__init__()
        # built on the CPU explicitly, so that building the modules on the meta device still
        # yields real tables (moved to the weights' device by the loader)
        with torch.device("cpu"):
            inv_freq, attention_factor = rope_inv_freq(rope, head_dim, max_len)
            pos = torch.arange(max_len, dtype=torch.float32)
            freqs = pos[:, None] * inv_freq[None, :]  # [max_len, D/2]
            if rope.rope_type == "longrope":
                long, _ = longrope_inv_freq(rope, head_dim, max_len, long=True)
                original = rope.original_max_position_embeddings or max_len
                freqs[original:] = pos[original:, None] * long[None, :]
            cos, sin = freqs.cos() * attention_factor, freqs.sin() * attention_factor
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """positions ``[T]`` int64 -> cos, sin ``[T, D/2]`` in ``dtype``."""
        cos = self.cos.index_select(0, positions).to(dtype)
        sin = self.sin.index_select(0, positions).to(dtype)
        return cos, sin


def rope_(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate-half RoPE in place with PyTorch ops; returns x. x ``[T, H, D]`` (any strides: a
    column slice of qkv); cos/sin ``[T, D/2]``.

    ``x1*c - x2*s`` and ``x2*c + x1*s`` equal HF's ``x*cos + rotate_half(x)*sin`` exactly.
    """
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None], sin[:, None]  # [T, 1, D/2]
    x1_old = x1.clone()
    x1.mul_(c).sub_(x2 * s)
    x2.mul_(c).add_(x1_old * s)
    return x


class CpuRope:
    """:func:`rope_` in the C kernel (CPU fp32 and bf16; bf16 bit for bit :func:`rope_`), for x
    whose rows hold their heads contiguously (any row stride); other layouts take the PyTorch
    ops."""

    def __init__(self, kernels: CpuKernels) -> None:
        self.kernels = kernels

    def __call__(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        if x.stride(2) == 1 and x.stride(1) == x.shape[2]:
            self.kernels.rope_(x, cos, sin)
            return x
        return rope_(x, cos, sin)


def rotation(backend: LayerBackend) -> Rotation:
    """The in-place rotation for the backend's device and dtype."""
    return rope_ if backend.cpu is None else CpuRope(backend.cpu)
