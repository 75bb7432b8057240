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

import math
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from batchgen.model import cpu_kernels

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
#
# Per step (first layer) the sequences are split into a few padded *groups*; per layer each group
# costs one K and one V gather from the flattened cache and one attention call. Two further ideas:
#
# - Decode groups pack the G query heads of a KV head as G query rows ([n, Hkv, G, D]), so K/V
#   heads are never expanded. Extend groups that need the log-sum-exp pack heads the same way.
# - Cascade: sequences whose block tables start with the same cached blocks (a shared system
#   prompt, the samples of one prompt) attend to that shared prefix in ONE call (all their query
#   rows against the prefix keys, gathered once) and to their own remaining keys in their groups;
#   the two partial results are merged with their log-sum-exps. This turns most of the decode
#   gather traffic of shared-prefix workloads into one small matmul.

# Sequence classes. Each class is split into groups of similar shape.
_DECODE = 0  # one new token: q [n, Hkv, G, D] against gathered keys
_FRESH = 1  # no cached prefix (q_len == seq_len > 1): keys are the new k rows, causal mask
_EXTEND = 2  # new tokens after cached keys: gathered keys, explicit offset-causal mask

# Cost of one extra group (one more attention call and a few index ops per layer), in the units
# of ``_cost``. Merging two groups is worth it while the padding it adds costs less than this.
_GROUP_OVERHEAD = 8192
# Decode/extend groups gather and attend in chunks of sequences of about this many K+V bytes.
_GATHER_CHUNK_BYTES = 16 << 20
# In native plans a sequence whose new tokens times the query heads per KV head fill at least this
# many query rows (one 16-lane tile) goes to the C kernel's tiled variant; fewer rows (decodes,
# short extends) to its per-token variant, which wastes no lanes.
_TILED_MIN_ROWS = 16
# A shared prefix becomes a cascade when it saves at least this many gathered key positions.
_CASCADE_MIN_SAVED = 256

# The CPU flash-attention op behind F.scaled_dot_product_attention; unlike SDPA it also returns
# the log-sum-exp. Private but stable across the torch versions we support; None elsewhere.
_flash_cpu = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _cost(n: int, max_q: int, max_k: int, group: int) -> int:
    """Work of a padded group: attention (q rows x heads per KV head x keys) plus the gather."""
    return n * max_k * (max_q * group + 1)


@dataclass
class _Group:
    """One padded attention call: ``n`` sequences padded to ``max_q`` new tokens and ``max_k`` keys."""

    kind: int
    n: int
    max_q: int
    max_k: int
    want_lse: bool  # members of a cascade: heads packed as rows, float mask, keep the lse
    q_index: Tensor | None  # [n*max_q] int64 rows of q (padding clamps to the seq's last row);
    #                         None: the group is rows 0..T-1 in order, without padding
    k_slots: Tensor | None  # [n*max_k] int64 cache slots (padding clamps to the seq's last key);
    #                         None for _FRESH (its keys are the new k rows at q_index)
    mask: Tensor | None  # additive (0 / -inf, q's dtype); None: attend to all keys.
    #                      _DECODE [n,1,1,max_k]; _EXTEND [n,1,max_q,max_k], or packed (want_lse)
    #                      [n,1,max_q*G,max_k] with row i*G+g for token i, head g
    out_select: Tensor | None  # [m] valid rows among the n*max_q padded rows; None: all valid
    out_rows: Tensor | None  # [m] destination rows in the output; None: identity


@dataclass
class _Cascade:
    """A shared cached prefix: every row in ``rows`` sees every key in ``slots``."""

    rows: Tensor  # [R] int64 q rows of the member sequences' new tokens
    slots: Tensor  # [Lp] int64 cache slots of the shared prefix, in position order


@dataclass
class _CascadeBatch:
    """Every cascade of a step, concatenated for one C call: cascade c has the cache slots
    ``slots[slot_offsets[c]:slot_offsets[c+1]]`` and the q rows likewise."""

    slots: Tensor  # [sum Lp] int64
    slot_offsets: Tensor  # [C+1] int64
    rows: Tensor  # [sum R] int64
    row_offsets: Tensor  # [C+1] int64


