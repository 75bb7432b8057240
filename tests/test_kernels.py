"""Triton kernels against their PyTorch references (batchgen.kernels.reference).

In a CPU session the kernels run under Triton's interpreter (tests/devices.py sets
TRITON_INTERPRET=1 before anything imports them), which costs about 5 ms per tile iteration per
program: shapes are small and the parameter grid is sampled, not crossed. In a GPU session
(BATCHGEN_TEST_GPU=1) the same tests (marked ``kernel``) run compiled on the GPU.

Every cache slot that no sequence uses holds NaN, and block-table padding points at an unused
(NaN) block, so any read the kernels should not make turns the output NaN.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from batchgen.kernels import choose_num_splits, copy_blocks, paged_attention, store_kv
from batchgen.kernels.attention import split_buckets
from batchgen.kernels.reference import copy_blocks_ref, paged_attention_ref, store_kv_ref
from tests.devices import kernel_device
from tests.optional import require

pytestmark = pytest.mark.kernel
DEVICE = torch.device(kernel_device())
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
REPO = Path(__file__).resolve().parents[1]

# (atol, rtol) per dtype: fp32 runs IEEE dots; fp16/bf16 outputs differ by output rounding
# plus P cast to the input dtype before the P @ V product on the GPU.
TOLERANCE = {F32: (2e-5, 1e-5), F16: (5e-3, 5e-3), BF16: (2.5e-2, 2e-2)}


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def nan_kv_cache(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """``[L, 2, num_blocks, block_size, Hkv, D]`` filled with NaN."""
    shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
    return torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)


# --------------------------------------------------------------------------------------------
# store_kv
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype, head_dim, block_size, num_kv_heads, num_tokens",
    [
        (F32, 64, 16, 2, 23),
        (F16, 80, 4, 3, 9),
        (BF16, 128, 1, 1, 6),
        (F16, 128, 16, 8, 37),
        (BF16, 64, 32, 4, 40),
    ],
)
def test_store_kv_matches_reference(
    dtype: torch.dtype, head_dim: int, block_size: int, num_kv_heads: int, num_tokens: int
) -> None:
    gen = torch.Generator().manual_seed(num_tokens)
    num_blocks = cdiv(num_tokens, block_size) + 3
    kv_cache = nan_kv_cache(2, num_blocks, block_size, num_kv_heads, head_dim, dtype)
    # k, v as strided views of one fused projection output [T, 3, Hkv, D] (not contiguous).
    qkv = torch.randn(num_tokens, 3, num_kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    k, v = qkv[:, 1], qkv[:, 2]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[torch.randperm(num_tokens, generator=gen)[: max(1, num_tokens // 5)]] = -1  # padding
    slots[0] = -7  # any negative slot is padding
    slots = slots.to(DEVICE)

    expected = kv_cache.clone()
    store_kv_ref(k, v, expected[1, 0], expected[1, 1], slots)
    store_kv(k, v, kv_cache[1, 0], kv_cache[1, 1], slots)
    torch.testing.assert_close(kv_cache, expected, rtol=0, atol=0, equal_nan=True)
    assert kv_cache[0].isnan().all(), "another layer was written"


def test_store_kv_casts_to_cache_dtype_and_skips_all_padding() -> None:
    kv_cache = nan_kv_cache(1, 4, 16, 2, 64, F16)
    k = torch.randn(5, 2, 64, device=DEVICE)  # fp32 input into an fp16 cache
    v = torch.randn(5, 2, 64, device=DEVICE)
    slots = torch.tensor([3, 17, 63, 0, 40], device=DEVICE)
    expected = kv_cache.clone()
    store_kv_ref(k, v, expected[0, 0], expected[0, 1], slots)
    store_kv(k, v, kv_cache[0, 0], kv_cache[0, 1], slots)
    torch.testing.assert_close(kv_cache, expected, rtol=0, atol=0, equal_nan=True)

    before = kv_cache.clone()
    store_kv(k, v, kv_cache[0, 0], kv_cache[0, 1], torch.full((5,), -1, device=DEVICE))
    store_kv(k[:0], v[:0], kv_cache[0, 0], kv_cache[0, 1], slots[:0])
    torch.testing.assert_close(kv_cache, before, rtol=0, atol=0, equal_nan=True)


# --------------------------------------------------------------------------------------------
# copy_blocks
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype, head_dim, block_size, num_kv_heads, num_layers",
    [
        (F32, 64, 16, 2, 2),
        (F16, 80, 4, 3, 3),
        (BF16, 128, 1, 1, 2),
        (BF16, 64, 16, 8, 1),
    ],
)
def test_copy_blocks_matches_reference(
    dtype: torch.dtype, head_dim: int, block_size: int, num_kv_heads: int, num_layers: int
) -> None:
    gen = torch.Generator().manual_seed(head_dim + block_size)
    num_blocks = 12
    shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
    kv_cache = torch.randn(shape, generator=gen).to(dtype).to(DEVICE)
    kv_cache[:, :, 5, block_size // 2 :] = float("nan")  # a partial block copies its NaN tail too
    # Block 5 (partially NaN) and one block copied twice; no destination is also a source.
    others = [b for b in torch.randperm(num_blocks, generator=gen).tolist() if b != 5]
    src = torch.tensor([others[0], others[1], others[0], 5], device=DEVICE)
    dst = torch.tensor(others[2:6], device=DEVICE)

    expected = kv_cache.clone()
    copy_blocks_ref(expected, src, dst)
    copy_blocks(kv_cache, src, dst)
    torch.testing.assert_close(kv_cache, expected, rtol=0, atol=0, equal_nan=True)

    before = kv_cache.clone()
    copy_blocks(kv_cache, src[:0], dst[:0])
    torch.testing.assert_close(kv_cache, before, rtol=0, atol=0, equal_nan=True)


# --------------------------------------------------------------------------------------------
# paged_attention
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AttnCase:
    """One batch: ``seqs`` is ``(q_len, seq_len)`` per sequence, seq_len counting the new tokens.

    q_len == 1 is decode, q_len == seq_len a fresh prefill, anything between a prefill over a
    cached prefix.
    """

    seqs: tuple[tuple[int, int], ...]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    num_splits: int | None = 1
    block_size: int = 16
    share: bool = False  # later sequences reuse blocks of sequence 0 (radix-cache style)

    def __str__(self) -> str:
        seqs = "+".join(f"{q}/{k}" for q, k in self.seqs)
        dtype = str(self.dtype).removeprefix("torch.")
        share = "-shared" if self.share else ""
        return (
            f"{seqs}-h{self.num_heads}kv{self.num_kv_heads}-d{self.head_dim}-{dtype}"
            f"-bs{self.block_size}-split{self.num_splits}{share}"
        )


@dataclass
class AttnInputs:
    """Tensors for one paged_attention call; ``kv_cache`` owns k_cache and v_cache."""

    q: torch.Tensor
    kv_cache: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int

    def args(self) -> tuple:
        scale = self.q.shape[-1] ** -0.5
        return (
            self.q,
            self.k_cache,
            self.v_cache,
            self.block_tables,
            self.cu_seqlens_q,
            self.seq_lens,
            scale,
            self.max_seqlen_q,
            self.max_seqlen_k,
        )


def build_inputs(
    case: AttnCase, seed: int = 0, layer: int = 1, spare_blocks: int = 3
) -> AttnInputs:
    """Random queries and a NaN-filled cache in which only the slots the batch reads are set.

    Physical blocks come from a random permutation; with ``share`` each later sequence starts
    with some of sequence 0's blocks (a shared prefix, possibly a partially filled block that the
    other sequence fills further). Block-table padding points at a spare NaN block.
    """
    gen = torch.Generator().manual_seed(seed)
    bs, hkv, d = case.block_size, case.num_kv_heads, case.head_dim
    blocks_per_seq = [cdiv(seq_len, bs) for _, seq_len in case.seqs]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    spare = perm[-1]
    max_blocks = max(blocks_per_seq) + 2  # every row has padding entries
    tables: list[list[int]] = []
    next_free = 0
    for b, n in enumerate(blocks_per_seq):
        # Share about half of sequence 0's blocks, at least one (possibly its partial last one).
        shared = min(n, blocks_per_seq[0]) // 2 + 1 if case.share and b else 0
        shared = min(shared, n, blocks_per_seq[0])
        row = tables[0][:shared] if shared else []
        row = row + perm[next_free : next_free + n - shared]
        next_free += n - shared
        tables.append(row + [spare] * (max_blocks - n))
    block_tables = torch.tensor(tables, dtype=torch.int32)

    kv_cache = nan_kv_cache(layer + 1, num_blocks, bs, hkv, d, case.dtype)
    k_cache, v_cache = kv_cache[layer, 0], kv_cache[layer, 1]
    # Content is a function of the physical slot, so shared blocks agree between sequences.
    k_all = torch.randn(num_blocks, bs, hkv, d, generator=gen).to(case.dtype).to(DEVICE)
    v_all = torch.randn(num_blocks, bs, hkv, d, generator=gen).to(case.dtype).to(DEVICE)
    for b, (_, seq_len) in enumerate(case.seqs):
        pos = torch.arange(seq_len)
        blk = block_tables[b, pos // bs].long().to(DEVICE)
        off = (pos % bs).to(DEVICE)
        k_cache[blk, off] = k_all[blk, off]
        v_cache[blk, off] = v_all[blk, off]

    q_lens = [q for q, _ in case.seqs]
    cu = [0]
    for q_len in q_lens:
        cu.append(cu[-1] + q_len)
    q = torch.randn(cu[-1], case.num_heads, d, generator=gen).to(case.dtype).to(DEVICE)
    return AttnInputs(
        q=q,
        kv_cache=kv_cache,
        k_cache=k_cache,
        v_cache=v_cache,
        block_tables=block_tables.to(DEVICE),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor([k for _, k in case.seqs], dtype=torch.int32, device=DEVICE),
        max_seqlen_q=max(q_lens),
        max_seqlen_k=max(k for _, k in case.seqs),
    )


def assert_attention_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    assert torch.isfinite(actual).all(), "NaN/inf in the output: a masked or unused slot was read"
    atol, rtol = TOLERANCE[actual.dtype]
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)


MIXED = ((1, 130), (17, 37), (5, 5), (1, 16), (5, 130))

ATTENTION_CASES = [
    # decode over context lengths 1, 15, 16, 17, 37, 130
    AttnCase(((1, 1), (1, 15), (1, 16), (1, 17)), 4, 4, 64, F32),
    AttnCase(((1, 1), (1, 15), (1, 16), (1, 17)), 4, 2, 128, F16, num_splits=4),
    AttnCase(((1, 37), (1, 130)), 8, 2, 80, F16, num_splits=3, share=True),
    AttnCase(((1, 130), (1, 130), (1, 37)), 6, 2, 64, F32, num_splits=None, share=True),
    AttnCase(((1, 37), (1, 130)), 6, 2, 128, BF16),
    AttnCase(((1, 37),), 2, 1, 64, F32, num_splits=16),  # more splits than tiles: empty splits
    # fresh prefill
    AttnCase(((5, 5), (17, 17)), 2, 2, 64, F32),
    AttnCase(((17, 17), (1, 1)), 4, 1, 128, F16),
    AttnCase(((130, 130),), 4, 2, 64, F16),  # max_seqlen_q > 64: the tall-M config
    AttnCase(((5, 5), (17, 17)), 6, 2, 80, BF16, num_splits=2),
    # prefill over a cached prefix
    AttnCase(((5, 37), (17, 130)), 3, 1, 80, F32, share=True),
    AttnCase(((17, 37), (5, 16)), 4, 2, 128, BF16),
    AttnCase(((70, 130), (17, 17)), 6, 2, 64, F32, num_splits=3),
    # mixed decode + prefill + prefill over a cached prefix in one call
    AttnCase(MIXED, 8, 2, 128, F16, share=True),
    AttnCase(MIXED, 8, 2, 128, F16, num_splits=2, share=True),
    AttnCase(MIXED, 6, 2, 80, F32, num_splits=3),
    AttnCase(MIXED, 3, 1, 64, BF16, num_splits=2, share=True),
    AttnCase(MIXED, 2, 2, 64, F32, num_splits=None),
    # other block sizes (including blocks larger than a key tile)
    AttnCase(((1, 17), (5, 15)), 4, 2, 64, F32, block_size=1),
    AttnCase(((1, 37), (17, 17), (5, 20)), 8, 2, 80, F16, num_splits=2, block_size=4, share=True),
    AttnCase(((1, 130), (17, 37)), 2, 2, 64, F32, block_size=32, share=True),
    AttnCase(((1, 130), (5, 70)), 4, 1, 64, F16, num_splits=2, block_size=128),
    # wide GQA groups: G = 8, 16 (BLOCK_Q = 1) and 32 (BLOCK_M = 32)
    AttnCase(((1, 37), (5, 17)), 16, 2, 64, F16),
    AttnCase(((5, 17), (1, 16)), 16, 1, 64, F32, num_splits=2),
    AttnCase(((1, 37),), 32, 1, 64, F32),
]


@pytest.mark.parametrize("case", ATTENTION_CASES, ids=str)
def test_paged_attention_matches_reference(case: AttnCase) -> None:
    inputs = build_inputs(case)
    expected = paged_attention_ref(*inputs.args())
    actual = paged_attention(*inputs.args(), num_splits=case.num_splits)
    assert_attention_close(actual, expected)


@pytest.mark.parametrize(
    "case",
    [
        AttnCase(((1, 1000), (1, 700), (1, 5)), 8, 2, 128, BF16, num_splits=None),
        AttnCase(((129, 463), (1, 1328), (5, 18)), 5, 1, 128, F16, num_splits=1),
        AttnCase(((129, 463), (1, 1328), (5, 18)), 5, 1, 128, F16, num_splits=8),
        AttnCase(((64, 300),) * 3 + ((1, 300),) * 3, 8, 4, 80, F32, share=True),
    ],
    ids=str,
)
def test_paged_attention_longer_contexts(case: AttnCase) -> None:
    """vLLM-like shapes: G = 5, a 129-token chunk, contexts past 1000, auto split-K."""
    inputs = build_inputs(case, seed=1)
    expected = paged_attention_ref(*inputs.args())
    actual = paged_attention(*inputs.args(), num_splits=case.num_splits)
    assert_attention_close(actual, expected)


WINDOW_CASES = [
    # decodes before, at and past the window, with split-K; fresh and cached prefills past it
    (AttnCase(((1, 5), (1, 16), (1, 40), (1, 130)), 4, 2, 64, F32, num_splits=3), 16),
    (AttnCase(MIXED, 6, 2, 64, F32, block_size=4, share=True), 16),
    (AttnCase(MIXED, 4, 2, 64, BF16, num_splits=2), 24),
    (AttnCase(((70, 130), (17, 17)), 4, 4, 64, F16), 32),
]


@pytest.mark.parametrize("softcap", [None, 2.0], ids=["plain", "softcap"])
@pytest.mark.parametrize("case,window", WINDOW_CASES, ids=lambda x: str(x))
def test_paged_attention_windows_and_softcap(case: AttnCase, window: int, softcap) -> None:
    """Sliding windows (and Gemma 2's logit softcap) against the reference."""
    inputs = build_inputs(case, seed=2)
    extra = {"window": window, "softcap": softcap}
    expected = paged_attention_ref(*inputs.args(), **extra)
    actual = paged_attention(*inputs.args(), num_splits=case.num_splits, **extra)
    assert_attention_close(actual, expected)


@pytest.mark.parametrize("window", [None, 16])
def test_paged_attention_sinks(window: int | None) -> None:
    """gpt-oss's sink logits (one per query head), with and without a window; split-K is
    turned off."""
    case = AttnCase(MIXED, 8, 2, 64, F32, num_splits=None)
    inputs = build_inputs(case, seed=3)
    sinks = torch.randn(8, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    extra = {"window": window, "sinks": sinks}
    expected = paged_attention_ref(*inputs.args(), **extra)
    actual = paged_attention(*inputs.args(), num_splits=None, **extra)
    assert_attention_close(actual, expected)
    assert not torch.allclose(expected, paged_attention_ref(*inputs.args(), window=window))


def test_split_k_agrees_with_single_pass() -> None:
    """Split-K and the single pass differ only in summation order."""
    case = AttnCase(((1, 130), (1, 37), (1, 64)), 4, 2, 64, F32)
    inputs = build_inputs(case, seed=3)
    single = paged_attention(*inputs.args(), num_splits=1)
    for splits in (2, 5):
        torch.testing.assert_close(
            paged_attention(*inputs.args(), num_splits=splits), single, atol=2e-6, rtol=1e-5
        )


def test_store_then_attend() -> None:
    """A prefill step followed by a decode step, written through store_kv."""
    gen = torch.Generator().manual_seed(5)
    hq, hkv, d, bs, dtype = 4, 2, 64, 16, F16
    kv_cache = nan_kv_cache(1, 6, bs, hkv, d, dtype)
    k_cache, v_cache = kv_cache[0, 0], kv_cache[0, 1]
    block_tables = torch.tensor([[4, 1, 2], [0, 3, 5]], dtype=torch.int32, device=DEVICE)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype).to(DEVICE)

    def slots(seq: int, positions: range) -> list[int]:
        return [int(block_tables[seq, p // bs]) * bs + p % bs for p in positions]

    # Step 1: prefill 20 and 7 tokens. Step 2: decode one token each.
    for q_lens, starts in (((20, 7), (0, 0)), ((1, 1), (20, 7))):
        total = sum(q_lens)
        k, v, q = randn(total, hkv, d), randn(total, hkv, d), randn(total, hq, d)
        slot_mapping = torch.tensor(
            slots(0, range(starts[0], starts[0] + q_lens[0]))
            + slots(1, range(starts[1], starts[1] + q_lens[1])),
            device=DEVICE,
        )
        store_kv(k, v, k_cache, v_cache, slot_mapping)
        cu = torch.tensor([0, q_lens[0], total], dtype=torch.int32, device=DEVICE)
        seq_lens = torch.tensor(
            [s + n for s, n in zip(starts, q_lens, strict=True)], dtype=torch.int32, device=DEVICE
        )
        args = (q, k_cache, v_cache, block_tables, cu, seq_lens, d**-0.5, max(q_lens), 21)
        assert_attention_close(paged_attention(*args), paged_attention_ref(*args))


def test_paged_attention_strided_inputs_and_out() -> None:
    """q as a slice of a fused projection, a preallocated strided out, and a cache stored
    head-major ([num_blocks, Hkv, block_size, D]) but passed as a [num_blocks, block_size, Hkv, D]
    view: the kernel must only use strides."""
    case = AttnCase(((1, 37), (17, 40), (5, 5)), 4, 2, 80, F32, num_splits=None)
    inputs = build_inputs(case, seed=7)
    expected = paged_attention_ref(*inputs.args())

    hm = torch.full(
        (inputs.k_cache.shape[0], 2, 2, 16, 80), float("nan"), dtype=F32, device=DEVICE
    )  # [num_blocks, K/V, Hkv, block_size, D]
    hm[:, 0] = inputs.k_cache.transpose(1, 2)
    hm[:, 1] = inputs.v_cache.transpose(1, 2)
    k_view, v_view = hm[:, 0].transpose(1, 2), hm[:, 1].transpose(1, 2)
    assert not k_view.is_contiguous()

    fused = torch.zeros(inputs.q.shape[0], 3 * 4, 80, device=DEVICE)  # [T, q|k|v heads, D]
    fused[:, :4] = inputs.q
    q_view = fused[:, :4]
    out_buf = torch.full((inputs.q.shape[0], 4, 2 * 80), float("nan"), device=DEVICE)
    out_view = out_buf[:, :, ::2]

    args = list(inputs.args())
    args[0], args[1], args[2] = q_view, k_view, v_view
    for splits in (1, 3):
        result = paged_attention(*args, out=out_view, num_splits=splits)
        assert result.data_ptr() == out_view.data_ptr()
        assert_attention_close(out_view, expected)
    assert out_buf[:, :, 1::2].isnan().all(), "wrote outside the out view"


def test_paged_attention_rejects_bad_arguments() -> None:
    inputs = build_inputs(AttnCase(((1, 5),), 4, 2, 64, F32))
    args = list(inputs.args())
    with pytest.raises(ValueError):
        paged_attention(inputs.q[:, :3], *args[1:])  # Hq not a multiple of Hkv
    with pytest.raises(ValueError):
        paged_attention(inputs.q.half(), *args[1:])  # q and cache dtypes differ
    with pytest.raises(ValueError):
        paged_attention(*args[:4], inputs.cu_seqlens_q[:1], *args[5:])  # cu_seqlens_q too short
    with pytest.raises(ValueError):
        paged_attention(*args, num_splits=0)
    with pytest.raises(ValueError):
        paged_attention(*args[:3], inputs.block_tables.long(), *args[4:])  # not int32
    empty = paged_attention(inputs.q[:0], *args[1:4], inputs.cu_seqlens_q * 0, *args[5:])
    assert empty.shape == (0, 4, 64)


def test_choose_num_splits() -> None:
    # Prefill or mixed steps never split; neither do steps that already fill the GPU.
    assert choose_num_splits(4, 8, max_seqlen_q=7, max_seqlen_k=8192, sm_count=132) == 1
    assert choose_num_splits(64, 8, max_seqlen_q=1, max_seqlen_k=8192, sm_count=132) == 1
    # Few long decodes split, bounded by the key count and by _MAX_SPLITS.
    assert choose_num_splits(2, 8, max_seqlen_q=1, max_seqlen_k=8192, sm_count=132) == 16
    assert choose_num_splits(2, 8, max_seqlen_q=1, max_seqlen_k=1024, sm_count=132) == 4
    # 5 wanted: rounded down to a power of two (one compiled variant per bucket).
    assert choose_num_splits(8, 8, max_seqlen_q=1, max_seqlen_k=100_000, sm_count=132) == 4
    assert choose_num_splits(1, 1, max_seqlen_q=1, max_seqlen_k=100, sm_count=132) == 1
    # GQA 28:4 (4 KV heads) at one or two long sequences fills all 132 SMs of an H200.
    for b in (1, 2):
        assert b * 4 * choose_num_splits(b, 4, 1, max_seqlen_k=32768, sm_count=132) >= 132
    got = {
        choose_num_splits(b, h, 1, k, sm)
        for b in range(1, 70)
        for h in (1, 4, 8)
        for k in (1, 300, 1000, 5000, 40_000)
        for sm in (78, 132)
    }
    assert got <= set(split_buckets()) and split_buckets() == [1, 2, 4, 8, 16, 32, 64]


# --------------------------------------------------------------------------------------------
# GPU-only and compile-only checks
# --------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_offsets_past_int32() -> None:
    """Element offsets above 2**31 (block ids times the block stride): int64 addressing (needs
    about 9 GiB of GPU memory)."""
    require("cuda")
    bs, hkv, d = 16, 1, 128
    num_blocks = (2**31) // (bs * hkv * d) + 64
    kv_cache = torch.zeros((1, 2, num_blocks, bs, hkv, d), dtype=BF16, device=DEVICE)
    k_cache, v_cache = kv_cache[0, 0], kv_cache[0, 1]
    seq_len, q_len = 40, 5
    blocks = [num_blocks - 1, 3, num_blocks - 7]
    block_tables = torch.tensor([blocks], dtype=torch.int32, device=DEVICE)
    k = torch.randn(seq_len, hkv, d, device=DEVICE, dtype=BF16)
    v = torch.randn(seq_len, hkv, d, device=DEVICE, dtype=BF16)
    slots = torch.tensor([blocks[p // bs] * bs + p % bs for p in range(seq_len)], device=DEVICE)
    store_kv(k, v, k_cache, v_cache, slots)
    torch.testing.assert_close(k_cache[blocks[2], : seq_len - 32], k[32:], rtol=0, atol=0)
    copy_blocks(
        kv_cache, torch.tensor([num_blocks - 1], device=DEVICE), torch.tensor([5], device=DEVICE)
    )
    torch.testing.assert_close(k_cache[5], k_cache[num_blocks - 1], rtol=0, atol=0)

    q = torch.randn(q_len, 4, d, device=DEVICE, dtype=BF16)
    cu = torch.tensor([0, q_len], dtype=torch.int32, device=DEVICE)
    seq_lens = torch.tensor([seq_len], dtype=torch.int32, device=DEVICE)
    args = (q, k_cache, v_cache, block_tables, cu, seq_lens, d**-0.5, q_len, seq_len)
    for splits in (1, 3):
        assert_attention_close(
            paged_attention(*args, num_splits=splits), paged_attention_ref(*args)
        )


@pytest.mark.slow  # about 45 s on two cores with an empty Triton cache
@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU run compiles the kernels anyway")
def test_kernels_compile_for_sm90() -> None:
    """The interpreter accepts code the compiler rejects (e.g. dots under 16 wide), so compile
    every launch configuration for sm_90 through ptxas, without a GPU, in a fresh process."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "bench_kernels.py"), "--compile-only"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "spills: none" in proc.stdout, proc.stdout[-3000:]
