"""The quantized KV cache (int8, fp8 e4m3): one fp32 scale per (token, KV head).

Every store path (Triton ``store_kv``, the torch backend's reference store) must write exactly the
bytes and scales of ``reference.quantize_kv_ref``; every attention path must equal
``paged_attention_ref`` over the dequantized cache. Unused slots hold NaN scales (and arbitrary
data), and block-table padding points at such a block, so a read the kernels should not make
turns the output NaN.

Without a GPU the Triton kernels run under the interpreter (tests/conftest.py). fp8 runs where
torch and the interpreter (or the GPU) support ``float8_e4m3fn``.
"""

from __future__ import annotations

import pytest
import torch

from batchgen.kernels import copy_blocks, paged_attention, store_kv
from batchgen.kernels.reference import (
    QMAX,
    copy_blocks_ref,
    dequantize_kv_ref,
    paged_attention_ref,
    quantize_kv_ref,
)
from batchgen.model import block_copy
from batchgen.model.attention import AttentionMetadata, TorchAttention

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
I8, FP8 = torch.int8, torch.float8_e4m3fn
# attention over the dequantized cache: the kernels dequantize exactly as the reference does, so
# what remains is the attention's own rounding (see tests/test_kernels.py)
TOLERANCE = {F32: (2e-5, 1e-5), F16: (5e-3, 5e-3), BF16: (2.5e-2, 2e-2)}
SENTINEL = {I8: 77, FP8: 3.0}  # data of unused slots (their scales are NaN)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def empty_quantized(
    num_blocks: int, block_size: int, hkv: int, d: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(data ``[2, NB, BS, Hkv, D]`` filled with a sentinel, scales ``[2, NB, BS, Hkv]`` NaN)."""
    data = torch.full((2, num_blocks, block_size, hkv, d), SENTINEL[dtype], device=DEVICE)
    scales = torch.full((2, num_blocks, block_size, hkv), float("nan"), device=DEVICE)
    return data.to(dtype), scales


def store_ref(
    x: torch.Tensor, data: torch.Tensor, scales: torch.Tensor, slots: torch.Tensor
) -> None:
    """What a quantizing store must do: ``quantize_kv_ref`` of each token into its slot."""
    q, s = quantize_kv_ref(x, data.dtype)
    bs = data.shape[1]
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            data[slot // bs, slot % bs] = q[t]
            scales[slot // bs, slot % bs] = s[t]


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN scales compare equal to themselves)."""
    if a.dtype == FP8:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    if a.dtype == F32:
        a, b = a.view(torch.int32), b.view(torch.int32)
    return torch.equal(a, b)


# --------------------------------------------------------------------------------------------
# the rule
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [I8, FP8])
def test_quantize_rule_error_bound_and_zero_rows(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, 96, generator=gen) * torch.logspace(-6, 3, 64)[:, None, None]
    x[3, 1] = 0.0  # an all-zero row: scale 0, q 0
    x[5, 2, :] = 0.0
    x[5, 2, 7] = -2.5  # a single nonzero element: it becomes -QMAX exactly
    q, s = quantize_kv_ref(x, dtype)
    assert q.dtype == dtype and s.dtype == F32 and s.shape == x.shape[:-1]
    err = (dequantize_kv_ref(q, s) - x).abs()
    amax = x.abs().amax(-1, keepdim=True)
    if dtype == I8:
        assert (err <= amax / 254 * (1 + 1e-6)).all()  # half a step of absmax/127
    else:  # e4m3: 3 mantissa bits, relative error <= 2^-4 above the subnormals
        assert (err <= x.abs() / 16 + amax / 448 * 2**-9 + 1e-30).all()
    assert s[3, 1] == 0 and (q[3, 1].float() == 0).all()
    assert q[5, 2, 7].float() == -QMAX[dtype] and s[5, 2] == 2.5 / QMAX[dtype]
    # round half to even: 0.5 * scale -> 0, 1.5 * scale -> 2, 2.5 * scale -> 2
    if dtype == I8:
        row = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5])
        assert quantize_kv_ref(row, I8)[0].tolist() == [127, 0, 2, 2, 0, -2]


