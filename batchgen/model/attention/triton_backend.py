"""Paged attention through the Triton kernels of ``batchgen.kernels``."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from batchgen.model.attention.metadata import AttentionMetadata

__all__ = ["TritonAttention", "TritonPlan"]


@dataclass(frozen=True)
class TritonPlan:
    """The step's metadata plus the layers' window and softcap (the kernels need no more)."""

    meta: AttentionMetadata
    window: int | None = None
    softcap: float | None = None


class TritonAttention:
    """Paged attention through the Triton kernels of ``batchgen.kernels``.

    The kernels are imported at the first call, so that this module (and the torch path) never
    depends on Triton being importable.
    """

    def __init__(self) -> None:
        self._store_kv = None
        self._paged_attention = None

    def prepare(
        self,
        meta: AttentionMetadata,
        kv_cache: Tensor,
        num_heads: int,
        dtype: torch.dtype | None = None,
        window: int | None = None,
        softcap: float | None = None,
    ) -> TritonPlan:
        """The kernels need nothing beyond the metadata, the window and the softcap."""
        return TritonPlan(meta, window, softcap)

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        plan: TritonPlan,
        scale: float,
        k_scale: Tensor | None = None,
        v_scale: Tensor | None = None,
        sinks: Tensor | None = None,
    ) -> Tensor:
        """See ``AttentionBackend.forward``: a quantized cache is quantized on store and
        dequantized on load by the kernels."""
        if self._paged_attention is None:
            from batchgen.kernels import paged_attention, store_kv

            self._store_kv, self._paged_attention = store_kv, paged_attention
        meta = plan.meta
        self._store_kv(k, v, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale)
        return self._paged_attention(
            q,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.cu_seqlens_q,
            meta.seq_lens,
            scale,
            meta.max_seqlen_q,
            meta.max_seqlen_k,
            num_decode_seqs=meta.num_decodes,
            k_scale=k_scale,
            v_scale=v_scale,
            window=plan.window,
            softcap=plan.softcap,
            sinks=None if sinks is None else sinks.float(),
        )
