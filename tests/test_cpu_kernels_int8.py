"""The C kernels over an int8 KV cache (one fp32 scale per (token, KV head)).

The store must give exactly ``kernels.reference.quantize_kv_ref``'s bytes and scales (fp32 and
bf16 inputs); attention over the int8 cache (fp32 or bf16 q, per token and tiled, with k_start,
lse, prefix merges) must equal attention over the dequantized cache within fp32 rounding. Caches
are filled through the kernel's store; every slot no sequence uses holds random bytes and a NaN
scale, so a stray read shows up as NaN. bf16 q runs in this CPU's build and in the portable one.
"""

from __future__ import annotations

import pytest
import torch

from batchgen.kernels.reference import dequantize_kv_ref, paged_attention_ref, quantize_kv_ref
from batchgen.model.cpu_kernels import CpuKernels
from tests.test_cpu_kernels import (
    EXTEND_SHAPES,
    SHAPES,
    Flavor,
    avx2_kernels,
    kernels_of,
    make_case,
    reference,
)

I8 = torch.int8


@pytest.fixture(params=["fp32", "bf16", "bf16-portable", "fp32-avx2"])
def flavor(request: pytest.FixtureRequest) -> Flavor:
    """The kernels and the dtype of q (and of the K/V stored): fp32, bf16 (this CPU's build),
    bf16 (the portable build), fp32 (the build under the AVX2 cap, where the CPU has AVX-512)."""
    if request.param == "fp32-avx2":
        return Flavor(avx2_kernels(), torch.float32)
    build = "portable" if request.param == "bf16-portable" else "native"
    return Flavor(kernels_of(build), torch.float32 if request.param == "fp32" else torch.bfloat16)


def int8_case(kernel: CpuKernels, c: dict, dtype: torch.dtype, seed: int) -> dict:
    """``make_case``'s fp32 case with its caches replaced by int8 caches and scales: the used
    slots (the non-NaN rows) stored through the kernel from K/V in ``dtype``, the others random
    bytes with NaN scales; q converted to ``dtype``."""
    gen = torch.Generator().manual_seed(seed)
    kc, vc = c["k_cache"], c["v_cache"]
    nb, bs, hkv, d = kc.shape
    flat_k, flat_v = kc.view(-1, hkv, d), vc.view(-1, hkv, d)
    slots = (~flat_k.isnan().any(-1).any(-1)).nonzero()[:, 0]
    k_cache = torch.randint(-128, 128, kc.shape, dtype=I8, generator=gen)
    v_cache = torch.randint(-128, 128, kc.shape, dtype=I8, generator=gen)
    k_scale = torch.full((nb, bs, hkv), float("nan"))
    v_scale = torch.full_like(k_scale, float("nan"))
    kernel.store_kv(
        flat_k[slots].to(dtype), flat_v[slots].to(dtype), k_cache, v_cache, slots, k_scale, v_scale
    )
    return {
        **c,
        "q": c["q"].to(dtype),
        "k_cache": k_cache,
        "v_cache": v_cache,
        "k_scale": k_scale,
        "v_scale": v_scale,
    }


def dequantized(c: dict) -> dict:
    """The case with fp32 caches dequantized from the int8 ones (NaN where the scale is NaN) and
    q in fp32: what the reference attends over."""
    rest = {k: v for k, v in c.items() if k not in ("k_scale", "v_scale")}
    return {
        **rest,
        "q": c["q"].float(),
        "k_cache": dequantize_kv_ref(c["k_cache"], c["k_scale"]),
        "v_cache": dequantize_kv_ref(c["v_cache"], c["v_scale"]),
    }