@dataclass
class TorchAttentionPlan:
    """Gather indices and masks of one step, computed at the first layer and reused by the rest."""

    block_size: int
    group: int  # Hq // Hkv
    dtype: torch.dtype  # of q (float masks are in this dtype)
    num_tokens: int
    groups: list[_Group]
    cascades: list[_Cascade]  # PyTorch plans
    cascade_batch: _CascadeBatch | None = None  # native plans: all cascades, one C call
    # the C kernels' share (``native`` plans: every sequence), one call each
    native_seqs: Tensor | None = None  # [m] int32 sequences for the per-token kernel
    tiled_seqs: Tensor | None = None  # [m] int32 sequences for the tiled kernel
    k_start: Tensor | None = None  # [B] int32 first key each sequence attends to (cascades)


def _split_groups(
    seqs: list[int], q_lens: list[int], k_lens: list[int], group: int
) -> list[list[int]]:
    """Greedy packing of sequences of one class into groups of similar (q_len, k_len).

    Sequences are visited largest first; one joins the current group when the padded cost of the
    merged group is no more than keeping it apart (its own cost plus one group's overhead).
    Within a group, sequences are kept in ascending order.
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


def _find_cascades(
    meta: AttentionMetadata, q_lens: list[int], k_lens: list[int], block_size: int
) -> list[tuple[list[int], list[int]]]:
    """Sets of sequences sharing leading cached blocks: ``(members, blocks)``, the blocks their
    tables all start with.

    Only whole blocks of the cached context (positions before every member's first new token)
    count, so every new token of every member sees the whole prefix. (Nesting them, e.g. the n
    samples of each prompt under a shared system prompt, measured slower: siblings run one after
    another, so the per-token kernel finds their common blocks in cache already.)
    """
    cands = [b for b in range(len(k_lens)) if k_lens[b] - q_lens[b] >= block_size]
    if len(cands) < 2:
        return []
    tables = meta.block_tables.index_select(
        0, torch.tensor(cands, device=meta.block_tables.device)
    ).cpu()  # [m, max_blocks]
    by_first: dict[int, list[int]] = {}
    for row, first in enumerate(tables[:, 0].tolist()):
        by_first.setdefault(first, []).append(row)
    found = []
    for rows in by_first.values():
        if len(rows) < 2:
            continue
        members = [cands[r] for r in rows]
        limit = min(k_lens[b] - q_lens[b] for b in members) // block_size
        sub = tables[rows, :limit]
        same = (sub == sub[0]).all(0).to(torch.int64)  # [limit]
        prefix = int(same.cumprod(0).sum())
        if (len(members) - 1) * prefix * block_size >= _CASCADE_MIN_SAVED:
            found.append((members, sub[0, :prefix].tolist()))
    return found


def build_torch_plan(
    meta: AttentionMetadata,
    block_size: int,
    group: int,
    dtype: torch.dtype,
    native: bool = False,
) -> TorchAttentionPlan:
    """Turn the step metadata into padded groups (and cascades) with gather indices and masks.

    ``native``: every sequence goes to the C kernels, which read the paged cache in place
    (``native_seqs`` / ``tiled_seqs``, split by ``_TILED_MIN_ROWS``), instead of into gathered
    SDPA groups; the shared prefixes of cascades go to a C kernel too (one call for all of them,
    merged into the other kernels' results by log-sum-exp).

    One host sync per step (the B+1 offsets and B lengths, and the block-table rows of cascade
    candidates); the groups' index tensors are built with vectorized ops on the metadata's
    device, the cascades' rows and slots from those host lists.
    """
    dev = meta.seq_lens.device
    cu = meta.cu_seqlens_q.tolist()
    k_lens: list[int] = meta.seq_lens.tolist()
    num_seqs = len(k_lens)
    q_lens = [cu[b + 1] - cu[b] for b in range(num_seqs)]
    num_tokens = cu[-1]
    cu_t = meta.cu_seqlens_q.to(torch.int64)
    seq_lens_t = meta.seq_lens.to(torch.int64)

    # shared prefixes: members skip them in their own groups (key offset ``start``)
    start = [0] * num_seqs
    found = _find_cascades(meta, q_lens, k_lens, block_size)
    rows_of: list[list[int]] = []  # per cascade: the members' q rows
    slots_of: list[list[int]] = []  # and the prefix's cache slots, in position order
    for members, blocks in found:
        for b in members:
            start[b] = len(blocks) * block_size
        rows_of.append([r for b in members for r in range(cu[b], cu[b + 1])])
        slots_of.append([blk * block_size + i for blk in blocks for i in range(block_size)])
    cascades: list[_Cascade] = []
    if not native:
        cascades = [
            _Cascade(torch.tensor(r, device=dev), torch.tensor(sl, device=dev))
            for r, sl in zip(rows_of, slots_of, strict=True)
        ]
    rel_k = [k_lens[b] - start[b] for b in range(num_seqs)]  # keys each group attends to

    classes: dict[tuple[int, bool], list[int]] = {}
    native_seqs: list[int] = []
    tiled_seqs: list[int] = []
    for b in range(num_seqs):
        if native:
            (tiled_seqs if q_lens[b] * group >= _TILED_MIN_ROWS else native_seqs).append(b)
            continue
        member = start[b] > 0
        if q_lens[b] == 1:
            kind = _DECODE
        elif q_lens[b] == k_lens[b]:
            kind = _FRESH
        else:
            kind = _EXTEND
        classes.setdefault((kind, member), []).append(b)

    groups: list[_Group] = []
    for (kind, member), class_seqs in sorted(classes.items()):
        for seqs in _split_groups(class_seqs, q_lens, rel_k, group):
            n = len(seqs)
            max_q = max(q_lens[b] for b in seqs)
            max_k = max(rel_k[b] for b in seqs)
            padded_q = any(q_lens[b] != max_q for b in seqs)
            identity = n == num_seqs and not padded_q  # every token of the step, in order
            idx = torch.tensor(seqs, dtype=torch.int64, device=dev)  # [n]
            q_start = cu_t[idx]
            q_len = cu_t[idx + 1] - q_start  # [n]
            k_len = seq_lens_t[idx] - torch.tensor([start[b] for b in seqs], device=dev)  # [n]
            k_off = seq_lens_t[idx] - k_len  # [n] position of the group's first key

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
                # been written: a stray read of an unused block (e.g. NaN) can never leak in.
                ar_k = torch.arange(max_k, device=dev)
                rel = torch.minimum(ar_k[None, :], k_len[:, None] - 1)  # [n, max_k]
                pos = k_off[:, None] + rel
                table = meta.block_tables.index_select(0, idx).to(torch.int64)  # [n, max_blocks]
                blocks = table.gather(1, torch.div(pos, block_size, rounding_mode="floor"))
                k_slots = (blocks * block_size + pos % block_size).reshape(-1)
                if kind == _DECODE:
                    if any(rel_k[b] != max_k for b in seqs):
                        mask = (ar_k[None, :] < k_len[:, None])[:, None, None, :]
                else:
                    # new token i is at relative position k_len - q_len + i; it sees keys <= it
                    q_pos = (k_len - q_len)[:, None] + ar_q[None, :]  # [n, max_q]
                    mask = (ar_k[None, None, :] <= q_pos[:, :, None])[:, None]  # [n,1,max_q,max_k]
                    if member:
                        mask = mask.repeat_interleave(group, dim=2)  # packed rows i*G+g
                if mask is not None:  # additive form, as SDPA would convert it at every call
                    mask = torch.zeros(mask.shape, dtype=dtype, device=dev).masked_fill_(
                        ~mask, float("-inf")
                    )
            groups.append(
                _Group(kind, n, max_q, max_k, member, q_index, k_slots, mask, out_select, out_rows)
            )
    plan = TorchAttentionPlan(block_size, group, dtype, num_tokens, groups, cascades)
    if native_seqs:
        plan.native_seqs = torch.tensor(native_seqs, dtype=torch.int32)
    if tiled_seqs:
        plan.tiled_seqs = torch.tensor(tiled_seqs, dtype=torch.int32)
    if native and found:
        plan.k_start = torch.tensor(start, dtype=torch.int32)
        plan.cascade_batch = _CascadeBatch(
            torch.tensor([x for sl in slots_of for x in sl], dtype=torch.int64),
            torch.tensor([0] + [len(sl) for sl in slots_of]).cumsum(0),
            torch.tensor([x for r in rows_of for x in r], dtype=torch.int64),
            torch.tensor([0] + [len(r) for r in rows_of]).cumsum(0),
        )
    return plan


def _attend_lse(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float
) -> tuple[Tensor, Tensor]:
    """Attention that also returns the log-sum-exp of the scores.

    q ``[n, H, Lq, D]``, k/v ``[n, H, Lk, D]`` (same H), additive mask broadcastable to
    ``[n, H, Lq, Lk]`` or None -> out ``[n, H, Lq, D]``, lse ``[n, H, Lq]`` fp32.
    """
    if q.device.type == "cpu" and _flash_cpu is not None:
        out, lse = _flash_cpu(q, k, v, 0.0, False, attn_mask=mask, scale=scale)
        return out, lse.float()
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    if mask is not None:
        scores = scores + mask
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse[..., None]).to(v.dtype)
    return torch.matmul(probs, v), lse


class TorchAttention:
    """PyTorch paged attention (the CPU production path).

    On CPU tensors in fp32, every sequence and every cascade prefix runs in the C kernels of
    :mod:`batchgen.model.cpu_kernels` (they read the paged cache in place) when they can be built;
    ``native=False`` keeps everything in PyTorch (gathers and SDPA). Holds grow-only gather
    buffers reused by every layer and step (a fresh allocation of tens of MB per gather costs more
    in page faults than the copy itself), so one instance must not run two forward passes
    concurrently.
    """

    def __init__(self, native: bool = True) -> None:
        self._workspace: dict[str, Tensor] = {}
        self._use_native = native

    def _buffer(self, name: str, shape: tuple[int, ...], like: Tensor) -> Tensor:
        numel = math.prod(shape)
        buf = self._workspace.get(name)
        if (
            buf is None
            or buf.numel() < numel
            or buf.dtype != like.dtype
            or buf.device != like.device
        ):
            buf = torch.empty(numel, dtype=like.dtype, device=like.device)
            self._workspace[name] = buf
        return buf[:numel].view(shape)

    def _gather(self, name: str, flat: Tensor, slots: Tensor) -> Tensor:
        """``flat[slots]`` ([len(slots), Hkv, D]) into a reused buffer."""
        out = self._buffer(name, (slots.shape[0], *flat.shape[1:]), flat)
        return torch.index_select(flat, 0, slots, out=out)

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

        kernels = cpu_kernels.for_dtype(q.device, q.dtype) if self._use_native else None
        # write the new K/V; caches viewed as [num_slots, Hkv, D]
        k_flat = k_cache.view(-1, num_kv_heads, head_dim)
        v_flat = v_cache.view(-1, num_kv_heads, head_dim)
        if kernels is not None:
            kernels.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        else:
            k_flat.index_copy_(0, meta.slot_mapping, k)
            v_flat.index_copy_(0, meta.slot_mapping, v)
        plan = meta.torch_plan
        if plan is None or (plan.block_size, plan.group, plan.dtype) != (
            block_size,
            group,
            q.dtype,
        ):
            plan = build_torch_plan(meta, block_size, group, q.dtype, kernels is not None)
            meta.torch_plan = plan

        if (
            len(plan.groups) == 1
            and plan.groups[0].q_index is None
            and not plan.cascades
            and plan.cascade_batch is None
            and plan.native_seqs is None
            and plan.tiled_seqs is None
        ):
            return self._group(plan.groups[0], q, k, v, k_flat, v_flat, scale)[0]
        out = q.new_empty(num_tokens, num_heads, head_dim)
        with_lse = plan.cascades or plan.cascade_batch is not None
        lse_all = q.new_empty(num_tokens, num_heads, dtype=torch.float32) if with_lse else None
        for seqs, tiled in ((plan.native_seqs, False), (plan.tiled_seqs, True)):
            if seqs is None:
                continue
            assert kernels is not None  # plans are per step, and a step keeps one dtype
            kernels.paged_attention(
                q,
                k_cache,
                v_cache,
                meta.block_tables,
                meta.cu_seqlens_q,
                meta.seq_lens,
                seqs,
                out,
                scale,
                k_start=plan.k_start,
                lse=lse_all,
                tiled=tiled,
            )
        for g in plan.groups:
            o, lse = self._group(g, q, k, v, k_flat, v_flat, scale)  # [n*max_q, Hq, D], [.., Hq]
            if g.out_select is not None:
                o = o.index_select(0, g.out_select)
                lse = None if lse is None else lse.index_select(0, g.out_select)
            rows = (
                g.out_rows if g.out_rows is not None else torch.arange(num_tokens, device=q.device)
            )
            out.index_copy_(0, rows, o)
            if lse is not None:
                assert lse_all is not None
                lse_all.index_copy_(0, rows, lse)
        cb = plan.cascade_batch
        if cb is not None:  # attention and merge in one pass, the prefixes read in place
            assert lse_all is not None and kernels is not None
            kernels.prefix_attention_merge_(
                q, k_cache, v_cache, cb.slots, cb.slot_offsets, cb.rows, cb.row_offsets, out,
                lse_all, scale,
            )  # fmt: skip
        for c in plan.cascades:
            assert lse_all is not None
            self._merge_prefix(c, q, k_flat, v_flat, out, lse_all, scale)
        return out

    def _group(
        self,
        g: _Group,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        k_flat: Tensor,
        v_flat: Tensor,
        scale: float,
    ) -> tuple[Tensor, Tensor | None]:
        """One padded group -> out ``[n*max_q, Hq, D]`` (padded rows included) and, for cascade
        members, the log-sum-exp ``[n*max_q, Hq]``."""
        _, hq, d = q.shape
        hkv = k.shape[1]
        grp = hq // hkv
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
                qg.transpose(1, 2), kg, vg, is_causal=True, scale=scale, enable_gqa=grp > 1
            )  # [n, Hq, max_q, D]
            return o.transpose(1, 2).reshape(n * max_q, hq, d), None

        # Gather and attend in chunks of sequences: a chunk's gathered K/V (at most
        # _GATHER_CHUNK_BYTES) is still in the CPU caches when attention reads it.
        assert g.k_slots is not None
        slots = g.k_slots.view(n, max_k)
        per_seq = 2 * max_k * hkv * d * k_flat.element_size()
        step = max(1, _GATHER_CHUNK_BYTES // per_seq)
        if step >= n:
            return self._attend_cached(g, qg, slots, g.mask, k_flat, v_flat, scale)
        outs, lses = [], []
        for lo in range(0, n, step):
            hi = min(n, lo + step)
            mask = None if g.mask is None else g.mask[lo:hi]
            o, lse = self._attend_cached(g, qg[lo:hi], slots[lo:hi], mask, k_flat, v_flat, scale)
            outs.append(o)
            lses.append(lse)
        return torch.cat(outs), None if not g.want_lse else torch.cat(lses)  # type: ignore[arg-type]

    def _attend_cached(
        self,
        g: _Group,
        qg: Tensor,
        slots: Tensor,
        mask: Tensor | None,
        k_flat: Tensor,
        v_flat: Tensor,
        scale: float,
    ) -> tuple[Tensor, Tensor | None]:
        """Sequences ``qg [m, max_q, Hq, D]`` against their gathered keys ``slots [m, max_k]``
        -> out ``[m*max_q, Hq, D]`` and (want_lse) lse ``[m*max_q, Hq]``."""
        m, max_q, hq, d = qg.shape
        max_k = slots.shape[1]
        hkv = k_flat.shape[1]
        grp = hq // hkv
        kg = self._gather("k", k_flat, slots.reshape(-1)).view(m, max_k, hkv, d).transpose(1, 2)
        vg = self._gather("v", v_flat, slots.reshape(-1)).view(m, max_k, hkv, d).transpose(1, 2)
        if g.kind == _DECODE:
            qp = qg.view(m, hkv, grp, d)  # the G heads sharing a KV head become G query rows
            if g.want_lse:
                o, lse = _attend_lse(qp, kg, vg, mask, scale)  # [m,Hkv,G,D], [m,Hkv,G]
                return o.reshape(m, hq, d), lse.reshape(m, hq)
            o = F.scaled_dot_product_attention(qp, kg, vg, attn_mask=mask, scale=scale)
            return o.reshape(m, hq, d), None
        if g.want_lse:
            qp = (
                qg.view(m, max_q, hkv, grp, d)
                .permute(0, 2, 1, 3, 4)
                .reshape(m, hkv, max_q * grp, d)
            )
            o, lse = _attend_lse(qp, kg, vg, mask, scale)  # [m,Hkv,max_q*G,D], [m,Hkv,max_q*G]
            o = o.view(m, hkv, max_q, grp, d).permute(0, 2, 1, 3, 4).reshape(m * max_q, hq, d)
            lse = lse.view(m, hkv, max_q, grp).permute(0, 2, 1, 3).reshape(m * max_q, hq)
            return o, lse
        o = F.scaled_dot_product_attention(
            qg.transpose(1, 2), kg, vg, attn_mask=mask, scale=scale, enable_gqa=grp > 1
        )  # [m, Hq, max_q, D]
        return o.transpose(1, 2).reshape(m * max_q, hq, d), None

    def _merge_prefix(
        self,
        c: _Cascade,
        q: Tensor,
        k_flat: Tensor,
        v_flat: Tensor,
        out: Tensor,
        lse_all: Tensor,
        scale: float,
    ) -> None:
        """Attend the cascade's rows to its shared prefix and merge into ``out`` and
        ``lse_all`` in place."""
        _, hq, d = q.shape
        hkv = k_flat.shape[1]
        grp = hq // hkv
        r = c.rows.shape[0]
        # all member rows as one batch: [1, Hkv, R*G, D] against [1, Hkv, Lp, D]
        qp = q.index_select(0, c.rows).view(r, hkv, grp, d).permute(1, 0, 2, 3)
        qp = qp.reshape(1, hkv, r * grp, d)
        kp = self._gather("k", k_flat, c.slots).permute(1, 0, 2).unsqueeze(0)
        vp = self._gather("v", v_flat, c.slots).permute(1, 0, 2).unsqueeze(0)
        o_p, lse_p = _attend_lse(qp, kp, vp, None, scale)
        o_p = o_p.view(hkv, r, grp, d).permute(1, 0, 2, 3).reshape(r, hq, d)
        lse_p = lse_p.view(hkv, r, grp).permute(1, 0, 2).reshape(r, hq)
        o_s = out.index_select(0, c.rows)
        lse_s = lse_all.index_select(0, c.rows)
        # softmax over the union of both key sets = weighted mix of the two partial results
        lse = torch.logaddexp(lse_s, lse_p)
        w_s = torch.exp(lse_s - lse).unsqueeze(-1)
        w_p = torch.exp(lse_p - lse).unsqueeze(-1)
        merged = (o_s.float() * w_s + o_p.float() * w_p).to(out.dtype)
        out.index_copy_(0, c.rows, merged)
        lse_all.index_copy_(0, c.rows, lse)


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
