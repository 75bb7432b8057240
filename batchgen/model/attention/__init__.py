"""Paged attention: the step metadata, the backend interface and its two implementations.

Backends first write the new K/V into the cache at ``slot_mapping``, then attend over the cache.
``TorchAttention`` is the CPU production path (PyTorch, plus the C kernels of
:mod:`batchgen.model.cpu_kernels` on CPU fp32 and bf16 caches); ``TritonAttention`` calls the
kernels in ``batchgen.kernels`` (imported at its first call: nothing here needs Triton).

- ``metadata``: ``AttentionMetadata`` (one engine step) and the ``AttentionBackend`` protocol;
- ``torch_plan``: the torch backend's per-step plan (groups, cascades, kernel shares);
- ``torch_backend``: ``TorchAttention``, which runs such a plan;
- ``triton_backend``: ``TritonAttention``.
"""

from __future__ import annotations

from typing import Any

from batchgen.model.attention.metadata import AttentionBackend, AttentionMetadata
from batchgen.model.attention.torch_backend import TorchAttention
from batchgen.model.attention.torch_plan import TorchAttentionPlan
from batchgen.model.attention.triton_backend import TritonAttention

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "TorchAttention",
    "TorchAttentionPlan",
    "TritonAttention",
    "make_attention_backend",
]


def make_attention_backend(name: str) -> AttentionBackend[Any]:
    """``"torch"`` or ``"triton"`` (the job's ``engine.attention_backend`` after resolving auto)."""
    if name == "torch":
        return TorchAttention()
    if name == "triton":
        return TritonAttention()
    raise ValueError(f"unknown attention backend {name!r}; expected 'torch' or 'triton'")
