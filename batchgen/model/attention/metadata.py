"""What every layer's attention needs about one engine step, and the backend interface.

The KV cache of layer ``l`` is ``k_cache = kv_cache[l, 0]`` and ``v_cache = kv_cache[l, 1]``,
each ``[num_blocks, block_size, Hkv, D]``. A token's *slot* is ``block_id * block_size + offset``.
A quantized cache (int8, float8_e4m3fn) has one fp32 scale per slot and KV head,
``k_scale = kv_scales[l, 0]`` and ``v_scale = kv_scales[l, 1]``, each
``[num_blocks, block_size, Hkv]``; a slot's value is ``cache * scale`` (see
``batchgen.kernels.reference.quantize_kv_ref`` for the rule every store follows).

A step is a flat list of new tokens: sequence ``b`` owns rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]``
of ``q``. New token ``i`` of sequence ``b`` sits at position ``seq_lens[b] - q_len_b + i`` and sees
every key at a position ``<=`` its own (cached prefix and new tokens alike), or, in a layer with
a sliding window W, the keys at its position minus ``W - 1`` and after. The same rule serves
prefill, prefill of the tail of a cached prefix (chunked prefill, prefix-cache hits) and decode.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, TypeVar

import torch
from torch import Tensor

__all__ = ["AttentionBackend", "AttentionMetadata"]

Plan = TypeVar("Plan")


@dataclass
class AttentionMetadata:
    """What every layer needs to know about one engine step (built once per step by the
    engine, read-only afterwards)."""

    slot_mapping: Tensor  # [T] int64: cache slot of each new token (all >= 0)
    block_tables: Tensor  # [B, max_blocks] int32; row b valid up to ceil(seq_lens[b]/block_size)
    cu_seqlens_q: Tensor  # [B+1] int32: new tokens of sequence b are rows cu[b]:cu[b+1]
    seq_lens: Tensor  # [B] int32: context length after this step (cached + new)
    max_seqlen_q: int
    max_seqlen_k: int
    num_decodes: int = 0  # leading sequences with one new token (kernels launch them apart)


class AttentionBackend(Protocol[Plan]):
    """Writes the step's new K/V into the paged cache and attends over cached + new keys.

    ``prepare`` runs once per step, before the first layer, and returns the backend's plan of
    the step (opaque to the model); the model passes it to every layer's ``forward``.
    """

    def prepare(
        self,
        meta: AttentionMetadata,
        kv_cache: Tensor,
        num_heads: int,
        dtype: torch.dtype | None = None,
        window: int | None = None,
        softcap: float | None = None,
    ) -> Plan:
        """The step's plan: meta of this step, kv_cache ``[L, 2, num_blocks, block_size, Hkv,
        D]``, ``num_heads`` query heads (Hq), ``dtype`` q's (None: the cache's, which is q's
        for a float cache), ``window`` the sliding window W of the layers that will run it (a
        row at position p sees keys ``p-W+1 .. p`` only; None: every key up to p). A model
        with layers of different windows prepares one plan per window. ``softcap``: each score
        s (``scale * q.k``) becomes ``softcap * tanh(s / softcap)`` before the softmax."""
        ...

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        plan: Plan,
        scale: float,
        k_scale: Tensor | None = None,
        v_scale: Tensor | None = None,
        sinks: Tensor | None = None,
    ) -> Tensor:
        """q ``[T,Hq,D]``, k/v ``[T,Hkv,D]``, caches ``[num_blocks, block_size, Hkv, D]`` (one
        layer's planes of the kv_cache given to ``prepare``); for a quantized cache, that
        layer's scale planes ``[num_blocks, block_size, Hkv]`` fp32 (None for a float cache).
        The new K/V are stored (quantized) first; every key is then read from the cache.

        ``sinks [Hq]`` fp32 (gpt-oss): each head's softmax has one more term, ``exp(sinks[h])``,
        with no value (the output is scaled by ``sigmoid(lse - sink)``).

        Returns ``[T,Hq,D]``. GQA: ``Hq % Hkv == 0``; query head h uses KV head ``h // (Hq/Hkv)``.
        """
        ...
