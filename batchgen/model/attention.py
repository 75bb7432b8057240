"""Paged attention: the step metadata, the backend interface and its two implementations.

The KV cache of layer ``l`` is ``k_cache = kv_cache[l, 0]`` and ``v_cache = kv_cache[l, 1]``,
each ``[num_blocks, block_size, Hkv, D]``. A token's *slot* is ``block_id * block_size + offset``.

A step is a flat list of new tokens: sequence ``b`` owns rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]``
of ``q``. New token ``i`` of sequence ``b`` sits at position ``seq_lens[b] - q_len_b + i`` and sees
every key at a position ``<=`` its own (cached prefix and new tokens alike). The same rule serves
prefill, prefill of the tail of a cached prefix (chunked prefill, prefix-cache hits) and decode.

Backends first write the new K/V into the cache at ``slot_mapping``, then attend over the cache.
``TorchAttention`` is the CPU production path (pure PyTorch); ``TritonAttention`` calls the
kernels in ``batchgen.kernels``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "AttentionMetadata",
    "AttentionBackend",
    "TorchAttention",
    "TritonAttention",
    "make_attention_backend",
]


@dataclass
class AttentionMetadata:
    """What every layer needs to know about one engine step (built once per step, shared).

    The engine sets the first six fields. ``torch_plan`` is filled lazily by ``TorchAttention`` at
    the first layer of the step and reused by the others (the plan depends only on this metadata,
    the block size and the GQA group size, which are the same in every layer).
    """

    slot_mapping: Tensor  # [T] int64: cache slot of each new token (all >= 0)
    block_tables: Tensor  # [B, max_blocks] int32; row b valid up to ceil(seq_lens[b]/block_size)
    cu_seqlens_q: Tensor  # [B+1] int32: new tokens of sequence b are rows cu[b]:cu[b+1]
    seq_lens: Tensor  # [B] int32: context length after this step (cached + new)
    max_seqlen_q: int
    max_seqlen_k: int
    torch_plan: TorchAttentionPlan | None = None


class AttentionBackend(Protocol):
    """Writes the step's new K/V into the paged cache and attends over cached + new keys."""

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> Tensor:
        """q ``[T,Hq,D]``, k/v ``[T,Hkv,D]``, caches ``[num_blocks, block_size, Hkv, D]``.

        Returns ``[T,Hq,D]``. GQA: ``Hq % Hkv == 0``; query head h uses KV head ``h // (Hq/Hkv)``.
        """
        ...


# --------------------------------------------------------------------------------------------
# Torch backend
# --------------------------------------------------------------------------------------------

# Sequence classes of a step. Each class is split into groups of similar shape; a group is padded
# to its largest query and key length and computed by one SDPA call.
_DECODE = 0  # one new token: q [n, Hkv, G, D] against gathered keys, no K/V head expansion
_FRESH = 1  # no cached prefix (q_len == seq_len > 1): keys are the new k rows, plain causal mask
_EXTEND = 2  # new tokens after a cached prefix: gathered keys, explicit offset-causal mask

# Cost of one extra group (one more SDPA call and a few index ops per layer), in the units of
# ``_cost``: roughly (query rows x heads-per-KV-head + 1) x keys. Merging two groups is worth it
# while the padding it adds costs less than this.
_GROUP_OVERHEAD = 8192


def _cost(n: int, max_q: int, max_k: int, group: int) -> int:
    """Work of a padded group: attention (q rows x keys) plus the K/V gather (keys)."""
    return n * max_k * (max_q * group + 1)


@dataclass
class _Group:
    """One padded SDPA call. ``n`` sequences, padded to ``max_q`` new tokens, ``max_k`` keys."""

    kind: int
    n: int
    max_q: int
    max_k: int
    q_index: Tensor | None  # [n*max_q] int64 rows of q (padding clamps to the seq's last row);
    #                         None: the group is rows 0..T-1 in order, no padding
    k_slots: Tensor | None  # [n*max_k] int64 cache slots (padding clamps to the seq's last key);
    #                         None for _FRESH (its keys are the new k rows at q_index)
    mask: Tensor | None  # bool, True = may attend. _DECODE: [n,1,1,max_k]; _EXTEND: [n,1,max_q,max_k]
    out_select: Tensor | None  # [m] valid rows among the n*max_q padded rows; None: all valid
    out_rows: Tensor | None  # [m] destination rows of the output; None: identity (q_index None)


@dataclass
class TorchAttentionPlan:
    """Gather indices and masks of one step, computed at the first layer and reused by the rest."""

    block_size: int
    group: int  # Hq // Hkv
    num_tokens: int
    groups: list[_Group]


