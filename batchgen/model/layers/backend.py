"""Which implementation the model's layers run, decided once when the model is built."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchgen.model import cpu_kernels, packed_linear
from batchgen.model.cpu_kernels import CpuKernels
from batchgen.model.packed_linear import Mkl

__all__ = ["LayerBackend"]


@dataclass(frozen=True)
class LayerBackend:
    """The implementations available to the layers of a model whose weights live on ``device``
    in ``dtype`` (the modules themselves are built on the meta device, then loaded).

    ``cpu``: the C kernels of :mod:`batchgen.model.cpu_kernels` (RMSNorm, RoPE, SwiGLU), on CPU
    fp32 when they could be built; ``mkl``: MKL's packed GEMM (:mod:`batchgen.model.packed_linear`)
    for the linear layers, on CPU fp32 when torch exports it. None: the PyTorch ops.
    """

    device: torch.device
    dtype: torch.dtype
    cpu: CpuKernels | None = None
    mkl: Mkl | None = None

    @classmethod
    def select(cls, device: torch.device, dtype: torch.dtype, native: bool = True) -> LayerBackend:
        """The fastest implementations available here; ``native=False``: PyTorch ops only."""
        if not native:
            return cls(device, dtype)
        return cls(
            device,
            dtype,
            cpu=cpu_kernels.for_dtype(device, dtype),
            mkl=packed_linear.for_dtype(device, dtype),
        )
