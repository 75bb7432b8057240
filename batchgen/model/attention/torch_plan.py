"""The torch backend's plan of one step: how the step's sequences are attended.

Per step (``TorchAttention.prepare``) the sequences are split into a few padded *groups*; per
layer each group costs one K and one V gather from the flattened cache and one attention call.
Two further ideas:

- Decode groups pack the G query heads of a KV head as G query rows ([n, Hkv, G, D]), so K/V
  heads are never expanded. Extend groups that need the log-sum-exp pack heads the same way.
- Cascade: sequences whose block tables start with the same cached blocks (a shared system
  prompt, the samples of one prompt) attend to that shared prefix in ONE call (all their query
  rows against the prefix keys, gathered once) and to their own remaining keys in their groups;
  the two partial results are merged with their log-sum-exps. This turns most of the decode
  gather traffic of shared-prefix workloads into one small matmul.

With the C kernels (CPU fp32 or bf16 caches, ``native`` plans), every sequence goes to them
instead of to a group (they read the paged cache in place), except long fresh prefills on a bf16
cache on CPUs with AMX, which PyTorch's bf16 SDPA computes faster there (FRESH groups, see
``_FRESH_SDPA_MIN``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from batchgen.model.attention.metadata import AttentionMetadata
from batchgen.model.cpu_kernels import CpuKernels

__all__ = [
    "DECODE",
    "EXTEND",
    "FRESH",
    "Cascade",
    "CascadeBatch",
    "Group",
    "TorchAttentionPlan",
    "build_torch_plan",
]

# Sequence classes. Each class is split into groups of similar shape.
DECODE = 0  # one new token: q [n, Hkv, G, D] against gathered keys
FRESH = 1  # no cached prefix (q_len == seq_len > 1): keys are the new k rows, causal mask
EXTEND = 2  # new tokens after cached keys: gathered keys, explicit offset-causal mask

# Cost of one extra group (one more attention call and a few index ops per layer), in the units
# of ``_cost``. Merging two groups is worth it while the padding it adds costs less than this.
_GROUP_OVERHEAD = 8192
# In native plans a sequence whose new tokens times the query heads per KV head fill at least this
# many query rows (one 16-lane tile) goes to the C kernel's tiled variant; fewer rows (decodes,
# short extends) to its per-token variant, which wastes no lanes.
_TILED_MIN_ROWS = 16
# In bf16 native plans on CPUs with AMX (``fresh_sdpa``) a fresh prefill (no cached keys) of at
# least this many tokens goes to a PyTorch SDPA group instead: there the C kernel's tiled variant
# computes in fp32 (AVX512-BF16 dot products measured slower than its fp32 FMAs on an AMX CPU),
# while PyTorch's bf16 SDPA runs its matmuls on oneDNN's AMX kernels. Measured on an AMX Xeon, 1
# thread, 8:2 and 14:2 heads of 64: the kernel is faster up to ~128 tokens, even at 256, 2.2-2.6x
# slower at 512. Without AMX, SDPA is the slower one at every length (AMD EPYC with AVX512-BF16, 2
# threads, 2 x 1,024 tokens of 8:2 heads: tiled kernel 6.8 ms, SDPA 17.9 ms;
# scripts/bench_cpu_kernels.py --bf16-only).
_FRESH_SDPA_MIN = 256
# A shared prefix becomes a cascade when it saves at least this many gathered key positions.
_CASCADE_MIN_SAVED = 256


def _cost(n: int, max_q: int, max_k: int, group: int) -> int:
    """Work of a padded group: attention (q rows x heads per KV head x keys) plus the gather."""
    return n * max_k * (max_q * group + 1)


@dataclass
class Group:
    """One padded attention call: ``n`` sequences padded to ``max_q`` new tokens and ``max_k`` keys."""

    kind: int
    n: int
    max_q: int
    max_k: int
    want_lse: bool  # members of a cascade: heads packed as rows, float mask, keep the lse
    q_index: Tensor | None  # [n*max_q] int64 rows of q (padding clamps to the seq's last row);
    #                         None: the group is rows 0..T-1 in order, without padding
    k_slots: Tensor | None  # [n*max_k] int64 cache slots (padding clamps to the seq's last key);
    #                         None for FRESH (its keys are the new k rows at q_index)
    mask: Tensor | None  # additive (0 / -inf, q's dtype); None: attend to all keys.
    #                      DECODE [n,1,1,max_k]; EXTEND [n,1,max_q,max_k], or packed (want_lse)
    #                      [n,1,max_q*G,max_k] with row i*G+g for token i, head g
    out_select: Tensor | None  # [m] valid rows among the n*max_q padded rows; None: all valid
    out_rows: Tensor | None  # [m] destination rows in the output; None: identity


@dataclass
class Cascade:
    """A shared cached prefix: every row in ``rows`` sees every key in ``slots``."""

    rows: Tensor  # [R] int64 q rows of the member sequences' new tokens
    slots: Tensor  # [Lp] int64 cache slots of the shared prefix, in position order


@dataclass
class CascadeBatch:
    """Every cascade of a step, concatenated for one C call: cascade c has the cache slots
    ``slots[slot_offsets[c]:slot_offsets[c+1]]`` and the q rows likewise."""

    slots: Tensor  # [sum Lp] int64
    slot_offsets: Tensor  # [C+1] int64
    rows: Tensor  # [sum R] int64
    row_offsets: Tensor  # [C+1] int64


@dataclass(frozen=True)
class TorchAttentionPlan:
    """One step's attention work, built once per step (``TorchAttention.prepare``) and run by
    every layer: gather indices and masks of the PyTorch groups and cascades, or the C kernels'
    shares."""

    meta: AttentionMetadata  # the step
    kernels: CpuKernels | None  # the C kernels of ``native`` plans; None: PyTorch only
    num_tokens: int
    groups: list[Group]
    cascades: list[Cascade]  # PyTorch plans
    cascade_batch: CascadeBatch | None = None  # native plans: all cascades, one C call
    # the C kernels' share (``native`` plans: every sequence but bf16 long fresh prefills), one
    # call each
    native_seqs: Tensor | None = None  # [m] int32 sequences for the per-token kernel
    tiled_seqs: Tensor | None = None  # [m] int32 sequences for the tiled kernel
    k_start: Tensor | None = None  # [B] int32 first key each sequence attends to (cascades,
    #                                 windows)
    window: int | None = None  # the layers' sliding window; None: full causal attention
    softcap: float | None = None  # scores -> softcap * tanh(score / softcap); None: as they are


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
    kernels: CpuKernels | None = None,
    window: int | None = None,
    softcap: float | None = None,
    fresh_sdpa: bool = False,
) -> TorchAttentionPlan:
    """Turn the step metadata into padded groups (and cascades) with gather indices and masks;
    ``group`` = Hq // Hkv, ``dtype`` q's (float masks are in it).

    ``kernels`` given (a ``native`` plan): every sequence goes to the C kernels, which read the
    paged cache in place (``native_seqs`` / ``tiled_seqs``, split by ``_TILED_MIN_ROWS``),
    instead of into gathered SDPA groups, except, on a bf16 cache with ``fresh_sdpa`` (CPUs with
    AMX), fresh prefills of at least ``_FRESH_SDPA_MIN`` tokens (FRESH groups: SDPA on the step's
    own K/V, no gather); the shared
    prefixes of cascades go to a C kernel too (one call for all of them, merged into the other
    kernels' results by log-sum-exp).

    ``window`` (the plan of layers with a sliding window W): each sequence's keys start at its
    first new token's window (``p - W + 1``), masks hide the keys before each row's window, a
    fresh prefill longer than W is attended like an extend, and there are no cascades (a shared
    prefix is not in every row's window). ``softcap``: the scores are capped (no cascades either).

    One host sync per step (the B+1 offsets and B lengths, and the block-table rows of cascade
    candidates); the groups' index tensors are built with vectorized ops on the metadata's
    device, the cascades' rows and slots from those host lists.
    """
    native = kernels is not None
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
    found = [] if window or softcap else _find_cascades(meta, q_lens, k_lens, block_size)
    if window:  # keys before the first new token's window are never read
        start = [max(0, k_lens[b] - q_lens[b] - window + 1) for b in range(num_seqs)]
    rows_of: list[list[int]] = []  # per cascade: the members' q rows
    slots_of: list[list[int]] = []  # and the prefix's cache slots, in position order
    for members, blocks in found:
        for b in members:
            start[b] = len(blocks) * block_size
        rows_of.append([r for b in members for r in range(cu[b], cu[b + 1])])
        slots_of.append([blk * block_size + i for blk in blocks for i in range(block_size)])
    cascades: list[Cascade] = []
    if not native:
        cascades = [
            Cascade(torch.tensor(r, device=dev), torch.tensor(sl, device=dev))
            for r, sl in zip(rows_of, slots_of, strict=True)
        ]
    rel_k = [k_lens[b] - start[b] for b in range(num_seqs)]  # keys each group attends to

    classes: dict[tuple[int, bool], list[int]] = {}
    native_seqs: list[int] = []
    tiled_seqs: list[int] = []
    for b in range(num_seqs):
        # a fresh prefill within the window: plain causal attention on the step's own K/V
        fresh = q_lens[b] == k_lens[b] and (window is None or q_lens[b] <= window)
        sdpa_fresh = (
            fresh_sdpa and fresh and dtype == torch.bfloat16 and q_lens[b] >= _FRESH_SDPA_MIN
        )
        if native and not sdpa_fresh:
            (tiled_seqs if q_lens[b] * group >= _TILED_MIN_ROWS else native_seqs).append(b)
            continue
        member = start[b] > 0 and not window  # a cascade's (a window's start is no prefix)
        if q_lens[b] == 1:
            kind = DECODE
        elif fresh:
            kind = FRESH
        else:
            kind = EXTEND
        classes.setdefault((kind, member), []).append(b)

    groups: list[Group] = []
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
            if kind != FRESH:
                # Padding keys are clamped to the sequence's last key, so every gathered slot has
                # been written: a stray read of an unused block (e.g. NaN) can never leak in.
                ar_k = torch.arange(max_k, device=dev)
                rel = torch.minimum(ar_k[None, :], k_len[:, None] - 1)  # [n, max_k]
                pos = k_off[:, None] + rel
                table = meta.block_tables.index_select(0, idx).to(torch.int64)  # [n, max_blocks]
                blocks = table.gather(1, torch.div(pos, block_size, rounding_mode="floor"))
                k_slots = (blocks * block_size + pos % block_size).reshape(-1)
                if kind == DECODE:
                    if any(rel_k[b] != max_k for b in seqs):
                        mask = (ar_k[None, :] < k_len[:, None])[:, None, None, :]
                else:
                    # new token i is at relative position k_len - q_len + i; it sees keys <= it
                    q_pos = (k_len - q_len)[:, None] + ar_q[None, :]  # [n, max_q]
                    mask = (ar_k[None, None, :] <= q_pos[:, :, None])[:, None]  # [n,1,max_q,max_k]
                    if window:  # and keys > its position - W
                        mask &= (ar_k[None, None, :] > q_pos[:, :, None] - window)[:, None]
                    if member:
                        mask = mask.repeat_interleave(group, dim=2)  # packed rows i*G+g
                if mask is not None:  # additive form, as SDPA would convert it at every call
                    mask = torch.zeros(mask.shape, dtype=dtype, device=dev).masked_fill_(
                        ~mask, float("-inf")
                    )
            groups.append(
                Group(kind, n, max_q, max_k, member, q_index, k_slots, mask, out_select, out_rows)
            )
    cascade_batch = k_start = None
    if native and (found or window):
        k_start = torch.tensor(start, dtype=torch.int32)
    if native and found:
        cascade_batch = CascadeBatch(
            torch.tensor([x for sl in slots_of for x in sl], dtype=torch.int64),
            torch.tensor([0] + [len(sl) for sl in slots_of]).cumsum(0),
            torch.tensor([x for r in rows_of for x in r], dtype=torch.int64),
            torch.tensor([0] + [len(r) for r in rows_of]).cumsum(0),
        )
    return TorchAttentionPlan(
        meta,
        kernels,
        num_tokens,
        groups,
        cascades,
        cascade_batch,
        torch.tensor(native_seqs, dtype=torch.int32) if native_seqs else None,
        torch.tensor(tiled_seqs, dtype=torch.int32) if tiled_seqs else None,
        k_start,
        window,
        softcap,
    )