def _split_groups(
    seqs: list[int], q_lens: list[int], k_lens: list[int], group: int
) -> list[list[int]]:
    """Greedy packing of sequences of one class into groups of similar (q_len, k_len).

    Sequences are visited largest first; one joins the current group when the padded cost of the
    merged group is no more than the cost of keeping it separate (its own cost plus one group's
    overhead). Within a group, sequences are kept in ascending order.
    """
    order = sorted(seqs, key=lambda b: (q_lens[b], k_lens[b]), reverse=True)
    groups: list[list[int]] = []
    cur: list[int] = []
    mq = mk = 0
    for b in order:
        if cur:
            nq, nk = max(mq, q_lens[b]), max(mk, k_lens[b])
            merged = _cost(len(cur) + 1, nq, nk, group)
            apart = _cost(len(cur), mq, mk, group) + _cost(1, q_lens[b], k_lens[b], group)
            if merged <= apart + _GROUP_OVERHEAD:
                cur.append(b)
                mq, mk = nq, nk
                continue
            groups.append(sorted(cur))
        cur, mq, mk = [b], q_lens[b], k_lens[b]
    if cur:
        groups.append(sorted(cur))
    return groups


def build_torch_plan(meta: AttentionMetadata, block_size: int, group: int) -> TorchAttentionPlan:
    """Turn the step metadata into padded groups with gather indices and masks.

    One host sync per step (``tolist`` of the B+1 offsets and B lengths); the index tensors are
    built with vectorized ops on the metadata's device.
    """
    dev = meta.seq_lens.device
    cu = meta.cu_seqlens_q.tolist()
    k_lens: list[int] = meta.seq_lens.tolist()
    num_seqs = len(k_lens)
    q_lens = [cu[b + 1] - cu[b] for b in range(num_seqs)]
    num_tokens = cu[-1]

    classes: dict[int, list[int]] = {_DECODE: [], _FRESH: [], _EXTEND: []}
    for b in range(num_seqs):
        if q_lens[b] == 1:
            classes[_DECODE].append(b)
        elif q_lens[b] == k_lens[b]:
            classes[_FRESH].append(b)
        else:
            classes[_EXTEND].append(b)

    cu_t = meta.cu_seqlens_q.to(torch.int64)
    seq_lens_t = meta.seq_lens.to(torch.int64)
    groups: list[_Group] = []
    for kind, members in classes.items():
        if not members:
            continue
        for seqs in _split_groups(members, q_lens, k_lens, group):
            n = len(seqs)
            max_q = max(q_lens[b] for b in seqs)
            max_k = max(k_lens[b] for b in seqs)
            padded_q = any(q_lens[b] != max_q for b in seqs)
            # identity: the group is every token of the step, in order, without padding
            identity = n == num_seqs and not padded_q
            idx = torch.tensor(seqs, dtype=torch.int64, device=dev)  # [n]
            q_start = cu_t[idx]  # [n]
            q_len = cu_t[idx + 1] - q_start  # [n]
            k_len = seq_lens_t[idx]  # [n]

            ar_q = torch.arange(max_q, device=dev)
            q_index = out_select = out_rows = None
            if not identity:
                q_rows = q_start[:, None] + torch.minimum(ar_q[None, :], q_len[:, None] - 1)
                q_index = q_rows.reshape(-1)  # [n*max_q]
                if padded_q:
                    valid = (ar_q[None, :] < q_len[:, None]).reshape(-1)
                    out_select = valid.nonzero().squeeze(1)
                    out_rows = q_index[out_select]
                else:
                    out_rows = q_index

            k_slots = mask = None
            if kind != _FRESH:
                # Padding keys are clamped to the sequence's last key, so every gathered slot has
                # been written (a stray read of an unused block, e.g. NaN, can never leak in).
                ar_k = torch.arange(max_k, device=dev)
                pos = torch.minimum(ar_k[None, :], k_len[:, None] - 1)  # [n, max_k]
                table = meta.block_tables.index_select(0, idx).to(torch.int64)  # [n, max_blocks]
                blocks = table.gather(1, torch.div(pos, block_size, rounding_mode="floor"))
                k_slots = (blocks * block_size + pos % block_size).reshape(-1)
                if kind == _DECODE:
                    if any(k_lens[b] != max_k for b in seqs):
                        mask = (ar_k[None, :] < k_len[:, None])[:, None, None, :]
                else:
                    # token i of seq b is at position k_len - q_len + i and sees keys j <= it
                    q_pos = (k_len - q_len)[:, None] + ar_q[None, :]  # [n, max_q]
                    mask = (ar_k[None, None, :] <= q_pos[:, :, None])[:, None]  # [n,1,max_q,max_k]
            groups.append(
                _Group(kind, n, max_q, max_k, q_index, k_slots, mask, out_select, out_rows)
            )
    return TorchAttentionPlan(block_size, group, num_tokens, groups)


