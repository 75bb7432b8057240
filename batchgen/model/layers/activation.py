"""SwiGLU's activation ``silu(gate) * up``, in place, its implementation chosen once by
:func:`silu_mul`."""

from __future__ import annotations

from collections.abc import Callable

import torch.nn.functional as F
from torch import Tensor

from batchgen.model.cpu_kernels import CpuKernels
from batchgen.model.layers.backend import LayerBackend

__all__ = ["CpuSiluMul", "SiluMul", "gelu_tanh_mul_", "silu_mul", "silu_mul_"]

# gate_up [T, 2I] -> silu(gate) * up [T, I], computed in place in gate_up
SiluMul = Callable[[Tensor], Tensor]


def silu_mul_(gate_up: Tensor) -> Tensor:
    """PyTorch ops: gate_up ``[T, 2I]`` (gate, then up) -> ``silu(gate) * up`` ``[T, I]``, a
    view of the first half of gate_up, which it overwrites (no new ``[T, I]`` buffers)."""
    inter = gate_up.shape[1] // 2
    gate, up = gate_up[:, :inter], gate_up[:, inter:]
    return F.silu(gate, inplace=True).mul_(up)


def gelu_tanh_mul_(gate_up: Tensor) -> Tensor:
    """GeGLU's activation (Gemma): gate_up ``[T, 2I]`` -> ``gelu_tanh(gate) * up`` ``[T, I]``
    in the first half of gate_up, like :func:`silu_mul_`."""
    inter = gate_up.shape[1] // 2
    gate, up = gate_up[:, :inter], gate_up[:, inter:]
    return gate.copy_(F.gelu(gate, approximate="tanh")).mul_(up)


class CpuSiluMul:
    """:func:`silu_mul_` in the C kernel (CPU fp32 and bf16, one pass; bf16 rounded where the
    PyTorch ops round) for contiguous gate_up; other layouts take the PyTorch ops."""

    def __init__(self, kernels: CpuKernels) -> None:
        self.kernels = kernels

    def __call__(self, gate_up: Tensor) -> Tensor:
        if gate_up.is_contiguous():
            return self.kernels.silu_mul_(gate_up)
        return silu_mul_(gate_up)


def silu_mul(backend: LayerBackend) -> SiluMul:
    """The SwiGLU activation for the backend's device and dtype."""
    return silu_mul_ if backend.cpu is None else CpuSiluMul(backend.cpu)