@pytest.mark.parametrize("build", ["native", "portable"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_store_is_bit_identical_to_quantize_kv_ref(dtype: torch.dtype, build: str) -> None:
    """Bytes and scales equal the reference rule's, for random rows, an all-zero row, exact
    halves (round half to even), a row whose scale is subnormal and one whose scale underflows
    to 0; negative slots and unused slots are left alone."""
    kernel = kernels_of(build)
    gen = torch.Generator().manual_seed(3)
    nb, bs, hkv, d = 6, 4, 3, 40
    kv = (torch.randn(9, 3, hkv, d, generator=gen) * 3).to(dtype)  # k, v: slices of one tensor
    kv[1, 0, 1] = 0.0  # all-zero rows
    kv[7, 2, 0] = 0.0
    halves = torch.tensor([127.0, 63.5, -0.5, 0.5, 1.5, 2.5, -2.5, 126.5, -126.5, 3.5])
    kv[3, 0, 2, : halves.numel()] = halves.to(dtype)  # amax 127: scale 1, y = x exactly
    kv[3, 0, 2, halves.numel() :] = 0.0
    kv[4, 2, 1] = (torch.randn(d, generator=gen) * 1e-37).to(dtype)  # subnormal scale
    kv[5, 0, 0] = (torch.randn(d, generator=gen) * 1e-44).to(dtype)  # scale underflows to 0
    k, v = kv[:, 0], kv[:, 2]
    slots = torch.tensor([3, 0, -1, 23, 9, 17, -5, 12, 5])
    k_cache = torch.randint(-128, 128, (nb, bs, hkv, d), dtype=I8, generator=gen)
    v_cache = torch.randint(-128, 128, (nb, bs, hkv, d), dtype=I8, generator=gen)
    k_scale = torch.full((nb, bs, hkv), float("nan"))
    v_scale = torch.full_like(k_scale, float("nan"))
    before = [x.clone() for x in (k_cache, v_cache)]
    kernel.store_kv(k, v, k_cache, v_cache, slots, k_scale, v_scale)
    kept = slots >= 0
    for x, cache, scales, old in (
        (k, k_cache, k_scale, before[0]),
        (v, v_cache, v_scale, before[1]),
    ):
        want_q, want_s = quantize_kv_ref(x[kept], I8)
        got_q, got_s = cache.view(-1, hkv, d)[slots[kept]], scales.view(-1, hkv)[slots[kept]]
        assert torch.equal(got_q, want_q)
        assert torch.equal(got_s.view(torch.int32), want_s.view(torch.int32))  # bit for bit
        unused = torch.ones(nb * bs, dtype=torch.bool)
        unused[slots[kept]] = False
        assert torch.equal(cache.view(-1, hkv, d)[unused], old.view(-1, hkv, d)[unused])
        assert scales.view(-1, hkv)[unused].isnan().all()
    assert (k_cache.view(-1, hkv, d)[0, 1] == 0).all() and k_scale.view(-1, hkv)[0, 1] == 0
    assert (v_cache.view(-1, hkv, d)[12, 0] == 0).all() and v_scale.view(-1, hkv)[12, 0] == 0
    q_halves = k_cache.view(-1, hkv, d)[23, 2, : halves.numel()]
    assert q_halves.tolist() == [127, 64, 0, 0, 2, 2, -2, 126, -126, 4]
    assert k_scale.view(-1, hkv)[23, 2] == 1.0
    assert 0 < float(v_scale.view(-1, hkv)[9, 1]) < torch.finfo(torch.float32).tiny
    assert k_scale.view(-1, hkv)[17, 0] == 0 and (k_cache.view(-1, hkv, d)[17, 0] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_store_then_dequantize_error_within_amax_over_254(dtype: torch.dtype) -> None:
    """|dequantize(store(x)) - x| <= amax / 254 per element (rows over ten decades, outliers)."""
    kernel = kernels_of("native")
    gen = torch.Generator().manual_seed(4)
    hkv, d = 2, 64
    scales = torch.logspace(-6, 4, 200)[:, None, None]
    x = (torch.randn(200, hkv, d, generator=gen) * scales).to(dtype)
    x[::7, :, 5] *= 40.0  # outliers: one large element per row
    k_cache = torch.empty(50, 4, hkv, d, dtype=I8)
    v_cache = torch.empty_like(k_cache)
    k_scale = torch.empty(50, 4, hkv)
    v_scale = torch.empty_like(k_scale)
    kernel.store_kv(x, x, k_cache, v_cache, torch.arange(200), k_scale, v_scale)
    back = dequantize_kv_ref(k_cache.view(-1, hkv, d), k_scale.view(-1, hkv))
    xf = x.float()
    err = (back - xf).abs()
    amax = xf.abs().amax(-1, keepdim=True)
    # half a step, amax / 254, plus the fp32 roundings of the scale and of q * scale (at most a
    # few ulps of amax: the bound is reached on exact halves)
    assert (err <= amax / 254 + amax * 2**-22).all()
    assert float((err / amax).max()) > 1 / 300  # the bound is nearly reached: not vacuous


def run_attention(flavor: Flavor, c: dict, **kw: object) -> None:
    flavor.kernel.paged_attention(**c, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("tiled", [False, True], ids=["per-token", "tiled"])
@pytest.mark.parametrize("hq,hkv,d,bs", SHAPES)
def test_decode_matches_reference_over_dequantized_cache(
    flavor: Flavor, hq: int, hkv: int, d: int, bs: int, tiled: bool
) -> None:
    """Decodes over int8 caches (GQA ratios 1, 3, 4, 7, 8; key counts around the block size,
    partial last blocks and exact multiples) equal paged_attention_ref over the dequantized
    cache within fp32 rounding (bf16 q: out rounded once to bf16)."""
    k_lens = [1, 15, 16, 17, 31, 32, 33, 64, 100, 7 * bs, 7 * bs + 1]
    base = make_case(hq, hkv, d, bs, [1] * len(k_lens), k_lens, hq * 1000 + d + bs)
    c = int8_case(flavor.kernel, base, flavor.dtype, seed=hq + d)
    out = torch.full(c["q"].shape, float("nan"), dtype=flavor.dtype)
    seqs = torch.arange(len(k_lens), dtype=torch.int32)
    run_attention(flavor, c, seqs=seqs, out=out, scale=0.2, tiled=tiled)
    ref = paged_attention_ref(
        **{k: v for k, v in dequantized(c).items()}, scale=0.2, max_seqlen_q=1, max_seqlen_k=0
    )
    flavor.check(out, ref, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("fp32_out", [False, True], ids=["", "fp32-out"])
@pytest.mark.parametrize("tiled", [False, True], ids=["per-token", "tiled"])
@pytest.mark.parametrize("hq,hkv,d,bs", EXTEND_SHAPES)
def test_extend_subset_and_key_start(
    flavor: Flavor, hq: int, hkv: int, d: int, bs: int, tiled: bool, fp32_out: bool
) -> None:
    """Several new tokens per sequence, a subset of the sequences, keys from an offset, the lse;
    bf16 q also with an fp32 out."""
    if fp32_out and flavor.dtype == torch.float32:
        pytest.skip("fp32 out is the fp32 case")
    q_lens = [3, 1, 8, 2, 5]
    k_lens = [40, 17, 8 + 3 * bs, 2 * bs, 70]
    k_start = [16, 0, 2 * bs, bs, 35]
    c = int8_case(
        flavor.kernel, make_case(hq, hkv, d, bs, q_lens, k_lens, 7 + hq + d), flavor.dtype, 1
    )
    t = c["q"].shape[0]
    out = torch.full((t, hq, d), -7.0, dtype=torch.float32 if fp32_out else flavor.dtype)
    lse = torch.full((t, hq), -7.0)
    seqs = torch.tensor([0, 2, 3, 4], dtype=torch.int32)  # sequence 1 is not ours
    ks = torch.tensor(k_start, dtype=torch.int32)
    run_attention(flavor, c, seqs=seqs, out=out, scale=0.3, k_start=ks, lse=lse, tiled=tiled)
    ref, ref_lse = reference(dequantized(c), 0.3, k_start)
    cu = c["cu_seqlens_q"].tolist()
    mine = torch.cat([torch.arange(cu[b], cu[b + 1]) for b in seqs.tolist()])
    if fp32_out:
        torch.testing.assert_close(out[mine], ref[mine], atol=1e-4, rtol=1e-4)
    else:
        flavor.check(out[mine], ref[mine], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(lse[mine], ref_lse[mine], atol=1e-4, rtol=1e-5)
    untouched = torch.arange(cu[1], cu[2])
    assert (out[untouched] == -7.0).all() and (lse[untouched] == -7.0).all()


@pytest.mark.parametrize("hq,hkv,d,bs", SHAPES)
def test_tiled_prefills_and_long_extends(
    flavor: Flavor, hq: int, hkv: int, d: int, bs: int
) -> None:
    q_lens = [1, 2, 15, 16, 17, 33, 4 * bs, 130, 40, 23]
    k_lens = [1, 2, 15, 16, 17, 33, 4 * bs, 130, 40 + 3 * bs, 23 + 77]
    k_start = [0] * 8 + [bs, 60]
    base = make_case(hq, hkv, d, bs, q_lens, k_lens, 11 + hq + d + bs)
    c = int8_case(flavor.kernel, base, flavor.dtype, seed=2)
    t = c["q"].shape[0]
    out = torch.full((t, hq, d), float("nan"), dtype=flavor.dtype)
    lse = torch.full((t, hq), float("nan"))
    seqs = torch.arange(len(q_lens), dtype=torch.int32)
    ks = torch.tensor(k_start, dtype=torch.int32)
    run_attention(flavor, c, seqs=seqs, out=out, scale=0.25, k_start=ks, lse=lse, tiled=True)
    ref, ref_lse = reference(dequantized(c), 0.25, k_start)
    flavor.check(out, ref, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("hq,hkv,d,bs", SHAPES)
@pytest.mark.parametrize("prefix_len", [1, 16, 37])
def test_prefix_attention_merge_over_int8_cache(
    flavor: Flavor, hq: int, hkv: int, d: int, bs: int, prefix_len: int
) -> None:
    """Rows that attended to their own keys and then, through the kernel, to shared prefixes of
    an int8 cache end with attention (and lse) over all their dequantized keys; other rows
    untouched (two prefixes in one call, then a second depth)."""
    gen = torch.Generator().manual_seed(hq + d + prefix_len)
    t, inner, own = 11, 7, 9
    n = prefix_len + inner + own
    c = int8_case(flavor.kernel, make_case(hq, hkv, d, bs, [1], [n], prefix_len), flavor.dtype, 5)
    deq = dequantized(c)
    bt = c["block_tables"][0].tolist()
    slots_all = [bt[i // bs] * bs + i % bs for i in range(n)]
    k = deq["k_cache"].reshape(-1, hkv, d)[slots_all].double()  # [L, Hkv, D]
    v = deq["v_cache"].reshape(-1, hkv, d)[slots_all].double()
    q = (torch.randn(t, hq + 2 * hkv, d, generator=gen) * 2).to(flavor.dtype)[:, :hq]
    grp, scale = hq // hkv, 0.3

    def attend(keys: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        qh = q.double().contiguous().view(t, hkv, grp, d)
        s = torch.einsum("thgd,khd->thgk", qh, k[keys]) * scale
        lse = torch.logsumexp(s, -1)
        o = torch.einsum("thgk,khd->thgd", s.softmax(-1), v[keys])
        return o.reshape(t, hq, d).float().contiguous(), lse.reshape(t, hq).float().contiguous()

    outer = list(range(prefix_len))
    mid = list(range(prefix_len, prefix_len + inner))
    mine = list(range(prefix_len + inner, n))
    out, lse = attend(mine)
    before, lse_before = out.clone(), lse.clone()

    def call(parts: list[tuple[list[int], list[int]]]) -> None:
        slots = torch.tensor([slots_all[i] for keys, _ in parts for i in keys])
        rows = torch.tensor([r for _, rs in parts for r in rs])
        slot_off = torch.tensor([0] + [len(keys) for keys, _ in parts]).cumsum(0)
        row_off = torch.tensor([0] + [len(rs) for _, rs in parts]).cumsum(0)
        flavor.kernel.prefix_attention_merge_(
            q, c["k_cache"], c["v_cache"], slots, slot_off, rows, row_off, out, lse, scale,
            k_scale=c["k_scale"], v_scale=c["v_scale"],
        )  # fmt: skip

    call([(mid, [7, 0, 3]), (outer, [1, 5])])
    call([(outer, [7, 0, 3, 10, 4])])
    for rows, keys in (([7, 0, 3], outer + mid + mine), ([1, 5, 10, 4], outer + mine)):
        want, want_lse = attend(keys)
        torch.testing.assert_close(out[rows], want[rows], atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(lse[rows], want_lse[rows], atol=2e-5, rtol=1e-5)
    others = [2, 6, 8, 9]
    assert torch.equal(out[others], before[others])
    assert torch.equal(lse[others], lse_before[others])


def test_int8_is_close_to_the_float_cache(flavor: Flavor) -> None:
    """Attention over the int8 cache stays near attention over the float values it was stored
    from (the quantization error, not a mislaid scale: mean error well under the values')."""
    base = make_case(14, 2, 64, 16, [1, 1], [300, 77], seed=9)
    c = int8_case(flavor.kernel, base, flavor.dtype, seed=9)
    out = torch.empty(c["q"].shape, dtype=flavor.dtype)
    seqs = torch.arange(2, dtype=torch.int32)
    run_attention(flavor, c, seqs=seqs, out=out, scale=0.125)
    exact = paged_attention_ref(
        **{**base, "q": c["q"].float()}, scale=0.125, max_seqlen_q=1, max_seqlen_k=0
    )
    err = (out.float() - exact).abs()
    assert float(err.mean()) < 0.02 * float(exact.abs().mean())


def test_rejects_bad_int8_inputs(flavor: Flavor) -> None:
    kern = flavor.kernel
    c = int8_case(kern, make_case(4, 2, 64, 16, [1], [5], seed=1), flavor.dtype, 0)
    out = torch.empty(c["q"].shape, dtype=flavor.dtype)
    seqs = torch.zeros(1, dtype=torch.int32)
    ks, vs = c["k_scale"], c["v_scale"]
    bad = [
        {"k_scale": None},  # int8 without scales
        {"v_scale": None},
        {"k_scale": ks.double()},
        {"v_scale": ks[:, :, :1].contiguous()},  # wrong shape
        {"k_scale": ks.transpose(0, 1).contiguous().transpose(0, 1)},  # not contiguous
        {"q": c["q"].to(torch.int8)},  # q stays float
        {"v_cache": c["v_cache"].float()},  # both caches int8
        {"k_cache": c["k_cache"].float(), "v_cache": c["v_cache"].float()},  # scales, float cache
    ]
    for change in bad:
        with pytest.raises(ValueError, match="unsupported"):
            kern.paged_attention(**{**c, **change}, seqs=seqs, out=out, scale=1.0)
    with pytest.raises(ValueError, match="unsupported"):  # out: q's dtype or fp32
        kern.paged_attention(**c, seqs=seqs, out=out.half(), scale=1.0)
    kv = torch.randn(2, 2, 64).to(flavor.dtype)
    slots = torch.tensor([0, 1])
    for change in bad[:4]:
        args = {"k_scale": ks, "v_scale": vs, **change}
        with pytest.raises(ValueError, match="unsupported"):
            kern.store_kv(kv, kv, c["k_cache"], c["v_cache"], slots, **args)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unsupported"):  # k, v of one dtype
        kern.store_kv(kv, kv.half(), c["k_cache"], c["v_cache"], slots, ks, vs)
    one = torch.tensor([0, 1])
    with pytest.raises(ValueError, match="unsupported"):
        kern.prefix_attention_merge_(
            c["q"], c["k_cache"], c["v_cache"], slots, one, torch.tensor([0]), one,
            torch.empty(1, 4, 64), torch.empty(1, 4), 1.0,
        )  # fmt: skip


def test_supports_kv_dtype() -> None:
    kern = kernels_of("native")
    f32, bf16 = torch.float32, torch.bfloat16
    for pair in ((f32, f32), (bf16, bf16), (I8, f32), (I8, bf16)):
        assert kern.supports_kv_dtype(*pair)
    for pair in ((f32, bf16), (bf16, f32), (I8, torch.half), (torch.half, torch.half),
                 (torch.float8_e4m3fn, bf16), (I8, I8)):  # fmt: skip
        assert not kern.supports_kv_dtype(*pair)
