"""PyTorch paged attention (the CPU production path): runs a ``TorchAttentionPlan``."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from batchgen.kernels.reference import dequantize_kv_ref, quantize_kv_ref
from batchgen.model import cpu_kernels
from batchgen.model.attention.metadata import AttentionMetadata
from batchgen.model.attention.torch_plan import (
    DECODE,
    FRESH,
    Cascade,
    Group,
    TorchAttentionPlan,
    build_torch_plan,
)
from batchgen.model.cpu_features import bf16_support

__all__ = ["TorchAttention"]

_QUANTIZED = (torch.int8, torch.float8_e4m3fn)


def _bytes(x: Tensor) -> Tensor:
    """A quantized tensor as its bytes (CPU index ops have no float8 kernels)."""
    return x.view(torch.uint8) if x.dtype == torch.float8_e4m3fn else x


# Decode/extend groups gather and attend in chunks of sequences of about this many K+V bytes.
_GATHER_CHUNK_BYTES = 16 << 20

# The CPU flash-attention op behind F.scaled_dot_product_attention; unlike SDPA it also returns
# the log-sum-exp. Private but stable across the torch versions we support; None elsewhere.
_flash_cpu = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _attend_lse(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    scale: float,
    softcap: float | None = None,
    is_causal: bool = False,
) -> tuple[Tensor, Tensor]:
    """Attention that also returns the log-sum-exp of the scores.

    q ``[n, H, Lq, D]``, k/v ``[n, Hk, Lk, D]`` (H a multiple of Hk), additive mask
    broadcastable to ``[n, H, Lq, Lk]`` or None (``is_causal``: a causal mask instead) -> out
    ``[n, H, Lq, D]``, lse ``[n, H, Lq]`` fp32. ``softcap``: scores capped by
    ``softcap * tanh(s / softcap)`` before the mask (the eager formula, not the CPU flash op).
    """
    if k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    if q.device.type == "cpu" and _flash_cpu is not None and softcap is None:
        out, lse = _flash_cpu(q, k, v, 0.0, is_causal, attn_mask=mask, scale=scale)
        return out, lse.float()
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if is_causal:
        lq, lk = scores.shape[-2:]
        hide = torch.ones(lq, lk, dtype=torch.bool, device=q.device).triu_(lk - lq + 1)
        scores = scores.masked_fill(hide, float("-inf"))
    if mask is not None:
        scores = scores + mask
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse[..., None]).to(v.dtype)
    return torch.matmul(probs, v), lse


def _attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    scale: float,
    softcap: float | None,
    is_causal: bool = False,
) -> Tensor:
    """``F.scaled_dot_product_attention`` (GQA: K/V heads shared by consecutive query heads), or
    with ``softcap`` the eager formula of :func:`_attend_lse`."""
    if softcap is not None:
        return _attend_lse(q, k, v, mask, scale, softcap, is_causal)[0]
    return F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=mask,
        is_causal=is_causal,
        scale=scale,
        enable_gqa=k.shape[1] != q.shape[1],
    )


def _rows(o: Tensor, lse: Tensor) -> tuple[Tensor, Tensor]:
    """Attention out ``[n, H, L, D]`` and lse ``[n, H, L]`` -> rows ``[n*L, H, D]``, ``[n*L, H]``."""
    n, h, length, d = o.shape
    return o.transpose(1, 2).reshape(n * length, h, d), lse.transpose(1, 2).reshape(n * length, h)


class TorchAttention:
    """PyTorch paged attention (the CPU production path).

    On a CPU fp32 or bf16 cache, and an int8 cache with fp32 or bf16 compute, every sequence and
    every cascade prefix runs in the C kernels of :mod:`batchgen.model.cpu_kernels` (they read
    the paged cache in place, int8 dequantized in registers) when they can be built,
    but for long fresh prefills on a bf16 cache on CPUs with AMX (PyTorch SDPA groups, see
    ``torch_plan``);
    ``native=False`` keeps everything in PyTorch (gathers and SDPA); ``avx512bf16=False`` uses
    the C kernels' portable variant. ``prepare`` builds the
    step's ``TorchAttentionPlan``; ``forward`` runs it for one layer. Holds grow-only gather
    buffers reused by every layer and step (a fresh allocation of tens of MB per gather costs more
    in page faults than the copy itself), so one instance must not run two forward passes
    concurrently.
    """

    def __init__(
        self, native: bool = True, avx512bf16: bool = True, fresh_sdpa: bool | None = None
    ) -> None:
        """``fresh_sdpa``: long bf16 fresh prefills go to PyTorch's SDPA instead of the C
        kernels (``torch_plan._FRESH_SDPA_MIN``); None: where the CPU has AMX."""
        self._workspace: dict[str, Tensor] = {}
        self._use_native = native
        self._avx512bf16 = avx512bf16  # the C kernels' variant (False: the portable one)
        if fresh_sdpa is None:
            fresh_sdpa = "AMX-BF16" in bf16_support().features
        self._fresh_sdpa = fresh_sdpa

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

    def _gather(
        self, name: str, flat: Tensor, slots: Tensor, scales: Tensor | None, dtype: torch.dtype
    ) -> Tensor:
        """``flat[slots]`` ([len(slots), Hkv, D]) into a reused buffer; of a quantized cache
        (``scales`` its ``[num_slots, Hkv]`` plane) dequantized to ``dtype``."""
        if scales is None:
            out = self._buffer(name, (slots.shape[0], *flat.shape[1:]), flat)
            return torch.index_select(flat, 0, slots, out=out)
        data = _bytes(flat).index_select(0, slots).view(flat.dtype)
        return dequantize_kv_ref(data, scales.index_select(0, slots), dtype)

    def prepare(
        self,
        meta: AttentionMetadata,
        kv_cache: Tensor,
        num_heads: int,
        dtype: torch.dtype | None = None,
        window: int | None = None,
        softcap: float | None = None,
    ) -> TorchAttentionPlan:
        """The step's plan (see ``AttentionBackend.prepare``): the C kernels for a CPU fp32 or
        bf16 cache when they can be built here (and ``native``), and for a quantized cache when
        they also support it (``supports_kv_dtype``), else PyTorch groups."""
        dtype = kv_cache.dtype if dtype is None else dtype
        kernels = (
            cpu_kernels.for_dtype(kv_cache.device, dtype, self._avx512bf16)
            if self._use_native
            else None
        )
        if kernels is not None and kv_cache.dtype != dtype:
            supports = getattr(kernels, "supports_kv_dtype", None)
            if supports is None or not supports(kv_cache.dtype, dtype):
                kernels = None
        block_size, num_kv_heads = kv_cache.shape[3], kv_cache.shape[4]
        return build_torch_plan(
            meta,
            block_size,
            num_heads // num_kv_heads,
            dtype,
            kernels,
            window,
            softcap,
            self._fresh_sdpa,
        )

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        plan: TorchAttentionPlan,
        scale: float,
        k_scale: Tensor | None = None,
        v_scale: Tensor | None = None,
        sinks: Tensor | None = None,
    ) -> Tensor:
        """See ``AttentionBackend.forward``. A quantized cache is read dequantized (to q's
        dtype) by the gathers, the step's own K/V included (FRESH groups use the stored rows).
        Sinks: every path also yields its rows' log-sum-exps, and the fp32 output is scaled by
        ``sigmoid(lse - sink)`` at the end (after any cascade merge)."""
        num_tokens, num_heads, head_dim = q.shape
        num_kv_heads = k.shape[1]
        meta, kernels = plan.meta, plan.kernels
        # write the new K/V; caches viewed as [num_slots, Hkv, D]
        k_flat = k_cache.view(-1, num_kv_heads, head_dim)
        v_flat = v_cache.view(-1, num_kv_heads, head_dim)
        scales: tuple[Tensor, Tensor] | None = None
        if k_cache.dtype in _QUANTIZED:
            assert k_scale is not None and v_scale is not None, "a quantized cache needs scales"
            scales = (k_scale.view(-1, num_kv_heads), v_scale.view(-1, num_kv_heads))
            if kernels is not None:
                kernels.store_kv(
                    k, v, k_cache, v_cache, meta.slot_mapping, k_scale=k_scale, v_scale=v_scale
                )
            else:
                for x, flat, sflat in ((k, k_flat, scales[0]), (v, v_flat, scales[1])):
                    xq, xs = quantize_kv_ref(x, k_cache.dtype)
                    _bytes(flat).index_copy_(0, meta.slot_mapping, _bytes(xq))
                    sflat.index_copy_(0, meta.slot_mapping, xs)
            if plan.groups:  # FRESH groups read the step's keys as stored, then dequantized
                k = self._gather("k_new", k_flat, meta.slot_mapping, scales[0], q.dtype)
                v = self._gather("v_new", v_flat, meta.slot_mapping, scales[1], q.dtype)
        elif kernels is not None:
            kernels.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        else:
            k_flat.index_copy_(0, meta.slot_mapping, k)
            v_flat.index_copy_(0, meta.slot_mapping, v)
        quant = {} if scales is None else {"k_scale": k_scale, "v_scale": v_scale}

        if (
            sinks is None
            and len(plan.groups) == 1
            and plan.groups[0].q_index is None
            and not plan.cascades
            and plan.cascade_batch is None
            and plan.native_seqs is None
            and plan.tiled_seqs is None
        ):
            return self._group(
                plan.groups[0], q, k, v, k_flat, v_flat, scale, scales, plan.softcap
            )[0]
        # a native cascade merge reads and rewrites out: fp32 until then (bf16 q: one rounding)
        cb = plan.cascade_batch
        fp32_out = cb is not None or sinks is not None
        out = q.new_empty(
            num_tokens, num_heads, head_dim, dtype=torch.float32 if fp32_out else q.dtype
        )
        with_lse = plan.cascades or cb is not None or sinks is not None
        lse_all = q.new_empty(num_tokens, num_heads, dtype=torch.float32) if with_lse else None
        for seqs, tiled in ((plan.native_seqs, False), (plan.tiled_seqs, True)):
            if seqs is None:
                continue
            assert kernels is not None  # kernel shares exist in native plans only
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
                window=plan.window,
                softcap=plan.softcap,
                **quant,
            )
        for g in plan.groups:
            # [n*max_q, Hq, D], [.., Hq]
            o, lse = self._group(
                g, q, k, v, k_flat, v_flat, scale, scales, plan.softcap, sinks is not None
            )
            if g.out_select is not None:
                o = o.index_select(0, g.out_select)
                lse = None if lse is None else lse.index_select(0, g.out_select)
            rows = (
                g.out_rows if g.out_rows is not None else torch.arange(num_tokens, device=q.device)
            )
            out.index_copy_(0, rows, o.to(out.dtype))  # fp32 out when a cascade merge follows
            if lse is not None:
                assert lse_all is not None
                lse_all.index_copy_(0, rows, lse)
        if cb is not None:  # attention and merge in one pass, the prefixes read in place
            assert lse_all is not None and kernels is not None
            kernels.prefix_attention_merge_(
                q, k_cache, v_cache, cb.slots, cb.slot_offsets, cb.rows, cb.row_offsets, out,
                lse_all, scale, **quant,
            )  # fmt: skip
        for c in plan.cascades:
            assert lse_all is not None
            self._merge_prefix(c, q, k_flat, v_flat, out, lse_all, scale, scales)
        if sinks is not None:  # softmax over the keys and the sink = the keys' share of it
            assert lse_all is not None
            out.mul_(torch.sigmoid(lse_all - sinks.float())[..., None])
        return out.to(q.dtype)

    def _group(
        self,
        g: Group,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        k_flat: Tensor,
        v_flat: Tensor,
        scale: float,
        scales: tuple[Tensor, Tensor] | None = None,
        softcap: float | None = None,
        need_lse: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """One padded group -> out ``[n*max_q, Hq, D]`` (padded rows included) and, for cascade
        members (or ``need_lse``), the log-sum-exp ``[n*max_q, Hq]``."""
        _, hq, d = q.shape
        hkv = k.shape[1]
        n, max_q, max_k = g.n, g.max_q, g.max_k
        qg = q if g.q_index is None else q.index_select(0, g.q_index)
        qg = qg.view(n, max_q, hq, d)

        if g.kind == FRESH:
            # keys are this step's rows; right padding is harmless under a causal mask
            kg = k if g.q_index is None else k.index_select(0, g.q_index)
            vg = v if g.q_index is None else v.index_select(0, g.q_index)
            kg = kg.view(n, max_q, hkv, d).transpose(1, 2)  # [n, Hkv, max_q, D]
            vg = vg.view(n, max_q, hkv, d).transpose(1, 2)
            if need_lse:
                o, lse = _attend_lse(qg.transpose(1, 2), kg, vg, None, scale, softcap, True)
                return _rows(o, lse)
            o = _attend(
                qg.transpose(1, 2), kg, vg, None, scale, softcap, is_causal=True
            )  # [n, Hq, max_q, D]
            return o.transpose(1, 2).reshape(n * max_q, hq, d), None

        # Gather and attend in chunks of sequences: a chunk's gathered K/V (at most
        # _GATHER_CHUNK_BYTES) is still in the CPU caches when attention reads it.
        assert g.k_slots is not None
        slots = g.k_slots.view(n, max_k)
        per_seq = 2 * max_k * hkv * d * q.element_size()  # gathered (dequantized) K+V
        step = max(1, _GATHER_CHUNK_BYTES // per_seq)
        if step >= n:
            return self._attend_cached(
                g, qg, slots, g.mask, k_flat, v_flat, scale, scales, softcap, need_lse
            )
        outs, lses = [], []
        for lo in range(0, n, step):
            hi = min(n, lo + step)
            mask = None if g.mask is None else g.mask[lo:hi]
            o, lse = self._attend_cached(
                g, qg[lo:hi], slots[lo:hi], mask, k_flat, v_flat, scale, scales, softcap, need_lse
            )
            outs.append(o)
            lses.append(lse)
        keep = g.want_lse or need_lse
        return torch.cat(outs), None if not keep else torch.cat(lses)  # type: ignore[arg-type]

    def _attend_cached(
        self,
        g: Group,
        qg: Tensor,
        slots: Tensor,
        mask: Tensor | None,
        k_flat: Tensor,
        v_flat: Tensor,
        scale: float,
        scales: tuple[Tensor, Tensor] | None = None,
        cap: float | None = None,
        need_lse: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """Sequences ``qg [m, max_q, Hq, D]`` against their gathered keys ``slots [m, max_k]``
        -> out ``[m*max_q, Hq, D]`` and (want_lse) lse ``[m*max_q, Hq]``."""
        m, max_q, hq, d = qg.shape
        max_k = slots.shape[1]
        hkv = k_flat.shape[1]
        grp = hq // hkv
        ks, vs = (None, None) if scales is None else scales
        flat_slots = slots.reshape(-1)
        kg = self._gather("k", k_flat, flat_slots, ks, qg.dtype)
        vg = self._gather("v", v_flat, flat_slots, vs, qg.dtype)
        kg = kg.view(m, max_k, hkv, d).transpose(1, 2)  # [m, Hkv, max_k, D]
        vg = vg.view(m, max_k, hkv, d).transpose(1, 2)
        if g.kind == DECODE:
            qp = qg.view(m, hkv, grp, d)  # the G heads sharing a KV head become G query rows
            if g.want_lse:
                o, lse = _attend_lse(qp, kg, vg, mask, scale, cap)  # [m,Hkv,G,D], [m,Hkv,G]
                return o.reshape(m, hq, d), lse.reshape(m, hq)
            if need_lse:
                o, lse = _attend_lse(qp, kg, vg, mask, scale, cap)
                return o.reshape(m, hq, d), lse.reshape(m, hq)
            o = _attend(qp, kg, vg, mask, scale, cap)
            return o.reshape(m, hq, d), None
        if g.want_lse:
            qp = (
                qg.view(m, max_q, hkv, grp, d)
                .permute(0, 2, 1, 3, 4)
                .reshape(m, hkv, max_q * grp, d)
            )
            o, lse = _attend_lse(qp, kg, vg, mask, scale, cap)  # [m,Hkv,max_q*G,D], [m,Hkv,max_q*G]
            o = o.view(m, hkv, max_q, grp, d).permute(0, 2, 1, 3, 4).reshape(m * max_q, hq, d)
            lse = lse.view(m, hkv, max_q, grp).permute(0, 2, 1, 3).reshape(m * max_q, hq)
            return o, lse
        if need_lse:
            return _rows(*_attend_lse(qg.transpose(1, 2), kg, vg, mask, scale, cap))
        o = _attend(qg.transpose(1, 2), kg, vg, mask, scale, cap)  # [m, Hq, max_q, D]
        return o.transpose(1, 2).reshape(m * max_q, hq, d), None

    def _merge_prefix(
        self,
        c: Cascade,
        q: Tensor,
        k_flat: Tensor,
        v_flat: Tensor,
        out: Tensor,
        lse_all: Tensor,
        scale: float,
        scales: tuple[Tensor, Tensor] | None = None,
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
        ks, vs = (None, None) if scales is None else scales
        kp = self._gather("k", k_flat, c.slots, ks, q.dtype).permute(1, 0, 2).unsqueeze(0)
        vp = self._gather("v", v_flat, c.slots, vs, q.dtype).permute(1, 0, 2).unsqueeze(0)
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