# --------------------------------------------------------------------------------------------
# Triton store_kv and copy_blocks
# --------------------------------------------------------------------------------------------


def fp8_supported() -> bool:
    """fp8 stores and loads run here: a GPU with fp8, or the interpreter on a CPU."""
    if DEVICE.type == "cuda":
        return torch.cuda.get_device_capability() >= (8, 9)
    return True


def cache_dtypes() -> list:
    return [I8, pytest.param(FP8, marks=pytest.mark.skipif(not fp8_supported(), reason="no fp8"))]


@pytest.mark.parametrize("cache_dtype", cache_dtypes())
@pytest.mark.parametrize(
    "dtype, head_dim, block_size, num_kv_heads, num_tokens",
    [(F32, 64, 16, 2, 23), (BF16, 80, 4, 3, 9), (F16, 128, 1, 1, 6), (BF16, 64, 32, 4, 40)],
)
def test_store_kv_quantized_is_bit_exact(
    cache_dtype: torch.dtype,
    dtype: torch.dtype,
    head_dim: int,
    block_size: int,
    num_kv_heads: int,
    num_tokens: int,
) -> None:
    gen = torch.Generator().manual_seed(num_tokens)
    num_blocks = cdiv(num_tokens, block_size) + 3
    # k, v as strided views of a fused projection output, with rows of very different ranges,
    # an all-zero row and values on the rounding midpoints
    qkv = torch.randn(num_tokens, 3, num_kv_heads, head_dim, generator=gen)
    qkv *= torch.logspace(-3, 2, num_tokens)[:, None, None, None]
    qkv[1, 1, 0] = 0.0
    qkv[2, 2, 0, :4] = torch.tensor([127.0, 0.5, 1.5, -2.5])
    qkv[2, 2, 0, 4:] = 0.25
    qkv = qkv.to(dtype).to(DEVICE)
    k, v = qkv[:, 1], qkv[:, 2]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[torch.randperm(num_tokens, generator=gen)[: max(1, num_tokens // 5)]] = -1  # padding
    slots = slots.to(DEVICE)

    data, scales = empty_quantized(num_blocks, block_size, num_kv_heads, head_dim, cache_dtype)
    want_data, want_scales = data.clone(), scales.clone()
    store_ref(k, want_data[0], want_scales[0], slots)
    store_ref(v, want_data[1], want_scales[1], slots)
    store_kv(k, v, data[0], data[1], slots, scales[0], scales[1])
    assert same_bytes(data, want_data), "quantized bytes differ from quantize_kv_ref"
    assert same_bytes(scales, want_scales), "scales differ from quantize_kv_ref"


def test_store_kv_refuses_missing_or_stray_scales() -> None:
    data, scales = empty_quantized(2, 4, 1, 16, I8)
    k = torch.randn(1, 1, 16, device=DEVICE)
    slots = torch.tensor([0], device=DEVICE)
    with pytest.raises(ValueError, match="needs k_scale"):
        store_kv(k, k, data[0], data[1], slots)
    with pytest.raises(ValueError, match="needs v_scale"):
        store_kv(k, k, data[0], data[1], slots, scales[0], scales[1, :, :2])
    floats = torch.zeros(2, 2, 4, 1, 16, device=DEVICE)
    with pytest.raises(ValueError, match="scales given"):
        store_kv(k, k, floats[0], floats[1], slots, scales[0], scales[1])


def test_copy_blocks_carries_scales() -> None:
    """Copy on write copies a block's scales with its data (Triton and torch block copies)."""
    gen = torch.Generator().manual_seed(5)
    shape = (2, 2, 9, 4, 3)  # [L, 2, NB, BS, Hkv]
    data = torch.randint(-127, 128, (*shape, 16), generator=gen, dtype=I8).to(DEVICE)
    scales = torch.rand(shape, generator=gen).to(DEVICE)
    scales[:, :, 5, 2:] = float("nan")  # a partial block: its unused tail is copied as it is
    src, dst = torch.tensor([5, 1], device=DEVICE), torch.tensor([7, 2], device=DEVICE)
    want_data, want_scales = data.clone(), scales.clone()
    copy_blocks_ref(want_data, src, dst)
    copy_blocks_ref(want_scales.unsqueeze(-1), src, dst)
    for copy in (copy_blocks, block_copy.copy_blocks):
        got_data, got_scales = data.clone(), scales.clone()
        copy(got_data, src, dst)
        copy(got_scales, src, dst)
        assert same_bytes(got_data, want_data) and same_bytes(got_scales, want_scales)


# --------------------------------------------------------------------------------------------
# attention over a quantized cache: Triton and the torch backend
# --------------------------------------------------------------------------------------------


def build_quantized_step(
    seqs: tuple[tuple[int, int], ...],
    hq: int,
    hkv: int,
    d: int,
    dtype: torch.dtype,
    cache_dtype: torch.dtype,
    block_size: int,
    seed: int = 0,
    share: bool = False,
):
    """A step over a quantized one-layer cache: the cached prefixes stored (quantize_kv_ref),
    the step's new K/V returned for the backend to store. ``seqs``: (q_len, seq_len) each;
    ``share``: later sequences start with sequence 0's first block (a radix-cache hit; their
    cached context covers it). Unused slots: sentinel data, NaN scales; block-table padding
    points at an unused block."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [cdiv(k, block_size) for _, k in seqs]
    num_blocks = sum(blocks_per_seq) + 2
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    spare = perm.pop()
    max_blocks = max(blocks_per_seq) + 1
    tables: list[list[int]] = []
    for b, n in enumerate(blocks_per_seq):
        shared = 1 if share and b and seqs[b][1] - seqs[b][0] >= block_size else 0
        row = (tables[0][:shared] if shared else []) + [perm.pop() for _ in range(n - shared)]
        tables.append(row + [spare] * (max_blocks - n))
    data, scales = empty_quantized(num_blocks, block_size, hkv, d, cache_dtype)
    # every key position's value is a function of its physical slot: shared blocks agree
    k_all = torch.randn(num_blocks * block_size, hkv, d, generator=gen).to(dtype).to(DEVICE)
    v_all = torch.randn(num_blocks * block_size, hkv, d, generator=gen).to(dtype).to(DEVICE)
    new_slots, cu = [], [0]
    for b, (q_len, seq_len) in enumerate(seqs):
        slots = [tables[b][p // block_size] * block_size + p % block_size for p in range(seq_len)]
        cached = torch.tensor(slots[: seq_len - q_len], dtype=torch.int64, device=DEVICE)
        store_ref(k_all[cached], data[0], scales[0], cached)
        store_ref(v_all[cached], data[1], scales[1], cached)
        new_slots += slots[seq_len - q_len :]
        cu.append(cu[-1] + q_len)
    slot_mapping = torch.tensor(new_slots, dtype=torch.int64, device=DEVICE)
    q = torch.randn(cu[-1], hq, d, generator=gen).to(dtype).to(DEVICE)
    meta = AttentionMetadata(
        slot_mapping=slot_mapping,
        block_tables=torch.tensor(tables, dtype=torch.int32, device=DEVICE),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor([k for _, k in seqs], dtype=torch.int32, device=DEVICE),
        max_seqlen_q=max(q for q, _ in seqs),
        max_seqlen_k=max(k for _, k in seqs),
    )
    return q, k_all[slot_mapping], v_all[slot_mapping], data, scales, meta


def reference_over_dequantized(q, data, scales, meta, scale) -> torch.Tensor:
    """``paged_attention_ref`` over the cache dequantized to q's dtype (NaN where unused)."""
    k_deq = dequantize_kv_ref(data[0], scales[0], q.dtype)
    v_deq = dequantize_kv_ref(data[1], scales[1], q.dtype)
    return paged_attention_ref(
        q, k_deq, v_deq, meta.block_tables, meta.cu_seqlens_q, meta.seq_lens, scale,
        meta.max_seqlen_q, meta.max_seqlen_k,
    )  # fmt: skip


# (seqs, Hq, Hkv, D, dtype, cache dtype, block size, num_splits, share): partial last blocks,
# block-multiple lengths (16, 32), decode, fresh prefill, prefill over a cached prefix, GQA
QUANT_CASES = [
    (((1, 1), (1, 15), (1, 16), (1, 17)), 4, 2, 64, F32, I8, 16, 1, False),
    (((5, 5), (17, 17), (16, 16)), 4, 1, 64, F32, I8, 16, 1, False),
    (((5, 37), (17, 32), (1, 33)), 6, 2, 80, BF16, I8, 16, 2, True),
    (((1, 37), (5, 20), (12, 12)), 8, 2, 64, F16, I8, 4, None, True),
    (((1, 37), (5, 21)), 4, 2, 64, F32, FP8, 16, 1, True),
    (((3, 3), (1, 17)), 4, 4, 64, BF16, FP8, 8, 2, False),
]


def case_id(case: tuple) -> str:
    seqs, hq, hkv, d, dtype, cache_dtype, bs, splits, share = case
    names = {F32: "f32", BF16: "bf16", F16: "f16", I8: "int8", FP8: "fp8"}
    text = "+".join(f"{a}/{b}" for a, b in seqs)
    return f"{text}-h{hq}kv{hkv}-d{d}-{names[dtype]}-{names[cache_dtype]}-bs{bs}-s{splits}" + (
        "-shared" if share else ""
    )


def quant_params() -> list:
    return [
        pytest.param(
            c,
            id=case_id(c),
            marks=pytest.mark.skipif(c[5] == FP8 and not fp8_supported(), reason="no fp8"),
        )
        for c in QUANT_CASES
    ]


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    assert torch.isfinite(actual).all(), "NaN in the output: an unused slot or scale was read"
    atol, rtol = TOLERANCE[actual.dtype]
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)


@pytest.mark.parametrize("case", quant_params())
def test_triton_attention_over_quantized_cache(case: tuple) -> None:
    seqs, hq, hkv, d, dtype, cache_dtype, bs, splits, share = case
    q, k, v, data, scales, meta = build_quantized_step(
        seqs, hq, hkv, d, dtype, cache_dtype, bs, share=share
    )
    store_kv(k, v, data[0], data[1], meta.slot_mapping, scales[0], scales[1])  # write first
    scale = d**-0.5
    expected = reference_over_dequantized(q, data, scales, meta, scale)
    actual = paged_attention(
        q, data[0], data[1], meta.block_tables, meta.cu_seqlens_q, meta.seq_lens, scale,
        meta.max_seqlen_q, meta.max_seqlen_k, num_splits=splits, k_scale=scales[0],
        v_scale=scales[1],
    )  # fmt: skip
    assert_close(actual, expected)


@pytest.mark.parametrize("native", [False, True], ids=["torch", "c-kernels"])
@pytest.mark.parametrize("case", quant_params())
def test_torch_backend_over_quantized_cache(case: tuple, native: bool) -> None:
    """The torch backend, in PyTorch (``native=False``) and with the C kernels where they serve
    the cache (int8 with fp32 or bf16 compute): stores quantize_kv_ref's bytes, and attends over
    the dequantized cache, the step's own keys included (FRESH groups too)."""
    from batchgen.model import cpu_kernels

    seqs, hq, hkv, d, dtype, cache_dtype, bs, _, share = case
    kernels = cpu_kernels.for_dtype(DEVICE, dtype) if native else None
    if native and (kernels is None or not kernels.supports_kv_dtype(cache_dtype, dtype)):
        pytest.skip("the C kernels do not serve this cache here")
    q, k, v, data, scales, meta = build_quantized_step(
        seqs, hq, hkv, d, dtype, cache_dtype, bs, share=share
    )
    want_data, want_scales = data.clone(), scales.clone()
    store_ref(k, want_data[0], want_scales[0], meta.slot_mapping)
    store_ref(v, want_data[1], want_scales[1], meta.slot_mapping)
    backend = TorchAttention(native=native)
    plan = backend.prepare(meta, data[None], hq, dtype)
    assert (plan.kernels is not None) == native
    scale = d**-0.5
    out = backend.forward(q, k, v, data[0], data[1], plan, scale, scales[0], scales[1])
    assert same_bytes(data, want_data) and same_bytes(scales, want_scales)
    assert_close(out, reference_over_dequantized(q, data, scales, meta, scale))


def test_paged_attention_refuses_quantized_cache_without_scales() -> None:
    q, k, v, data, scales, meta = build_quantized_step(((1, 3),), 2, 1, 16, F32, I8, 4)
    args = (q, data[0], data[1], meta.block_tables, meta.cu_seqlens_q, meta.seq_lens, 0.25, 1, 3)
    with pytest.raises(ValueError, match="needs k_scale"):
        paged_attention(*args)


# --------------------------------------------------------------------------------------------
# the job: refusals, validate, the report
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "engine, needle",
    [
        ({"device": "cpu", "kv_cache_dtype": "fp8_e4m3"}, "fp8_e4m3 needs a CUDA GPU"),
        ({"dtype": "float32", "kv_cache_dtype": "float16"}, "differs from the compute dtype"),
        ({"kv_cache_dtype": "int4"}, "kv_cache_dtype"),
    ],
)
def test_impossible_kv_cache_dtypes_are_refused(tiny_model, tmp_path, engine, needle) -> None:
    from tests.jobkit import invoke, refusal, write_job

    if torch.cuda.is_available() and "device" not in engine:
        engine = {"device": "cpu", **engine}
    job = write_job(tmp_path, tiny_model("llama"), ["a b c"], engine=engine)
    for command in ("validate", "run"):
        line = refusal(invoke(command, job))
        assert needle in line, line


def test_validate_and_report_give_the_kv_cache_dtype(tiny_model, tmp_path) -> None:
    """validate names the KV dtype and how many tokens the cache holds (about 4x the float32
    cache's at the same kv_cache_memory); .batchgen/report.json has kv_cache_dtype and bytes per token."""
    import json

    from batchgen.results import REPORT_NAME
    from tests.jobkit import run_cli, write_job

    model = tiny_model("llama", num_heads=4, num_kv_heads=2, head_dim=24)  # 2 layers
    memory = {"kv_cache_memory": 1 << 20, "device": "cpu"}
    held = {}
    for kv, per_token in (("auto", 2 * 2 * 2 * 24 * 4), ("int8", 2 * 2 * 2 * (24 + 4))):
        job = write_job(
            tmp_path / kv, model, ["a b c", "d e"], engine={**memory, "kv_cache_dtype": kv}
        )
        text = run_cli("validate", str(job)).output
        line = next(ln for ln in text.splitlines() if ln.startswith("KV cache:"))
        name = "float32" if kv == "auto" else "int8"
        assert line.startswith(f"KV cache: {name}") and f"{per_token} bytes/token" in line, line
        held[kv] = int(line.split("holds ")[1].split()[0])
        assert held[kv] == (1 << 20) // (per_token * 16) * 16
        run_cli("run", str(job), "--quiet")
        report = json.loads((tmp_path / kv / "out" / REPORT_NAME).read_text())
        assert report["kv_cache_dtype"] == name and report["kv_bytes_per_token"] == per_token
    assert held["int8"] >= 3.4 * held["auto"]  # head_dim 24: (24 * 4) / (24 + 4) = 3.43