class TorchAttention:
    """Pure-PyTorch paged attention (the CPU path).

    Per step (first layer) the sequences are split into a few padded groups; per layer and group:
    one ``index_select`` gathers K and one V from the flattened cache into ``[n, max_k, Hkv, D]``,
    and one ``scaled_dot_product_attention`` call computes the group. Decode groups pack the G
    query heads of a KV head as G query rows, so K/V heads are never expanded.
    """

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> Tensor:
        """See ``AttentionBackend.forward``."""
        num_tokens, num_heads, head_dim = q.shape
        num_kv_heads = k.shape[1]
        group = num_heads // num_kv_heads
        block_size = k_cache.shape[1]

        # write the new K/V: caches viewed as [num_slots, Hkv, D]
        k_flat = k_cache.view(-1, num_kv_heads, head_dim)
        v_flat = v_cache.view(-1, num_kv_heads, head_dim)
        k_flat.index_copy_(0, meta.slot_mapping, k)
        v_flat.index_copy_(0, meta.slot_mapping, v)

        plan = meta.torch_plan
        if plan is None or plan.block_size != block_size or plan.group != group:
            plan = build_torch_plan(meta, block_size, group)
            meta.torch_plan = plan

        if len(plan.groups) == 1 and plan.groups[0].q_index is None:
            return self._group(plan.groups[0], q, k, v, k_flat, v_flat, scale)
        out = q.new_empty(num_tokens, num_heads, head_dim)
        for g in plan.groups:
            o = self._group(g, q, k, v, k_flat, v_flat, scale)  # [n*max_q, Hq, D]
            if g.out_select is not None:
                o = o.index_select(0, g.out_select)
            out.index_copy_(0, g.out_rows, o)
        return out

    @staticmethod
    def _group(
        g: _Group, q: Tensor, k: Tensor, v: Tensor, k_flat: Tensor, v_flat: Tensor, scale: float
    ) -> Tensor:
        """Attention of one padded group; returns ``[n*max_q, Hq, D]`` (padded rows included)."""
        _, hq, d = q.shape
        hkv = k.shape[1]
        n, max_q, max_k = g.n, g.max_q, g.max_k
        qg = q if g.q_index is None else q.index_select(0, g.q_index)
        qg = qg.view(n, max_q, hq, d)

        if g.kind == _FRESH:
            # keys are this step's rows; right padding is harmless under a causal mask
            kg = k if g.q_index is None else k.index_select(0, g.q_index)
            vg = v if g.q_index is None else v.index_select(0, g.q_index)
            kg = kg.view(n, max_q, hkv, d).transpose(1, 2)  # [n, Hkv, max_q, D]
            vg = vg.view(n, max_q, hkv, d).transpose(1, 2)
            o = F.scaled_dot_product_attention(
                qg.transpose(1, 2), kg, vg, is_causal=True, scale=scale, enable_gqa=hq != hkv
            )  # [n, Hq, max_q, D]
            return o.transpose(1, 2).reshape(n * max_q, hq, d)

        assert g.k_slots is not None
        kg = k_flat.index_select(0, g.k_slots).view(n, max_k, hkv, d).transpose(1, 2)
        vg = v_flat.index_select(0, g.k_slots).view(n, max_k, hkv, d).transpose(1, 2)
        if g.kind == _DECODE:
            # [n, 1, Hq, D] -> [n, Hkv, G, D]: the G heads sharing a KV head become G query rows
            o = F.scaled_dot_product_attention(
                qg.view(n, hkv, hq // hkv, d), kg, vg, attn_mask=g.mask, scale=scale
            )  # [n, Hkv, G, D]
            return o.reshape(n, hq, d)
        o = F.scaled_dot_product_attention(
            qg.transpose(1, 2), kg, vg, attn_mask=g.mask, scale=scale, enable_gqa=hq != hkv
        )  # [n, Hq, max_q, D]
        return o.transpose(1, 2).reshape(n * max_q, hq, d)


# --------------------------------------------------------------------------------------------
# Triton backend
# --------------------------------------------------------------------------------------------


class TritonAttention:
    """Paged attention through the Triton kernels of ``batchgen.kernels``.

    The kernels are imported at the first call, so that this module (and the torch path) never
    depends on Triton being importable.
    """

    def __init__(self) -> None:
        self._store_kv = None
        self._paged_attention = None

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> Tensor:
        """See ``AttentionBackend.forward``."""
        if self._paged_attention is None:
            from batchgen.kernels import paged_attention, store_kv

            self._store_kv, self._paged_attention = store_kv, paged_attention
        self._store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
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
        )


def make_attention_backend(name: str) -> AttentionBackend:
    """``"torch"`` or ``"triton"`` (the job's ``engine.attention_backend`` after resolving auto)."""
    if name == "torch":
        return TorchAttention()
    if name == "triton":
        return TritonAttention()
    raise ValueError(f"unknown attention backend {name!r}; expected 'torch' or 'triton'")
