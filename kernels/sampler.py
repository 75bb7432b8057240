"""The sampler's noise and exponential race as Triton kernels (one pass instead of ~28 int64
elementwise kernels over ``[S, V]``).

The formula is batchgen.engine.noise's (this package imports nothing of batchgen, so it is
restated here): the noise for vocab id ``i`` of a row with 64-bit state ``s`` is splitmix64's
output function of ``s + (i + 1) * GAMMA`` (unsigned, wrapping), turned into a float32 in (0, 1)
as ``hi * 2**-24 + lo * 2**-48`` (the 24-bit fields at bits 40 and 16), clamped to
``[2**-49, 1 - 2**-24]``. Every step is exact integer arithmetic or a power-of-two scaling
followed by one IEEE add, so the noise is bit-identical to the PyTorch and C versions.

The race draws ``argmax_i exp(s_i - max s) / E_i`` with ``s = logits / temperature`` and
``E_i = -log1p(-u_i)`` (computed in float64 and rounded: within an ulp of float32 ``log1p``),
the first maximum on ties: the token the PyTorch formula picks, up to float rounding in near
ties (the same contract as the C kernel's).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_launchable, check_same_device, is_interpreted

_BLOCK = 1024  # vocab entries per tile


@triton.jit
def _uniform(state, ids):
    """Float32 noise in (0, 1) for uint64 row states and int64 vocab ids (broadcasting)."""
    z = (ids.to(tl.uint64, bitcast=True) + 1) * 0x9E3779B97F4A7C15 + state
    z = z ^ (z >> 30)
    z = z * 0xBF58476D1CE4E5B9
    z = z ^ (z >> 27)
    z = z * 0x94D049BB133111EB
    z = z ^ (z >> 31)
    hi = ((z >> 40) & 0xFFFFFF).to(tl.int32).to(tl.float32)
    lo = ((z >> 16) & 0xFFFFFF).to(tl.int32).to(tl.float32)
    u = hi * 5.9604644775390625e-08 + lo * 3.552713678800501e-15  # 2**-24, 2**-48: exact
    return tl.minimum(tl.maximum(u, 1.7763568394002505e-15), 0.99999994039535522)


# The candidate width of filtered rows changes every step: not specialised.
@triton.jit(do_not_specialize=["num_ids", "stride_ids"])
def _uniform_noise_kernel(
    state_ptr,  # [S] int64
    ids_ptr,  # [S, K] or [1, K] int64, unit inner stride
    out_ptr,  # [S, K] float32, contiguous
    num_ids,
    stride_ids,  # 0 when every row shares one row of ids
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < num_ids
    state = tl.load(state_ptr + row).to(tl.uint64, bitcast=True)
    ids = tl.load(ids_ptr + row.to(tl.int64) * stride_ids + cols, mask=mask, other=0)
    u = _uniform(state, ids)
    tl.store(out_ptr + row.to(tl.int64) * num_ids + cols, u, mask=mask)


@triton.jit
def _race_draw_kernel(
    logits_ptr,  # [R, V] float32, unit inner stride
    temperature_ptr,  # [R] float32, > 0
    state_ptr,  # [R] int64
    out_ptr,  # [R] int64
    vocab_size,
    stride_row,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    base = logits_ptr + row.to(tl.int64) * stride_row
    t = tl.load(temperature_ptr + row)
    state = tl.load(state_ptr + row).to(tl.uint64, bitcast=True)
    # Pass 1: the row's largest scaled logit.
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    for start in range(0, vocab_size, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        s = tl.load(base + cols, mask=cols < vocab_size, other=float("-inf")) / t
        m = tl.maximum(m, s)
    row_max = tl.max(m, axis=0)
    # Pass 2: the race; the running best keeps the first maximum (strictly greater replaces).
    best = -1.0
    best_id = 0
    for start in range(0, vocab_size, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        valid = cols < vocab_size
        s = tl.load(base + cols, mask=valid, other=float("-inf")) / t
        u = _uniform(state, cols.to(tl.int64))
        e = (-tl.log(1.0 - u.to(tl.float64))).to(tl.float32)  # -log1p(-u), rounded once
        w = tl.where(valid, tl.exp(s - row_max) / e, -1.0)
        tile_best = tl.max(w, axis=0)
        tile_id = start + tl.argmax(w, axis=0)
        better = tile_best > best
        best_id = tl.where(better, tile_id, best_id)
        best = tl.where(better, tile_best, best)
    tl.store(out_ptr + row, best_id.to(tl.int64))


# ---------------------------------------------------------------------------------------------
# Filtered draw: top-k / top-p / min-p without sorting
# ---------------------------------------------------------------------------------------------
#
# Every filter keeps a prefix of the row in the order (probability desc, vocab id asc), which is
# the descending order of the key (bits, rid): ``bits`` the int32 bits of p (a non-negative
# float32 orders like its bits; -1 marks lanes past the vocabulary) and ``rid = V - 1 - id``. A
# prefix is named by its last key, a "cut" (cut_bits, cut_rid): a token is kept iff its key is
# >= the cut lexicographically. The kernel finds each filter's cut by searching key values (no
# sort), intersects the prefixes (the latest cut) and runs the race over the kept tokens.
#
# A search finds the largest level b with count(key >= b) >= c (and mass(key >= b) >= m),
# testing LEVELS evenly spaced levels per pass over the row: the probability bits below 2**30
# (2.0) take 6 passes of 32 levels, a 152k vocabulary's ids 4. The answer is the key of a token
# (the count or mass drops between b and b + 1), so a cut lands exactly on a token.
#
# The per-tile lines (p = exp(s - row_max) / z and the key) are written out in every loop rather
# than called: the interpreter re-patches triton.language on every nested jit call (milliseconds
# each, tl.sum and tl.max included), so loops accumulate per lane and reduce once.

_SEARCH_BLOCK = 128  # vocab entries per tile of a search pass ([_SEARCH_BLOCK, _LEVELS] counters)
_LEVELS = 32  # levels tested per search pass


@triton.jit
def _search(
    base, vocab_size, t, row_max, z,
    hi, min_count, min_mass, in_bits, in_rid, tie_bits,
    ON_IDS: tl.constexpr, MASS: tl.constexpr, BLOCK: tl.constexpr, LEVELS: tl.constexpr,
):  # fmt: skip
    """The largest level ``b`` in ``[0, hi)`` with ``count(key >= b) >= min_count`` (with MASS:
    whose tokens' probability mass is ``>= min_mass``), int32. Only tokens at or before the cut
    (in_bits, in_rid) count. The key is a token's probability bits, or with ON_IDS its rid if
    its bits equal ``tie_bits`` (-1 otherwise). Assumes level 0 qualifies and ``hi`` does not.
    """
    lo = tl.full((), 0, tl.int32)  # qualifies
    hi = hi + tl.full((), 0, tl.int32)  # does not (int32 tensors: loop-carried)
    steps = tl.arange(0, LEVELS).to(tl.int64) + 1  # [LEVELS]
    while hi - lo > 1:
        # level j of [lo, hi) is lo + width * j // (LEVELS + 1): 0 is lo, LEVELS + 1 is hi
        width = (hi - lo).to(tl.int64)
        levels = (lo + width * steps // (LEVELS + 1)).to(tl.int32)  # [LEVELS], ascending
        count = tl.full((BLOCK, LEVELS), 0, tl.int32)
        mass = tl.full((BLOCK, LEVELS), 0.0, tl.float32)
        for start in range(0, vocab_size, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            s = tl.load(base + cols, mask=cols < vocab_size, other=float("-inf")) / t
            p = tl.exp(s - row_max) / z
            bits = tl.where(cols < vocab_size, p.to(tl.int32, bitcast=True), -1)
            rid = vocab_size - 1 - cols
            inside = (bits > in_bits) | ((bits == in_bits) & (rid >= in_rid))
            if ON_IDS:
                key = tl.where(inside & (bits == tie_bits), rid, -1)
            else:
                key = tl.where(inside, bits, -1)
            ge = key[:, None] >= levels[None, :]  # [BLOCK, LEVELS]; levels >= 0 > -1
            if MASS:
                mass += tl.where(ge, p[:, None], 0.0)
            else:
                count += ge.to(tl.int32)
        if MASS:
            # each level's mass is summed in the same order, so it never grows with the level
            ok = tl.sum(mass, axis=0) >= min_mass  # [LEVELS]
        else:
            ok = tl.sum(count, axis=0) >= min_count
        n_ok = tl.sum(ok.to(tl.int32), axis=0)  # ok holds for the first n_ok levels
        new_lo = lo + (width * n_ok // (LEVELS + 1)).to(tl.int32)
        hi = lo + (width * (n_ok + 1) // (LEVELS + 1)).to(tl.int32)
        lo = new_lo
    return lo


@triton.jit
def _count_at(base, vocab_size, t, row_max, z, level, in_bits, in_rid, BLOCK: tl.constexpr):
    """Among the tokens at or before the cut (in_bits, in_rid): how many have probability bits
    above ``level`` and equal to it (int32), and the mass of those above (float32)."""
    above = tl.full((BLOCK,), 0, tl.int32)
    equal = tl.full((BLOCK,), 0, tl.int32)
    mass = tl.full((BLOCK,), 0.0, tl.float32)
    for start in range(0, vocab_size, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        s = tl.load(base + cols, mask=cols < vocab_size, other=float("-inf")) / t
        p = tl.exp(s - row_max) / z
        bits = tl.where(cols < vocab_size, p.to(tl.int32, bitcast=True), -1)
        rid = vocab_size - 1 - cols
        inside = (bits > in_bits) | ((bits == in_bits) & (rid >= in_rid))
        key = tl.where(inside, bits, -1)
        above += (key > level).to(tl.int32)
        equal += (key == level).to(tl.int32)
        mass += tl.where(key > level, p, 0.0)
    return tl.sum(above, axis=0), tl.sum(equal, axis=0), tl.sum(mass, axis=0)


@triton.jit
def _later_cut(bits_a, rid_a, bits_b, rid_b):
    """The later of two cuts: the shorter prefix, i.e. the intersection of the two kept sets."""
    a_later = (bits_a > bits_b) | ((bits_a == bits_b) & (rid_a >= rid_b))
    return tl.where(a_later, bits_a, bits_b), tl.where(a_later, rid_a, rid_b)


# The per-row settings are often views into one packed [6, S] tensor, 16-byte aligned or not
# depending on S: their alignment is not specialised (scalar loads gain nothing from it).
@triton.jit(
    do_not_specialize_on_alignment=[
        "temperature_ptr", "top_k_ptr", "top_p_ptr", "min_p_ptr", "state_ptr"
    ]
)  # fmt: skip
def _filtered_draw_kernel(
    logits_ptr,  # [R, V] float32, unit inner stride
    temperature_ptr,  # [R] float32, > 0
    top_k_ptr,  # [R] int64, 0 = off (so is >= V)
    top_p_ptr,  # [R] float32, 1 = off
    min_p_ptr,  # [R] float32, 0 = off
    state_ptr,  # [R] int64
    out_ptr,  # [R] int64 tokens
    mask_ptr,  # [R, V] int8 kept mask, contiguous (written with KEEP only)
    vocab_size,
    stride_row,
    KEEP: tl.constexpr,
    BLOCK: tl.constexpr,
    SEARCH_BLOCK: tl.constexpr,
    LEVELS: tl.constexpr,
):
    row = tl.program_id(0)
    base = logits_ptr + row.to(tl.int64) * stride_row
    t = tl.load(temperature_ptr + row)
    # The row's largest scaled logit and the softmax normaliser; p = exp(s - row_max) / z.
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    for start in range(0, vocab_size, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        m = tl.maximum(m, tl.load(base + cols, mask=cols < vocab_size, other=float("-inf")) / t)
    row_max = tl.max(m, axis=0)
    acc = tl.full([BLOCK], 0.0, tl.float32)
    for start in range(0, vocab_size, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        s = tl.load(base + cols, mask=cols < vocab_size, other=float("-inf")) / t
        acc += tl.exp(s - row_max)
    z = tl.sum(acc, axis=0)
    p_max = tl.exp(row_max - row_max) / z  # the top token's p, computed as the others'

    # Top-k: the k-th key. Its value is the largest level with >= k tokens at or above it; when
    # more tokens share it than the top k still needs, the smallest ids among them are kept.
    # (Probability searches run below 0x40000000, the bits of 2.0.)
    k = tl.load(top_k_ptr + row)
    k_on = (k > 0) & (k < vocab_size)
    k32 = tl.minimum(tl.maximum(k, 0), vocab_size).to(tl.int32)
    k_bits = tl.full((), -1, tl.int32)  # the cut (-1, 0) keeps every token
    k_rid = tl.full((), 0, tl.int32)
    if k_on:
        k_bits = _search(
            base, vocab_size, t, row_max, z, 0x40000000, k32, -1.0, -1, 0, 0,
            False, False, SEARCH_BLOCK, LEVELS,
        )  # fmt: skip
        above, ties, unused = _count_at(base, vocab_size, t, row_max, z, k_bits, -1, 0, BLOCK)
        needed = k32 - above  # tokens of probability bits k_bits in the top k, >= 1
        if needed < ties:
            k_rid = _search(
                base, vocab_size, t, row_max, z, vocab_size, needed, -1.0, -1, 0, k_bits,
                True, False, SEARCH_BLOCK, LEVELS,
            )  # fmt: skip

    # Top-p over what top-k kept: keep a token iff the mass before it is short of the target
    # top_p * mass (mass 1 without top-k), so the cut is the first token whose mass at or before
    # it reaches the target: its value is the largest level whose mass at or above does.
    top_p = tl.load(top_p_ptr + row)
    p_bits = tl.full((), -1, tl.int32)
    p_rid = tl.full((), 0, tl.int32)
    if top_p < 1.0:
        mass = tl.full((), 1.0, tl.float32)
        if k_on:
            kept_mass = tl.full([BLOCK], 0.0, tl.float32)
            for start in range(0, vocab_size, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                s = tl.load(base + cols, mask=cols < vocab_size, other=float("-inf")) / t
                p = tl.exp(s - row_max) / z
                bits = tl.where(cols < vocab_size, p.to(tl.int32, bitcast=True), -1)
                rid = vocab_size - 1 - cols
                in_k = (bits > k_bits) | ((bits == k_bits) & (rid >= k_rid))
                kept_mass += tl.where(in_k, p, 0.0)
            mass = tl.sum(kept_mass, axis=0)
        # A positive target: the top token is always kept (as a top_p <= 0 draws it).
        target = tl.maximum(top_p * mass, 1e-38)
        p_bits = _search(
            base, vocab_size, t, row_max, z, 0x40000000, 0, target, k_bits, k_rid, 0,
            False, True, SEARCH_BLOCK, LEVELS,
        )  # fmt: skip
        above, ties, mass_above = _count_at(
            base, vocab_size, t, row_max, z, p_bits, k_bits, k_rid, BLOCK
        )
        # The i-th token of value p_v has mass_above + (i - 1) * p_v before it: the first
        # ceil((target - mass_above) / p_v) are kept (at least one; all of them when p_v is 0).
        p_v = p_bits.to(tl.float32, bitcast=True)
        share = tl.minimum((target - mass_above) / tl.where(p_v > 0.0, p_v, 1.0), ties)
        needed = tl.where(p_v > 0.0, tl.maximum(tl.ceil(share).to(tl.int32), 1), ties)
        if needed < ties:
            p_rid = _search(
                base, vocab_size, t, row_max, z, vocab_size, needed, -1.0, k_bits, k_rid,
                p_bits, True, False, SEARCH_BLOCK, LEVELS,
            )  # fmt: skip

    # Min-p keeps p >= min_p * p_max: a cut at that value (capped at p_max: the top token stays).
    min_p = tl.load(min_p_ptr + row)
    m_bits = tl.minimum(min_p * p_max, p_max).to(tl.int32, bitcast=True)
    cut_bits, cut_rid = _later_cut(k_bits, k_rid, p_bits, p_rid)
    cut_bits, cut_rid = _later_cut(cut_bits, cut_rid, m_bits, 0)

    # The race over the kept tokens, argmax p / E with the first maximum (smallest id): each
    # lane keeps its best so far (strictly greater replaces), then the lanes compare.
    state = tl.load(state_ptr + row).to(tl.uint64, bitcast=True)
    lane_w = tl.full([BLOCK], -1.0, tl.float32)
    lane_id = tl.full([BLOCK], 0, tl.int32)
    for start in range(0, vocab_size, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        s = tl.load(base + cols, mask=cols < vocab_size, other=float("-inf")) / t
        p = tl.exp(s - row_max) / z
        bits = tl.where(cols < vocab_size, p.to(tl.int32, bitcast=True), -1)
        rid = vocab_size - 1 - cols
        kept = (bits > cut_bits) | ((bits == cut_bits) & (rid >= cut_rid))
        if KEEP:
            mask_row = mask_ptr + row.to(tl.int64) * vocab_size
            tl.store(mask_row + cols, kept.to(tl.int8), mask=cols < vocab_size)
        u = _uniform(state, cols.to(tl.int64))
        e = (-tl.log(1.0 - u.to(tl.float64))).to(tl.float32)  # -log1p(-u), rounded once
        w = tl.where(kept, p / e, -1.0)
        better = w > lane_w
        lane_id = tl.where(better, cols, lane_id)
        lane_w = tl.where(better, w, lane_w)
    best = tl.max(lane_w, axis=0)
    best_id = tl.min(tl.where(lane_w == best, lane_id, vocab_size), axis=0)
    tl.store(out_ptr + row, best_id.to(tl.int64))


def uniform_noise(state: torch.Tensor, ids: torch.Tensor, num_ids: int) -> torch.Tensor:
    """``SamplerKernels.uniform_noise``: row states ``[S]`` int64, vocab ids ``[S, K]`` or
    ``[1, K]`` int64 (contiguous rows) -> ``[S, K]`` float32 noise, bit-identical to
    ``batchgen.engine.noise.uniform_at``."""
    if state.dtype != torch.int64 or ids.dtype != torch.int64 or ids.dim() != 2:
        raise ValueError("need state [S] int64 and ids [S, K] or [1, K] int64")
    num_rows = state.shape[0]
    if ids.shape[1] != num_ids or ids.shape[0] not in (1, num_rows):
        raise ValueError(f"ids {tuple(ids.shape)} do not fit {num_rows} rows of {num_ids}")
    ids = ids.contiguous()
    out = torch.empty((num_rows, num_ids), dtype=torch.float32, device=state.device)
    check_same_device(state, ids, out)
    if num_rows == 0 or num_ids == 0:
        return out
    check_launchable(_uniform_noise_kernel, state)
    stride = 0 if ids.shape[0] == 1 else ids.stride(0)
    grid = (num_rows, triton.cdiv(num_ids, _BLOCK))
    _uniform_noise_kernel[grid](state.contiguous(), ids, out, num_ids, stride, BLOCK=_BLOCK)
    return out


def race_draw(logits: torch.Tensor, temperature: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """``SamplerKernels.race_draw``: ``[R, V]`` float32 logits, ``[R]`` float32 temperatures
    (> 0), ``[R]`` int64 row states -> ``[R]`` int64 tokens drawn from softmax(logits / t)."""
    if logits.dim() != 2 or logits.dtype != torch.float32:
        raise ValueError("need [R, V] float32 logits")
    num_rows, vocab_size = logits.shape
    if temperature.shape != (num_rows,) or state.shape != (num_rows,):
        raise ValueError("temperature and state need one entry per row")
    logits = logits if logits.stride(1) == 1 else logits.contiguous()
    out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    check_same_device(logits, temperature, state, out)
    if num_rows == 0:
        return out
    check_launchable(_race_draw_kernel, logits)
    _race_draw_kernel[(num_rows,)](
        logits,
        temperature.to(torch.float32).contiguous(),
        state.contiguous(),
        out,
        vocab_size,
        logits.stride(0),
        BLOCK=_BLOCK,
    )
    return out


def _filtered_launch(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    state: torch.Tensor,
    keep: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Check the arguments and run _filtered_draw_kernel: tokens [R] int64 and, with ``keep``,
    the kept mask [R, V] bool."""
    if logits.dim() != 2 or logits.dtype != torch.float32:
        raise ValueError("need [R, V] float32 logits")
    num_rows, vocab_size = logits.shape
    if vocab_size >= 2**31 - 1:
        raise ValueError("vocabulary too large for int32 ids")
    per_row = (temperature, top_k, top_p, min_p, state)
    if any(x.shape != (num_rows,) for x in per_row):
        raise ValueError("temperature, top_k, top_p, min_p and state need one entry per row")
    if top_k.dtype != torch.int64 or state.dtype != torch.int64:
        raise ValueError("top_k and state must be int64")
    logits = logits if logits.stride(1) == 1 else logits.contiguous()
    out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    mask = torch.empty(
        (num_rows, vocab_size) if keep else (1,), dtype=torch.int8, device=out.device
    )
    check_same_device(logits, *per_row, out)
    if num_rows == 0:
        return out, (mask.bool() if keep else None)
    check_launchable(_filtered_draw_kernel, logits)
    block, search_block = _BLOCK, _SEARCH_BLOCK
    if is_interpreted(_filtered_draw_kernel):
        # Interpreted ops cost about the same for any tile size: fewer, wider tiles (512 still
        # leaves the tests' 1100-token rows several tiles per search pass).
        block = min(_BLOCK, triton.next_power_of_2(vocab_size))
        search_block = min(512, triton.next_power_of_2(vocab_size))
    _filtered_draw_kernel[(num_rows,)](
        logits,
        temperature.to(torch.float32).contiguous(),
        top_k.contiguous(),
        top_p.to(torch.float32).contiguous(),
        min_p.to(torch.float32).contiguous(),
        state.contiguous(),
        out,
        mask,
        vocab_size,
        logits.stride(0),
        KEEP=keep,
        BLOCK=block,
        SEARCH_BLOCK=search_block,
        LEVELS=_LEVELS,
    )
    return out, (mask.bool() if keep else None)


def filtered_draw(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    state: torch.Tensor,
) -> torch.Tensor:
    """``SamplerKernels.filtered_draw``: ``[R, V]`` float32 logits, ``[R]`` temperatures (> 0),
    top_k (int64, 0 = off), top_p, min_p and int64 row states -> ``[R]`` int64 tokens drawn from
    softmax(logits / t) restricted by top-k, then top-p, then min-p (the rules of
    ``batchgen.engine.sampler``; ties in probability are cut by vocab id)."""
    return _filtered_launch(logits, temperature, top_k, top_p, min_p, state, keep=False)[0]


def filtered_keep(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`filtered_draw` that also returns its kept set (for tests): ``([R, V] bool kept
    mask, [R] int64 tokens)``, from the same launch. Tokens of probability 0 inside the kept
    prefix are marked too; they never win the race."""
    tokens, kept = _filtered_launch(logits, temperature, top_k, top_p, min_p, state, keep=True)
    assert kept is not None
    return kept, tokens


__all__ = ["filtered_draw", "filtered_keep", "race_draw", "uniform_noise"]
