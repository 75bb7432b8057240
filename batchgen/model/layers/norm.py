"""RMSNorm, in three implementations chosen once by :func:`rms_norm`."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from batchgen.model.cpu_kernels import CpuKernels
from batchgen.model.layers.backend import LayerBackend

__all__ = ["CpuRMSNorm", "FusedRMSNorm", "OffsetRMSNorm", "RMSNorm", "rms_norm"]


class RMSNorm(nn.Module):
    """RMSNorm over the last dimension, computed in fp32, then scaled in the input dtype (the
    Hugging Face formula; used for half-precision models)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        """x ``[..., dim]`` -> ``[..., dim]``."""
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class FusedRMSNorm(RMSNorm):
    """fp32 models: torch's ``F.rms_norm``."""

    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class CpuRMSNorm(RMSNorm):
    """CPU fp32 and bf16 models: the C kernel, one pass over x (bf16: rounded where the HF
    formula rounds). Inputs whose last dimension is strided, which the model never passes, take
    ``F.rms_norm`` (fp32) or the HF formula (bf16)."""

    def __init__(self, dim: int, eps: float, kernels: CpuKernels) -> None:
        super().__init__(dim, eps)
        self.kernels = kernels

    def forward(self, x: Tensor) -> Tensor:
        if x.stride(-1) != 1:
            if x.dtype == torch.float32:
                return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
            return super().forward(x)
        return self.kernels.rms_norm(x, self.weight, self.eps)


class OffsetRMSNorm(RMSNorm):
    """Gemma's RMSNorm: the weight is stored as an offset from 1, and the product with
    ``1 + weight`` is taken in fp32 before rounding to the input dtype (the HF formula)."""

    def forward(self, x: Tensor) -> Tensor:
        """x ``[..., dim]`` -> ``[..., dim]``."""
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)


def rms_norm(dim: int, eps: float, backend: LayerBackend) -> RMSNorm:
    """The RMSNorm implementation for the backend's device and dtype."""
    if backend.cpu is not None:
        return CpuRMSNorm(dim, eps, backend.cpu)
    if backend.dtype == torch.float32:
        return FusedRMSNorm(dim, eps)
    return RMSNorm(dim, eps)
