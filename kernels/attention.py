"""Causal attention of this step's query tokens over a paged KV cache.

One kernel serves prefill, prefill over a cached prefix ("extend") and decode. ``store_kv`` has
already written this step's keys and values, so every key of a sequence (cached prefix and new
tokens alike) is reached through its block table; no path is special.

Work split (GQA "query blocks"): a program owns one KV head and ``BLOCK_Q`` consecutive query
tokens of one sequence, together with all ``G = Hq / Hkv`` query heads that share that KV head.
The ``BLOCK_Q * G`` (token, head) pairs are packed into the M dimension of ``tl.dot`` (row
``m`` is token ``m // G``, head ``kv_head * G + m % G``), so each K/V tile is read once per KV
head and M is at least 16 even for decode.

Split-K ("flash-decoding"): with few sequences and one query token each, the 2D grid has too few
programs to fill the GPU. A third grid axis then divides each sequence's key range into
``num_splits`` segments; every segment writes an fp32 partial output normalised by its own
softmax sum and its log-sum-exp (base 2), and ``_merge_splits_kernel`` combines them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_launchable, check_same_device, is_interpreted

# log2(e): the kernels use exp2, so scores are pre-multiplied by scale * LOG2E.
_LOG2E = 1.4426950408889634

# Split-K heuristics (num_splits=None): split only decode-only steps whose 2D grid would not
# fill the GPU, give each split at least this many keys, and use at most this many splits.
_MIN_KEYS_PER_SPLIT = 256
_MAX_SPLITS = 64  # 28:4 at one sequence: 4 KV heads x 64 splits = 256 programs on 132 SMs


@triton.jit
def _find_sequence(cu_seqlens_q_ptr, num_seqs, pid, BLOCK_Q: tl.constexpr):
    """Sequence owning query block ``pid`` of the flattened grid.

    Sequence b's query blocks start at ``cu_seqlens_q[b] // BLOCK_Q + b``. That start is
    non-decreasing in b and leaves room for ``cdiv(q_len_b, BLOCK_Q)`` blocks, so the grid
    ``T // BLOCK_Q + B`` is an upper bound computed without reading device memory. Returns the
    largest b with ``start(b) <= pid`` (binary search; start(0) = 0 <= pid always).
    """
    # Both bounds are int32 tensors even when the launcher turns num_seqs == 1 into a constant,
    # so the loop-carried types stay fixed.
    lo = pid * 0
    hi = lo + num_seqs  # invariant: start(lo) <= pid, and hi == num_seqs or start(hi) > pid
    while hi - lo > 1:
        mid = (lo + hi) // 2
        start = tl.load(cu_seqlens_q_ptr + mid) // BLOCK_Q + mid
        if start <= pid:
            lo = mid
        else:
            hi = mid
    return lo


# Per-step integers are not specialised (a value of 1 or a multiple of 16 would otherwise make a
# new binary mid-run): the sequence count and the block-table width change every step. Nor is
# the alignment of the per-sequence metadata, which a mixed step passes as offset views (read
# with scalar loads, alignment buys nothing there).
_PER_STEP_INTS = ["num_seqs", "stride_bt"]
_PER_STEP_POINTERS = ["block_tables_ptr", "cu_seqlens_q_ptr", "seq_lens_ptr"]


@triton.jit(do_not_specialize=_PER_STEP_INTS, do_not_specialize_on_alignment=_PER_STEP_POINTERS)
def _paged_attention_kernel(
    q_ptr,  # [T, Hq, D]
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    block_tables_ptr,  # [B, max_blocks] int32
    cu_seqlens_q_ptr,  # [B + 1] int32
    seq_lens_ptr,  # [B] int32, keys per sequence including this step's tokens
    out_ptr,  # [T, Hq, D] (NUM_SPLITS == 1)
    part_out_ptr,  # [T, Hq, NUM_SPLITS, D] fp32, contiguous (NUM_SPLITS > 1)
    part_lse_ptr,  # [T, Hq, NUM_SPLITS] fp32, contiguous (NUM_SPLITS > 1)
    qk_scale,  # softmax scale * log2(e)
    num_seqs,
    num_heads,
    head_dim,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_vd,
    stride_bt,
    stride_ot,
    stride_oh,
    stride_od,
    NUM_QUERIES_PER_KV: tl.constexpr,  # G = Hq / Hkv
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    BLOCK_M: tl.constexpr,  # rows per program = BLOCK_Q * G rounded up to a power of two
    BLOCK_Q: tl.constexpr,  # query tokens per program
    TILE_N: tl.constexpr,  # keys per loop iteration (independent of BLOCK_SIZE)
    BLOCK_D: tl.constexpr,  # next_pow2(head_dim)
    NUM_SPLITS: tl.constexpr,  # 1: write out directly; > 1: write partials for the merge
    DOT_DTYPE: tl.constexpr,  # dtype of tl.dot operands (fp32 for fp32 input and interpreted bf16)
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 operands (GPU default is TF32); else None
    # A quantized cache (int8 / fp8 e4m3): fp32 scales [num_blocks, block_size, Hkv]; a key or
    # value is dequantized in registers as cache (widened to fp32) * scale, then cast to
    # DOT_DTYPE. Float caches: KV_QUANT False, the scale arguments unused.
    k_scale_ptr,
    v_scale_ptr,
    stride_ksb,
    stride_kss,
    stride_ksh,
    stride_vsb,
    stride_vss,
    stride_vsh,
    KV_QUANT: tl.constexpr,
    window,  # sliding window W: a query at position p sees keys p-W+1 .. p; 0: no window
    softcap2,  # scores s (base 2) -> softcap2 * tanh(s / softcap2) (HAS_SOFTCAP)
    sinks_ptr,  # [Hq] fp32 sink logits (HAS_SINKS): one more softmax term per head, no value
    HAS_SOFTCAP: tl.constexpr = False,
    HAS_SINKS: tl.constexpr = False,
    ONE_QUERY_PER_SEQ: tl.constexpr = False,  # every sequence has one query token; BLOCK_Q == 1
):
    tl.static_assert(BLOCK_M >= 16)
    tl.static_assert(TILE_N >= 16)
    tl.static_assert(BLOCK_D >= 16)
    G: tl.constexpr = NUM_QUERIES_PER_KV

    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    if ONE_QUERY_PER_SEQ:  # a decode launch: program pid serves sequence pid (grid = B)
        seq = pid
        q_block = 0
    else:
        seq = _find_sequence(cu_seqlens_q_ptr, num_seqs, pid, BLOCK_Q)
        q_block = pid - (tl.load(cu_seqlens_q_ptr + seq) // BLOCK_Q + seq)  # within the sequence
    q_first = tl.load(cu_seqlens_q_ptr + seq)  # first query token of the sequence in q
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_first
    if q_block * BLOCK_Q >= q_len:
        return  # slack of the upper-bound grid
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len  # keys before this step's first query token

    # Row m of the tile: query token q_block * BLOCK_Q + m // G, query head kv_head * G + m % G.
    rows = tl.arange(0, BLOCK_M)
    tok = q_block * BLOCK_Q + rows // G  # [BLOCK_M] token index within the sequence
    head = kv_head * G + rows % G  # [BLOCK_M]
    row_valid = (rows < BLOCK_Q * G) & (tok < q_len)
    q_pos = context_len + tok  # [BLOCK_M] absolute position; attends to keys <= q_pos
    dims = tl.arange(0, BLOCK_D)
    dim_valid = dims < head_dim

    tok64 = (q_first + tok).to(tl.int64)
    head64 = head.to(tl.int64)
    dims64 = dims.to(tl.int64)
    q_off = tok64[:, None] * stride_qt + head64[:, None] * stride_qh + dims64[None, :] * stride_qd
    q_mask = row_valid[:, None] & dim_valid[None, :]
    q = tl.load(q_ptr + q_off, mask=q_mask, other=0.0).to(DOT_DTYPE)  # [BLOCK_M, BLOCK_D]

    # Keys this program needs: [kv_lo, kv_end), from the first query's window (0 without one)
    # to the furthest query position of the block plus one; tiles before kv_lo are not read.
    last_tok = tl.minimum(q_block * BLOCK_Q + BLOCK_Q, q_len) - 1
    kv_end = context_len + last_tok + 1  # <= seq_len
    kv_lo = tl.where(window > 0, tl.maximum(context_len + q_block * BLOCK_Q - window + 1, 0), 0)
    tile_first = kv_lo // TILE_N
    num_tiles = tl.cdiv(kv_end, TILE_N)
    tiles_per_split = tl.cdiv(num_tiles - tile_first, NUM_SPLITS)
    tile_lo = tile_first + split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)  # may be <= tile_lo: empty split

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # running max (base-2 logits)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # running softmax denominator
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)  # running numerator

    kv_head64 = kv_head.to(tl.int64)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for tile in range(tile_lo, tile_hi):
        key_pos = tile * TILE_N + tl.arange(0, TILE_N)  # [TILE_N]
        key_valid = key_pos < kv_end
        # Block-table entries past the sequence are padding (may be anything): masked.
        block = tl.load(bt_row + key_pos // BLOCK_SIZE, mask=key_valid, other=0).to(tl.int64)
        slot_off = key_pos % BLOCK_SIZE

        kv_mask_t = dim_valid[:, None] & key_valid[None, :]  # [BLOCK_D, TILE_N]
        k_off = (
            block[None, :] * stride_kb
            + slot_off[None, :] * stride_ks
            + kv_head64 * stride_kh
            + dims64[:, None] * stride_kd
        )
        k = tl.load(k_cache_ptr + k_off, mask=kv_mask_t, other=0.0)  # [BLOCK_D, TILE_N]
        if KV_QUANT:
            ks_off = block * stride_ksb + slot_off * stride_kss + kv_head64 * stride_ksh
            k_scale = tl.load(k_scale_ptr + ks_off, mask=key_valid, other=0.0)  # [TILE_N]
            k = k.to(tl.float32) * k_scale[None, :]
        k = k.to(DOT_DTYPE)

        s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, TILE_N] fp32
        if HAS_SOFTCAP:  # tanh(x) = 1 - 2 / (e^(2x) + 1); |x| <= 15 (tanh is +-1 in fp32 there)
            # keeps e^(2x) finite; 2 x log2(e): exp2 of it is e^(2x)
            x = tl.minimum(tl.maximum(s / softcap2, -15.0), 15.0)
            s = softcap2 * (1.0 - 2.0 / (tl.exp2(2.8853900817779268 * x) + 1.0))
        causal = (key_pos[None, :] <= q_pos[:, None]) & key_valid[None, :]
        causal = causal & ((key_pos[None, :] > q_pos[:, None] - window) | (window == 0))
        s = tl.where(causal, s, float("-inf"))

        # Online softmax. A row can be fully masked in a tile (and, with split-K, in a whole
        # split), so guard -inf - -inf.
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])  # [BLOCK_M, TILE_N]; exp2(-inf) = 0
        alpha = tl.exp2(m_i - m_safe)  # rescales the old state; 0 while m_i is -inf
        l_i = l_i * alpha + tl.sum(p, axis=1)

        v_mask = key_valid[:, None] & dim_valid[None, :]  # [TILE_N, BLOCK_D]
        v_off = (
            block[:, None] * stride_vb
            + slot_off[:, None] * stride_vs
            + kv_head64 * stride_vh
            + dims64[None, :] * stride_vd
        )
        v = tl.load(v_cache_ptr + v_off, mask=v_mask, other=0.0)  # [TILE_N, BLOCK_D]
        if KV_QUANT:
            vs_off = block * stride_vsb + slot_off * stride_vss + kv_head64 * stride_vsh
            v_scale = tl.load(v_scale_ptr + vs_off, mask=key_valid, other=0.0)  # [TILE_N]
            v = v.to(tl.float32) * v_scale[:, None]
        v = v.to(DOT_DTYPE)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision=DOT_PRECISION)
        m_i = m_new

    if NUM_SPLITS == 1:
        # Every valid row saw its own key, so l_i > 0 there.
        if HAS_SINKS:  # the sink's term exp(sink) joins the denominator only
            sink = tl.load(sinks_ptr + head, mask=row_valid, other=0.0) * 1.4426950408889634
            l_i = l_i + tl.exp2(sink - tl.where(m_i == float("-inf"), 0.0, m_i))
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        o = acc / l_safe[:, None]
        o_off = (
            tok64[:, None] * stride_ot + head64[:, None] * stride_oh + dims64[None, :] * stride_od
        )
        tl.store(out_ptr + o_off, o.to(out_ptr.dtype.element_ty), mask=q_mask)
    else:
        # Partial output normalised by its own sum, plus its base-2 log-sum-exp
        # (-inf for an empty split, whose output is 0 and gets weight 0 in the merge).
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        o = acc / l_safe[:, None]
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
        row64 = tok64 * num_heads + head64  # (token, head) row of the partials
        po_off = (row64[:, None] * NUM_SPLITS + split) * head_dim + dims64[None, :]
        tl.store(part_out_ptr + po_off, o, mask=q_mask)
        tl.store(part_lse_ptr + row64 * NUM_SPLITS + split, lse, mask=row_valid)


@triton.jit
def _merge_splits_kernel(
    part_out_ptr,  # [T, Hq, NUM_SPLITS, D] fp32, contiguous
    part_lse_ptr,  # [T, Hq, NUM_SPLITS] fp32, contiguous, base-2 log-sum-exp
    out_ptr,  # [T, Hq, D]
    num_heads,
    head_dim,
    stride_ot,
    stride_oh,
    stride_od,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,  # next_pow2(NUM_SPLITS)
    BLOCK_D: tl.constexpr,  # next_pow2(head_dim)
):
    # Grid: (T, Hq). out = sum_s w_s * o_s / sum_s w_s with w_s = 2^(lse_s - max lse).
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    row = tok * num_heads + head

    splits = tl.arange(0, BLOCK_S)
    dims = tl.arange(0, BLOCK_D)
    split_valid = splits < NUM_SPLITS
    lse = tl.load(part_lse_ptr + row * NUM_SPLITS + splits, mask=split_valid, other=float("-inf"))
    lse_max = tl.max(lse, axis=0)  # finite: split 0 always holds key 0
    w = tl.where(lse == float("-inf"), 0.0, tl.exp2(lse - lse_max))  # [BLOCK_S]
    mask = split_valid[:, None] & (dims[None, :] < head_dim)
    o = tl.load(
        part_out_ptr + (row * NUM_SPLITS + splits[:, None]) * head_dim + dims[None, :],
        mask=mask,
        other=0.0,
    )  # [BLOCK_S, BLOCK_D]
    merged = tl.sum(o * w[:, None], axis=0) / tl.sum(w, axis=0)
    o_off = tok * stride_ot + head * stride_oh + dims.to(tl.int64) * stride_od
    tl.store(out_ptr + o_off, merged.to(out_ptr.dtype.element_ty), mask=dims < head_dim)


def _device_sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; a nominal 128 elsewhere (the interpreter)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 128


def split_buckets() -> list[int]:
    """Every value :func:`choose_num_splits` returns: the powers of two up to ``_MAX_SPLITS``
    (NUM_SPLITS is a constexpr, one binary per value; warm-up compiles these)."""
    return [1 << i for i in range(_MAX_SPLITS.bit_length()) if 1 << i <= _MAX_SPLITS]


def choose_num_splits(
    num_seqs: int, num_kv_heads: int, max_seqlen_q: int, max_seqlen_k: int, sm_count: int
) -> int:
    """Number of key-range splits used when ``paged_attention(num_splits=None)``.

    Split only decode-only steps (``max_seqlen_q == 1``, so one program per sequence and KV
    head) whose ``num_seqs * Hkv`` programs would leave SMs idle; aim at about two programs per
    SM, and never give a split fewer than ``_MIN_KEYS_PER_SPLIT`` keys, below which the extra
    partial writes and the merge cost more than the parallelism gains. The result is a power of
    two (rounded down), so a long job compiles at most ``len(split_buckets())`` variants.
    """
    programs = num_seqs * num_kv_heads
    if max_seqlen_q != 1 or programs >= sm_count:
        return 1
    wanted = triton.cdiv(2 * sm_count, programs)
    by_length = max(1, max_seqlen_k // _MIN_KEYS_PER_SPLIT)
    splits = max(1, min(_MAX_SPLITS, wanted, by_length))
    return 1 << (splits.bit_length() - 1)


def _launch_config(max_seqlen_q: int, group: int, fp32_dot: bool) -> tuple[int, int, int, int]:
    """(BLOCK_M, TILE_N, num_warps, num_stages) for a step; BLOCK_M is >= 16 and >= G.

    Decode keeps M small: one token's G heads are all a program has. Prefill uses a taller M so
    each K/V tile serves more query tokens. fp32 operands (IEEE products, no tensor cores) need
    smaller tiles to stay in registers. Chosen from sm_90 compiles (no register spills, about
    80-180 registers a thread; see scripts/bench_kernels.py --compile-only), not yet from
    timings on a GPU.
    """
    pow2_group = triton.next_power_of_2(group)
    if max_seqlen_q == 1:
        block_m = max(16, pow2_group)
        if block_m == 16:
            return block_m, 64, 4, 3
        if block_m == 32:
            return block_m, 32 if fp32_dot else 64, 4, 3
        return (block_m, 16, 8, 2) if fp32_dot else (block_m, 32, 4, 2)
    if fp32_dot:
        return max(64, pow2_group), 16, 8, 2
    if max_seqlen_q <= 64:
        return max(64, pow2_group), 32, 4, 2
    return max(128, pow2_group), 64, 8, 2


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seqlen_q: int,
    max_seqlen_k: int,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    num_decode_seqs: int = 0,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of ``q`` over the paged cache; returns ``out [T, Hq, D]`` in q's dtype.

    Args:
        q: ``[T, Hq, D]`` query tokens of B sequences, concatenated; any strides.
        k_cache, v_cache: ``[num_blocks, block_size, Hkv, D]``, any strides, same dtype as q,
            or int8 / float8_e4m3fn (quantized, with scales). This step's keys and values must
            already be stored (``store_kv``).
        block_tables: ``[B, max_blocks]`` int32; entries past a sequence's length are ignored.
        cu_seqlens_q: ``[B + 1]`` int32 prefix sums of query lengths; ``cu_seqlens_q[B] == T``.
        seq_lens: ``[B]`` int32 keys per sequence, this step's tokens included (>= query length).
        scale: softmax scale, usually ``D ** -0.5``.
        max_seqlen_q, max_seqlen_k: host-side maxima of query lengths and ``seq_lens``, used for
            launch decisions only (no device-to-host sync).
        out: optional ``[T, Hq, D]`` output (any strides, q's dtype).
        num_splits: key-range splits; None chooses (split-K only for decode-only steps with few
            sequences), 1 forces the single-pass kernel, > 1 forces split-K with that many.
        num_decode_seqs: host-side promise that the first ``num_decode_seqs`` sequences have one
            query token each; in a mixed step they are launched apart, with the decode launch
            configuration (0: one launch for the whole step).
        k_scale, v_scale: a quantized cache's fp32 scales ``[num_blocks, block_size, Hkv]``,
            any strides; keys and values are read as ``cache * scale``. None for a float cache.
        window: a sliding window W: the query at position p sees keys ``p-W+1 .. p`` only (the
            tiles before its block's first window are not read); None: every key up to p.
        softcap: scores ``s = scale * q.k`` become ``softcap * tanh(s / softcap)`` before the
            softmax; None: as they are.
        sinks: ``[Hq]`` fp32 learned sink logits: each head's softmax has one more term
            ``exp(sink)`` with no value (gpt-oss); forces one pass (no split-K).

    Query token i of sequence b sits at position ``seq_lens[b] - q_len_b + i`` and attends to
    keys at positions ``<=`` that. Softmax and accumulation are in fp32.
    """
    if q.dim() != 3:
        raise ValueError(f"q must be [T, Hq, D], got {q.shape}")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"caches must be [num_blocks, block_size, Hkv, D], got {k_cache.shape}, {v_cache.shape}"
        )
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_dim = k_cache.shape
    if cache_dim != head_dim or num_heads % num_kv_heads != 0:
        raise ValueError(f"q {q.shape} does not fit the cache {k_cache.shape}")
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"unsupported dtype {q.dtype}")
    kv_quant = k_cache.dtype in (torch.int8, torch.float8_e4m3fn)
    if v_cache.dtype != k_cache.dtype or not (kv_quant or k_cache.dtype == q.dtype):
        raise ValueError(f"q is {q.dtype} but the caches are {k_cache.dtype}, {v_cache.dtype}")
    if kv_quant:
        for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
            if t is None or t.shape != k_cache.shape[:3] or t.dtype != torch.float32:
                raise ValueError(
                    f"a {k_cache.dtype} cache needs {name} {tuple(k_cache.shape[:3])} fp32"
                )
    elif k_scale is not None or v_scale is not None:
        raise ValueError(f"scales given for a {k_cache.dtype} cache")
    else:
        k_scale = v_scale = k_cache  # unused placeholders
    assert k_scale is not None and v_scale is not None
    num_seqs = seq_lens.shape[0]
    if cu_seqlens_q.shape != (num_seqs + 1,) or block_tables.dim() != 2:
        raise ValueError("need cu_seqlens_q [B+1], seq_lens [B] and block_tables [B, max_blocks]")
    if block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows for {num_seqs} sequences")
    for name, t in (
        ("block_tables", block_tables),
        ("cu_seqlens_q", cu_seqlens_q),
        ("seq_lens", seq_lens),
    ):
        if t.dtype != torch.int32:
            raise ValueError(f"{name} must be int32, got {t.dtype}")
    # The kernel indexes these with unit inner strides (no-ops when already contiguous).
    block_tables, cu_seqlens_q, seq_lens = (
        block_tables.contiguous(),
        cu_seqlens_q.contiguous(),
        seq_lens.contiguous(),
    )
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype:
        raise ValueError(
            f"out must be {tuple(q.shape)} {q.dtype}, got {tuple(out.shape)} {out.dtype}"
        )
    check_same_device(
        q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, out, k_scale, v_scale
    )
    if num_tokens == 0 or num_seqs == 0:
        return out
    check_launchable(_paged_attention_kernel, q)
    if not 0 <= num_decode_seqs <= num_seqs:
        raise ValueError(f"num_decode_seqs must be in [0, {num_seqs}], got {num_decode_seqs}")
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    if sinks is not None:
        if sinks.shape != (num_heads,) or sinks.dtype != torch.float32:
            raise ValueError(
                f"sinks must be [{num_heads}] fp32, got {tuple(sinks.shape)} {sinks.dtype}"
            )
        check_same_device(q, sinks)
        num_splits = 1
    extra = (window or 0, softcap, sinks)
    nd = num_decode_seqs
    if 0 < nd < num_seqs and max_seqlen_q > 1:
        # A mixed step: the leading decodes get the decode configuration (small M, split-K),
        # the rest the prefill one. Views only, plus one tiny shift of cu_seqlens_q; no sync.
        common = (k_cache, v_cache, scale, max_seqlen_k, num_splits, k_scale, v_scale, *extra)
        _launch(q[:nd], block_tables[:nd], cu_seqlens_q[: nd + 1], seq_lens[:nd], 1, out[:nd],
                *common)  # fmt: skip
        _launch(q[nd:], block_tables[nd:], cu_seqlens_q[nd:] - nd, seq_lens[nd:], max_seqlen_q,
                out[nd:], *common)  # fmt: skip
        return out
    _launch(q, block_tables, cu_seqlens_q, seq_lens, max_seqlen_q, out,
            k_cache, v_cache, scale, max_seqlen_k, num_splits, k_scale, v_scale,
            *extra)  # fmt: skip
    return out


def _launch(
    q: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seqlen_q: int,
    out: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scale: float,
    max_seqlen_k: int,
    num_splits: int | None,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    window: int = 0,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> None:
    """Launch the attention kernel (and the merge) with one configuration for all of q's
    sequences (checked arguments; ``cu_seqlens_q[0] == 0``; for a float cache the scales are
    placeholders; ``window`` 0: none)."""
    num_tokens, num_heads, head_dim = q.shape
    kv_quant = k_cache.dtype in (torch.int8, torch.float8_e4m3fn)
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = seq_lens.shape[0]
    # The interpreter multiplies bf16 bit patterns in tl.dot (triton#11584): use fp32 operands.
    # fp32 input stays fp32 with IEEE products rather than the GPU's default TF32.
    interpreted_bf16 = q.dtype == torch.bfloat16 and is_interpreted(_paged_attention_kernel)
    if q.dtype == torch.float32 or interpreted_bf16:
        dot_dtype, dot_precision = tl.float32, "ieee"
    else:
        dot_dtype, dot_precision = (tl.float16 if q.dtype == torch.float16 else tl.bfloat16), None

    group = num_heads // num_kv_heads
    block_m, tile_n, num_warps, num_stages = _launch_config(
        max_seqlen_q, group, fp32_dot=q.dtype == torch.float32
    )
    block_d = max(16, triton.next_power_of_2(head_dim))
    decode = max_seqlen_q == 1
    if decode:  # one program per sequence: no search, no idle programs in the grid
        block_q, num_q_blocks = 1, num_seqs
    else:
        block_q = max(1, block_m // group)
        num_q_blocks = num_tokens // block_q + num_seqs  # upper bound, see _find_sequence

    if num_splits is None:
        num_splits = choose_num_splits(
            num_seqs, num_kv_heads, max_seqlen_q, max_seqlen_k, _device_sm_count(q.device)
        )

    if num_splits == 1:
        part_out = part_lse = out  # unused placeholders
    else:
        part_out = torch.empty(
            (num_tokens, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device
        )
        part_lse = torch.empty(
            (num_tokens, num_heads, num_splits), dtype=torch.float32, device=q.device
        )

    grid = (num_q_blocks, num_kv_heads, num_splits)
    _paged_attention_kernel[grid](
        q,
        k_cache,
        v_cache,
        block_tables,
        cu_seqlens_q,
        seq_lens,
        out,
        part_out,
        part_lse,
        scale * _LOG2E,
        num_seqs,
        num_heads,
        head_dim,
        *q.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        block_tables.stride(0),
        *out.stride(),
        NUM_QUERIES_PER_KV=group,
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        TILE_N=tile_n,
        BLOCK_D=block_d,
        NUM_SPLITS=num_splits,
        DOT_DTYPE=dot_dtype,
        DOT_PRECISION=dot_precision,
        k_scale_ptr=k_scale,
        v_scale_ptr=v_scale,
        **dict(zip(("stride_ksb", "stride_kss", "stride_ksh"), k_scale.stride()[:3], strict=True)),
        **dict(zip(("stride_vsb", "stride_vss", "stride_vsh"), v_scale.stride()[:3], strict=True)),
        KV_QUANT=kv_quant,
        window=window,
        softcap2=(softcap or 1.0) * _LOG2E,
        sinks_ptr=out if sinks is None else sinks,
        HAS_SOFTCAP=softcap is not None,
        HAS_SINKS=sinks is not None,
        ONE_QUERY_PER_SEQ=decode,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if num_splits > 1:
        _merge_splits_kernel[(num_tokens, num_heads)](
            part_out,
            part_lse,
            out,
            num_heads,
            head_dim,
            *out.stride(),
            NUM_SPLITS=num_splits,
            BLOCK_S=triton.next_power_of_2(num_splits),
            BLOCK_D=block_d,
            num_warps=4,
        )


__all__ = ["choose_num_splits", "paged_attention", "split_buckets"]
