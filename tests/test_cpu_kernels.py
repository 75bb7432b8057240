"""The C kernel of batchgen.model.cpu_kernels against the PyTorch reference.

Shapes cover the specialized (G, D) pairs and the generic path, key counts that are and are not
multiples of 16 (the kernel's chunk) or of the block size, extends (several new tokens), a key
start offset (cascade members) with its log-sum-exp, and a stride-padded q. Every cache slot no
sequence uses is NaN, so a stray read shows up in the output.

The attention and store tests run for each ``Flavor``: fp32, bf16 (the build for this CPU: with
AVX512-BF16 where it has them), bf16 from the portable build, and fp32 and bf16 from the build
under the AVX2 cap (``BATCHGEN_CPU_ISA=avx2``: the 8-lane paths an AVX2-only CPU runs; on such a
CPU they are the first two again, and skipped). bf16 results are checked against the fp32 (or float64)
reference computed from the same bf16 inputs, within one bf16 ulp.
"""

from __future__ import annotations

import math
import os
import threading
from dataclasses import dataclass

import pytest
import torch

from batchgen.engine import noise, sampler
from batchgen.engine.noise import TORCH_FORMULA, SamplerKernels
from batchgen.engine.request import SamplingParams
from batchgen.kernels.reference import paged_attention_ref, store_kv_ref
from batchgen.model import cpu_features, cpu_kernels
from batchgen.model.cpu_kernels import CpuKernels
from batchgen.model.layers.activation import silu_mul_
from batchgen.model.layers.norm import RMSNorm
from batchgen.model.layers.rotary import rope_
from batchgen.model.once import Once
from tests.optional import require


@pytest.fixture
def kernel() -> CpuKernels:
    """The process's C kernels; the test fails where they cannot be built (tests/optional.py)."""
    require("cpu_kernels")
    built = cpu_kernels.load()
    assert built is not None
    return built


@dataclass(frozen=True)
class Flavor:
    """Kernels and the dtype their attention, store and layer tests run in."""

    kernel: CpuKernels
    dtype: torch.dtype

    def check(self, got: torch.Tensor, want: torch.Tensor, atol: float, rtol: float) -> None:
        """fp32: within atol/rtol of the reference; bf16: got is bf16 and within one bf16 ulp
        of the reference (one rounding of an fp32 result, plus atol)."""
        if self.dtype == torch.float32:
            torch.testing.assert_close(got, want, atol=atol, rtol=rtol)
            return
        assert got.dtype == torch.bfloat16
        assert_within_ulps(got, want, 1.0, atol)


def bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """The spacing of bf16 values at |x| (8 significant bits), as float64."""
    x = x.double().abs().clamp_min(2.0**-126)
    return torch.exp2(torch.floor(torch.log2(x)) - 7)


def assert_within_ulps(got: torch.Tensor, want: torch.Tensor, ulps: float, atol: float) -> None:
    """|got - want| <= ulps bf16 ulps of want, + atol, everywhere (NaN nowhere)."""
    assert got.shape == want.shape
    assert not got.isnan().any()
    err = (got.double() - want.double()).abs()
    bound = ulps * bf16_ulp(want) + atol
    worst = float((err / bound).max())
    assert worst <= 1.0, f"error up to {worst:.2f} x ({ulps} ulp + {atol})"


def kernels_of(build: str) -> CpuKernels:
    """The process's kernels ("native": for this CPU, with AVX512-BF16 where it has them) or the
    portable bf16 build; the test fails where they cannot be built (tests/optional.py)."""
    require("cpu_kernels")
    built = cpu_kernels.load() if build == "native" else cpu_kernels.build(avx512bf16=False)
    assert built is not None
    assert build == "native" or not built.avx512bf16
    return built


_AVX2: list[CpuKernels] = []  # the AVX2 build, once built


def avx2_kernels() -> CpuKernels:
    """The kernels as the AVX2 cap builds them (``BATCHGEN_CPU_ISA=avx2``); skips on a CPU without
    AVX-512, whose own kernels are those."""
    native = kernels_of("native")
    if native.lanes == 8:
        pytest.skip("no AVX-512 here: the native build is the AVX2 one")
    if not _AVX2:
        saved = os.environ.get(cpu_features.ISA_ENV)
        os.environ[cpu_features.ISA_ENV] = "avx2"
        try:
            built = cpu_kernels.build()
        finally:
            if saved is None:
                del os.environ[cpu_features.ISA_ENV]
            else:
                os.environ[cpu_features.ISA_ENV] = saved
        assert built is not None
        _AVX2.append(built)
    return _AVX2[0]


@pytest.fixture(params=["fp32", "bf16", "bf16-portable", "fp32-avx2", "bf16-avx2"])
def flavor(request: pytest.FixtureRequest) -> Flavor:
    """The kernels in each dtype and build."""
    if request.param.endswith("-avx2"):
        return Flavor(avx2_kernels(), torch.float32 if "fp32" in request.param else torch.bfloat16)
    build = "portable" if request.param == "bf16-portable" else "native"
    return Flavor(kernels_of(build), torch.float32 if request.param == "fp32" else torch.bfloat16)


def test_avx2_cap_takes_the_cpu_for_an_avx2_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """``BATCHGEN_CPU_ISA=avx2``: no native bf16 (so ``auto`` is fp32); an unknown value is
    ignored."""
    monkeypatch.setenv(cpu_features.ISA_ENV, "avx2")
    assert cpu_features.avx2_only() and cpu_features.bf16_support().features == ()
    monkeypatch.setenv(cpu_features.ISA_ENV, "sse2")
    assert not cpu_features.avx2_only()


def test_avx2_cap_builds_8_lane_kernels() -> None:
    """Under the cap the kernels have 8-lane vectors and neither AVX512-BF16 path (on an AVX-512
    CPU, whose own build has 16 lanes)."""
    kernel = avx2_kernels()
    assert kernel.lanes == 8 and not kernel.avx512bf16 and not kernel.gemm_dpbf16
    assert kernel.gemm_f32
    assert kernels_of("native").lanes == 16


def make_case(
    hq: int,
    hkv: int,
    d: int,
    bs: int,
    q_lens: list[int],
    k_lens: list[int],
    seed: int,
    dtype: torch.dtype = torch.float32,
) -> dict:
    gen = torch.Generator().manual_seed(seed)
    own = [math.ceil(k / bs) for k in k_lens]
    num_blocks = sum(own) + 2
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()  # block 0: unused (NaN)
    k_cache = torch.full((num_blocks, bs, hkv, d), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    bt = torch.zeros(len(k_lens), max(own), dtype=torch.int32)  # padding -> NaN block 0
    for b, k_len in enumerate(k_lens):
        blocks, perm = perm[: own[b]], perm[own[b] :]
        bt[b, : own[b]] = torch.tensor(blocks)
        for i in range(k_len):
            k_cache[blocks[i // bs], i % bs] = torch.randn(hkv, d, generator=gen)
            v_cache[blocks[i // bs], i % bs] = torch.randn(hkv, d, generator=gen)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    t = int(cu[-1])
    # q as a column slice of a wider row (like the fused qkv output): row stride > Hq*D
    q = torch.randn(t, hq + 2 * hkv, d, generator=gen).to(dtype)[:, :hq]
    return dict(
        q=q,
        k_cache=k_cache.to(dtype),
        v_cache=v_cache.to(dtype),
        block_tables=bt,
        cu_seqlens_q=cu,
        seq_lens=torch.tensor(k_lens, dtype=torch.int32),
    )


def reference(
    c: dict, scale: float, k_start: list[int] | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Output and log-sum-exp per row, keys from k_start[b] on (rows see keys <= their position)."""
    q, kc, vc, bt = c["q"], c["k_cache"], c["v_cache"], c["block_tables"]
    cu, lens = c["cu_seqlens_q"].tolist(), c["seq_lens"].tolist()
    hq, hkv = q.shape[1], kc.shape[2]
    bs = kc.shape[1]
    out = torch.zeros(q.shape)  # fp32, also for bf16 inputs
    lse = torch.zeros(q.shape[:2])
    for b, n in enumerate(lens):
        start = k_start[b] if k_start else 0
        slots = [int(bt[b, i // bs]) * bs + i % bs for i in range(n)]
        k = kc.reshape(-1, hkv, kc.shape[-1])[slots]
        v = vc.reshape(-1, hkv, vc.shape[-1])[slots]
        qb = q[cu[b] : cu[b + 1]]
        pos = torch.arange(n - qb.shape[0], n)
        seen = (torch.arange(n)[None, :] <= pos[:, None]) & (torch.arange(n)[None, :] >= start)
        for h in range(hq):
            s = (qb[:, h].double() @ k[:, h // (hq // hkv)].double().T) * scale
            s = s.masked_fill(~seen, float("-inf"))
            out[cu[b] : cu[b + 1], h] = (s.softmax(-1) @ v[:, h // (hq // hkv)].double()).float()
            lse[cu[b] : cu[b + 1], h] = torch.logsumexp(s, -1).float()
    return out, lse


# (Hq, Hkv, D, block_size): the specialized pairs G in {1..8} x D in {64, 128}, (1, 96) and
# (2, 256), and generic ones
SHAPES = [
    (8, 2, 64, 16),
    (8, 8, 64, 16),
    (4, 2, 128, 8),
    (16, 2, 128, 16),
    (14, 2, 64, 16),  # G = 7 (Qwen2.5-0.5B): 16/G keys per chunk leave 2 lanes unused
    (9, 3, 64, 16),  # G = 3 (SmolLM2): 16/G keys per chunk leave 1 lane unused
    (2, 2, 96, 8),  # D = 96 (Phi-3)
    (8, 4, 256, 16),  # D = 256 (Gemma)
    (10, 1, 64, 16),  # G = 10: generic
    (4, 1, 48, 4),  # D = 48: generic
    (3, 3, 8, 1),
]
# the extend tests' subset: three specialized pairs, G = 7, G = 3 and the generic D = 48
EXTEND_SHAPES = SHAPES[:3] + [(14, 2, 64, 16), (9, 3, 64, 16), (4, 1, 48, 4)]


@pytest.mark.parametrize("tiled", [False, True], ids=["per-token", "tiled"])
@pytest.mark.parametrize("hq,hkv,d,bs", SHAPES)
def test_decode_matches_reference(
    flavor: Flavor, hq: int, hkv: int, d: int, bs: int, tiled: bool
) -> None:
    k_lens = [1, 15, 16, 17, 31, 32, 33, 64, 100, 7 * bs, 7 * bs + 1]
    c = make_case(hq, hkv, d, bs, [1] * len(k_lens), k_lens, hq * 1000 + d + bs, flavor.dtype)
    out = torch.full(c["q"].shape, float("nan"), dtype=flavor.dtype)
    seqs = torch.arange(len(k_lens), dtype=torch.int32)
    flavor.kernel.paged_attention(**c, seqs=seqs, out=out, scale=0.2, tiled=tiled)
    c32 = {k: v.float() if v.is_floating_point() else v for k, v in c.items()}
    ref = paged_attention_ref(**c32, scale=0.2, max_seqlen_q=1, max_seqlen_k=max(k_lens))
    flavor.check(out, ref, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("fp32_out", [False, True], ids=["", "fp32-out"])
@pytest.mark.parametrize("tiled", [False, True], ids=["per-token", "tiled"])
@pytest.mark.parametrize("hq,hkv,d,bs", EXTEND_SHAPES)
def test_extend_subset_and_key_start(
    flavor: Flavor, hq: int, hkv: int, d: int, bs: int, tiled: bool, fp32_out: bool
) -> None:
    """Several new tokens per sequence, only some sequences computed, keys from an offset;
    bf16 inputs also with an fp32 out (what a cascade merge reads)."""
    if fp32_out and flavor.dtype == torch.float32:
        pytest.skip("fp32 out is the fp32 case")
    q_lens = [3, 1, 8, 2, 5]
    k_lens = [40, 17, 8 + 3 * bs, 2 * bs, 70]
    k_start = [16, 0, 2 * bs, bs, 35]
    c = make_case(hq, hkv, d, bs, q_lens, k_lens, 7 + hq + d, flavor.dtype)
    t = c["q"].shape[0]
    out = torch.full((t, hq, d), -7.0, dtype=torch.float32 if fp32_out else flavor.dtype)
    lse = torch.full((t, hq), -7.0)
    seqs = torch.tensor([0, 2, 3, 4], dtype=torch.int32)  # sequence 1 is not ours
    ks = torch.tensor(k_start, dtype=torch.int32)
    flavor.kernel.paged_attention(
        **c, seqs=seqs, out=out, scale=0.3, k_start=ks, lse=lse, tiled=tiled
    )
    ref, ref_lse = reference(c, 0.3, k_start)
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
    """The tiled kernel on fresh prefills (new tokens = keys) of lengths around the tile and
    block sizes, and on long extends after a cached part and a key offset, with the lse."""
    q_lens = [1, 2, 15, 16, 17, 33, 4 * bs, 130, 40, 23]
    k_lens = [1, 2, 15, 16, 17, 33, 4 * bs, 130, 40 + 3 * bs, 23 + 77]
    k_start = [0] * 8 + [bs, 60]
    c = make_case(hq, hkv, d, bs, q_lens, k_lens, 11 + hq + d + bs, flavor.dtype)
    t = c["q"].shape[0]
    out = torch.full((t, hq, d), float("nan"), dtype=flavor.dtype)
    lse = torch.full((t, hq), float("nan"))
    seqs = torch.arange(len(q_lens), dtype=torch.int32)
    ks = torch.tensor(k_start, dtype=torch.int32)
    flavor.kernel.paged_attention(
        **c, seqs=seqs, out=out, scale=0.25, k_start=ks, lse=lse, tiled=True
    )
    ref, ref_lse = reference(c, 0.25, k_start)
    flavor.check(out, ref, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("tiled", [False, True], ids=["per-token", "tiled"])
def test_extremes_and_many_threads(flavor: Flavor, tiled: bool) -> None:
    """Huge logits (one key dominates: exp underflows to 0 for the rest), a sequence much longer
    than the others, and more threads than work items."""
    c = make_case(8, 2, 64, 16, [1, 1, 1], [3, 1000, 20], seed=3)
    c["q"] = c["q"] * 200.0
    c = {k: v.to(flavor.dtype) if v.is_floating_point() else v for k, v in c.items()}
    out = torch.empty(c["q"].shape, dtype=flavor.dtype)
    seqs = torch.arange(3, dtype=torch.int32)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(7)
        flavor.kernel.paged_attention(**c, seqs=seqs, out=out, scale=0.125, tiled=tiled)
    finally:
        torch.set_num_threads(threads)
    c32 = {k: v.float() if v.is_floating_point() else v for k, v in c.items()}
    ref = paged_attention_ref(**c32, scale=0.125, max_seqlen_q=1, max_seqlen_k=1000)
    assert torch.isfinite(out).all()
    flavor.check(out, ref, atol=1e-4, rtol=1e-4)


def test_store_kv_matches_reference(flavor: Flavor) -> None:
    gen = torch.Generator().manual_seed(0)
    kc = torch.randn(6, 4, 2, 8, generator=gen).to(flavor.dtype)
    vc = torch.randn(6, 4, 2, 8, generator=gen).to(flavor.dtype)
    kv = torch.randn(5, 3, 2, 8, generator=gen).to(flavor.dtype)  # k, v: column slices of one
    k, v = kv[:, 0], kv[:, 2]
    slots = torch.tensor([3, 0, -1, 23, 9])
    want_k, want_v = kc.clone(), vc.clone()
    store_kv_ref(k, v, want_k, want_v, slots)
    flavor.kernel.store_kv(k, v, kc, vc, slots)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)


def test_rejects_unsupported_inputs(kernel: CpuKernels) -> None:
    c = make_case(4, 2, 64, 16, [1], [5], seed=1)
    out = torch.empty(c["q"].shape)
    seqs = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="unsupported"):
        kernel.paged_attention(**{**c, "q": c["q"].double()}, seqs=seqs, out=out, scale=1.0)
    with pytest.raises(ValueError, match="unsupported"):
        kernel.paged_attention(
            **{**c, "seq_lens": c["seq_lens"].long()}, seqs=seqs, out=out, scale=1.0
        )
    with pytest.raises(ValueError, match="unsupported"):  # one dtype per call
        kernel.paged_attention(**{**c, "q": c["q"].bfloat16()}, seqs=seqs, out=out, scale=1.0)
    with pytest.raises(ValueError, match="unsupported"):  # fp16 keeps the PyTorch path
        kernel.rms_norm(torch.ones(2, 8, dtype=torch.half), torch.ones(8, dtype=torch.half), 1e-5)


def fresh_loader(monkeypatch: pytest.MonkeyPatch) -> None:
    """Forget the process's kernels for this test: the next load() builds them again."""
    fresh = {v: Once(lambda v=v: cpu_kernels.build(v)) for v in (True, False)}
    monkeypatch.setattr(cpu_kernels, "_KERNELS", fresh)


def test_disabled_by_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """BATCHGEN_CPU_KERNEL=0: the engine's kernel choice keeps every path in PyTorch."""
    from batchgen.engine.backends import choose_backends
    from batchgen.engine.noise import TORCH_FORMULA

    monkeypatch.setenv("BATCHGEN_CPU_KERNEL", "0")
    for dtype in (torch.float32, torch.bfloat16):
        backends = choose_backends(torch.device("cpu"), dtype, "torch")
        assert backends.layers.cpu is None and backends.layers.gemm is None
        assert backends.sampler == TORCH_FORMULA
        assert backends.attention._use_native is False


def test_no_compiler_falls_back(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("BATCHGEN_CACHE_DIR", str(tmp_path))
    fresh_loader(monkeypatch)
    assert cpu_kernels.load() is None


@pytest.mark.parametrize("n", [8, 64, 100, 512])
def test_rms_norm_matches_torch(kernel: CpuKernels, n: int) -> None:
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(37, n + 5, generator=gen)[:, :n] * 3.0  # strided rows
    w = torch.randn(n, generator=gen)
    want = (x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-5)) * w
    got = kernel.rms_norm(x, w, 1e-5)
    torch.testing.assert_close(got, want.float(), atol=1e-5, rtol=1e-5)
    x3 = torch.randn(5, 4, n, generator=gen)  # per-head norm (Qwen3's q_norm / k_norm)
    torch.testing.assert_close(
        kernel.rms_norm(x3, w, 1e-6), torch.nn.functional.rms_norm(x3, (n,), w, 1e-6)
    )


@pytest.mark.parametrize("d", [8, 64, 128, 34])
def test_rope_in_place_matches_torch(kernel: CpuKernels, d: int) -> None:
    gen = torch.Generator().manual_seed(d)
    qkv = torch.randn(9, 7, d, generator=gen)
    x = qkv[:, :5]  # rotate the first 5 "heads" of each row, in place
    cos = torch.randn(9, d // 2, generator=gen)
    sin = torch.randn(9, d // 2, generator=gen)
    x1, x2 = x[..., : d // 2].clone(), x[..., d // 2 :].clone()
    c, s = cos[:, None], sin[:, None]
    want = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
    rest = qkv[:, 5:].clone()
    kernel.rope_(x, cos, sin)
    torch.testing.assert_close(qkv[:, :5], want, atol=1e-6, rtol=1e-6)
    assert torch.equal(qkv[:, 5:], rest)  # the other columns are untouched


@pytest.mark.parametrize("inter", [16, 40, 1536])
def test_silu_mul_matches_torch(kernel: CpuKernels, inter: int) -> None:
    gen = torch.Generator().manual_seed(inter)
    gate_up = torch.randn(11, 2 * inter, generator=gen) * 4.0
    gate_up[0, :6] = torch.tensor([0.0, -0.0, 90.0, -90.0, 200.0, -200.0])  # exp over/underflow
    gate, up = gate_up[:, :inter], gate_up[:, inter:]
    want = torch.nn.functional.silu(gate.double()) * up.double()
    up_before = up.clone()
    got = kernel.silu_mul_(gate_up)
    assert got.data_ptr() == gate_up.data_ptr() and got.shape == (11, inter)  # in place
    assert torch.equal(gate_up[:, inter:], up_before)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want.float(), atol=1e-6, rtol=2e-6)


def moe_reference(
    x: torch.Tensor, rows: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, e_of: list[int]
) -> torch.Tensor:
    """The experts' SwiGLU MLPs pair by pair in float64 (pair p: token row rows[p], expert
    e_of[p]), rounded to bf16 where the kernel's bf16 path rounds (each GEMM output, silu, the
    product) when the inputs are bf16."""
    bf = x.dtype == torch.bfloat16

    def r(t: torch.Tensor) -> torch.Tensor:
        return t.bfloat16().double() if bf else t

    inter = down.shape[2]
    out = []
    for p, e in enumerate(e_of):
        h = r(gate_up[e].double() @ x[int(rows[p])].double())  # [2I]
        act = r(r(torch.nn.functional.silu(h[:inter])) * h[inter:])
        out.append(r(down[e].double() @ act))
    return torch.stack(out)


@pytest.mark.parametrize(
    "t, e, h, inter, k, same",
    [
        (5, 8, 64, 32, 2, False),  # dpbf16 path (H, I multiples of 32)
        (7, 4, 72, 40, 3, False),  # tails: H, I not multiples of 16 or 32
        (1, 6, 96, 16, 6, False),  # one token, every expert once
        (13, 16, 40, 24, 1, True),  # every pair on one expert: tiles of 8, 4 and 1
        (33, 16, 128, 48, 4, False),  # some experts without pairs
        (40, 4, 64, 64, 2, False),  # ~20 pairs per expert: 4 x 4 dpbf16 blocks in both passes
        (24, 2, 64, 34, 1, False),  # dpbf16 gate-up pass with 2 rows left after the 4-row blocks
        (24, 2, 66, 64, 1, False),  # ... the down pass likewise
    ],
)
def test_moe_experts_match_reference(
    flavor: Flavor, t: int, e: int, h: int, inter: int, k: int, same: bool
) -> None:
    """Both passes over the pairs sorted by expert; x given with a padded row stride."""
    gen = torch.Generator().manual_seed(t * 100 + h)
    dt = flavor.dtype
    x = (torch.randn(t, h + 8, generator=gen))[:, :h].to(dt)  # stride h + 8
    gate_up = (torch.randn(e, 2 * inter, h, generator=gen) / h**0.5).to(dt)
    down = (torch.randn(e, h, inter, generator=gen) / inter**0.5).to(dt)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
    if same:
        ids[:] = 3
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=e)
    starts = torch.zeros(e + 1, dtype=torch.int64)
    torch.cumsum(counts, 0, out=starts[1:])
    rows = order // k
    out = torch.full((rows.shape[0], h), float("nan"), dtype=dt)
    flavor.kernel.moe_experts(x, rows, starts, gate_up, down, out, max_rows=t * k)
    want = moe_reference(x, rows, gate_up, down, flat[order].tolist())
    if dt == torch.float32:
        torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
    else:
        # a dot product summed in fp32 may round a GEMM output to the neighbouring bf16 value
        assert_within_ulps(out, want, 4.0, 1e-3)


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_moe_combine_matches_the_torch_combine(kernel: CpuKernels, dt: torch.dtype) -> None:
    """Each token's weighted sum read from rows in any order equals the combine of the rows put
    back in (token, slot) order; H with a tail past the 16-lane vectors."""
    from batchgen.model.layers.moe import combine

    gen = torch.Generator().manual_seed(9)
    t, k, h = 7, 3, 40
    y = torch.randn(t * k, h, generator=gen).to(dt)  # rows in a shuffled order
    weights = torch.rand(t, k, generator=gen)
    order = torch.randperm(t * k, generator=gen)  # row i of y is pair order[i]
    pos = torch.empty_like(order)
    pos[order] = torch.arange(t * k)
    pair_out = torch.empty_like(y)
    pair_out[order] = y
    got = kernel.moe_combine(y, pos, weights)
    assert got.dtype == torch.float32 and got.shape == (t, h)
    torch.testing.assert_close(got, combine(pair_out, weights), atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="moe_combine"):
        kernel.moe_combine(y, pos[:-1], weights)


def test_moe_experts_leave_the_experts_above_max_rows(kernel: CpuKernels) -> None:
    """Experts with more than max_rows pairs are the caller's: their rows stay untouched."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(6, 32, generator=gen)
    gate_up, down = torch.randn(3, 16, 32, generator=gen), torch.randn(3, 32, 8, generator=gen)
    rows = torch.tensor([0, 1, 2, 3, 4, 5])  # expert 0: pairs 0-1, expert 1: none, 2: 2-5
    starts = torch.tensor([0, 2, 2, 6])
    out = torch.full((6, 32), float("nan"))
    kernel.moe_experts(x, rows, starts, gate_up, down, out, max_rows=3)
    assert out[2:].isnan().all() and not out[:2].isnan().any()
    want = moe_reference(x, rows, gate_up, down, [0, 0, 2, 2, 2, 2])
    torch.testing.assert_close(out[:2].double(), want[:2], atol=1e-5, rtol=1e-5)


def test_moe_experts_rejects_bad_inputs(kernel: CpuKernels) -> None:
    x = torch.randn(3, 16)
    gate_up, down = torch.randn(4, 8, 16), torch.randn(4, 16, 4)
    rows, starts = torch.zeros(3, dtype=torch.int64), torch.tensor([0, 3, 3, 3, 3])
    out = torch.empty(3, 16)
    with pytest.raises(ValueError, match="moe_experts"):
        kernel.moe_experts(x, rows.int(), starts, gate_up, down, out, 8)  # int32 rows
    with pytest.raises(ValueError, match="moe_experts"):
        kernel.moe_experts(x, rows, starts, gate_up.bfloat16(), down, out, 8)  # mixed dtypes
    with pytest.raises(ValueError, match="moe_experts"):
        kernel.moe_experts(x, rows, starts[:-1], gate_up, down, out, 8)  # starts not [E + 1]


@pytest.fixture(params=["native", "portable"])
def bf16_kernel(request: pytest.FixtureRequest) -> CpuKernels:
    """Both builds, for the bf16 layer ops."""
    return kernels_of(request.param)


def bf16_randn(*shape: int, gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * scale).bfloat16()


@pytest.mark.parametrize("n", [8, 64, 100, 896])
def test_rms_norm_bf16_matches_torch_layer(bf16_kernel: CpuKernels, n: int) -> None:
    """bf16 RMSNorm against batchgen's RMSNorm layer on bf16 (the HF formula): equal but for a
    last-bit difference of the fp32 mean (torch sums in fp32), at most one bf16 ulp."""
    gen = torch.Generator().manual_seed(n)
    layer = RMSNorm(n, 1e-5).bfloat16()
    with torch.no_grad():
        layer.weight.copy_(bf16_randn(n, gen=gen))
    x = bf16_randn(37, n + 5, gen=gen, scale=3.0)[:, :n]  # strided rows
    with torch.no_grad():
        want = layer(x)
    got = bf16_kernel.rms_norm(x, layer.weight.detach(), 1e-5)
    assert got.dtype == torch.bfloat16
    assert_within_ulps(got, want, 1.0, 0.0)
    assert float((got == want).float().mean()) > 0.97
    x3 = bf16_randn(5, 4, n, gen=gen)  # per-head norm (Qwen3's q_norm / k_norm)
    with torch.no_grad():
        assert_within_ulps(bf16_kernel.rms_norm(x3, layer.weight, 1e-5), layer(x3), 1.0, 0.0)


@pytest.mark.parametrize("d", [8, 64, 128, 34])
def test_rope_bf16_bit_identical_to_torch(bf16_kernel: CpuKernels, d: int) -> None:
    """bf16 RoPE in place equals rotary.rope_ on bf16 tensors bit for bit."""
    gen = torch.Generator().manual_seed(d)
    qkv = bf16_randn(9, 7, d, gen=gen, scale=4.0)
    want_qkv = qkv.clone()
    cos = bf16_randn(9, d // 2, gen=gen)
    sin = bf16_randn(9, d // 2, gen=gen)
    rope_(want_qkv[:, :5], cos, sin)
    bf16_kernel.rope_(qkv[:, :5], cos, sin)  # the first 5 "heads" of each row
    assert torch.equal(qkv, want_qkv)  # the other columns are untouched too


@pytest.mark.parametrize("inter", [16, 40, 1536])
def test_silu_mul_bf16_matches_torch(bf16_kernel: CpuKernels, inter: int) -> None:
    """bf16 SwiGLU against activation.silu_mul_ on bf16: silu in fp32 differs from torch's in
    the last fp32 bits at most, so the results agree within one bf16 ulp (nearly all equal)."""
    gen = torch.Generator().manual_seed(inter)
    gate_up = bf16_randn(11, 2 * inter, gen=gen, scale=4.0)
    gate_up[0, :6] = torch.tensor([0.0, -0.0, 90.0, -90.0, 200.0, -200.0])  # exp over/underflow
    want = silu_mul_(gate_up.clone())
    up_before = gate_up[:, inter:].clone()
    got = bf16_kernel.silu_mul_(gate_up)
    assert got.data_ptr() == gate_up.data_ptr() and got.shape == (11, inter)  # in place
    assert torch.equal(gate_up[:, inter:], up_before)
    assert_within_ulps(got, want, 1.0, 0.0)
    assert float((got == want).float().mean()) > 0.97


def native_sampler_kernels(kernel: CpuKernels) -> SamplerKernels:
    """What the engine hands the sampler on a CPU (engine.backends.choose_backends)."""
    return SamplerKernels(uniform_noise=kernel.uniform_noise, race_draw=kernel.race_draw)


def test_uniform_noise_bit_identical_to_torch(kernel: CpuKernels) -> None:
    """The sampler's noise from the C kernel equals the PyTorch formula bit for bit, for the
    whole vocabulary and for gathered candidate ids (both the [1, K] and [S, K] forms)."""
    gen = torch.Generator().manual_seed(0)
    keys = torch.randint(0, 2**63 - 1, (33,), generator=gen)
    keys[0], keys[1] = 0, 2**63 - 1
    pos = torch.randint(0, 10**6, (33,), generator=gen)
    cand = torch.randint(0, 150_000, (33, 70), generator=gen)
    native = native_sampler_kernels(kernel)
    got = [
        noise.uniform_noise(keys, pos, 4099, native),
        noise.uniform_at(keys, pos, cand, native),
    ]
    want = [
        noise.uniform_noise(keys, pos, 4099, TORCH_FORMULA),
        noise.uniform_at(keys, pos, cand, TORCH_FORMULA),
    ]
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
        assert bool(((g > 0) & (g < 1)).all())


# 64 and 150: the kernel reads a prefix 64 keys at a time (one chunk exactly; a partial last one)
@pytest.mark.parametrize("hq,hkv,d,bs", SHAPES)
@pytest.mark.parametrize("prefix_len", [1, 16, 37, 64, 150])
def test_prefix_attention_merge_matches_attention_over_all_parts(
    flavor: Flavor, hq: int, hkv: int, d: int, bs: int, prefix_len: int
) -> None:
    """Rows that attended to their own keys (out, lse) and then, through the kernel, to shared
    prefixes end with attention (and log-sum-exp) over all their keys; other rows untouched.

    Keys: an outer prefix [0, P), an inner one [P, P + 7), then the rows' own keys. Call 1 (the
    inner depth) holds two prefixes: the inner one for rows 7, 0, 3 and the outer one for rows
    1, 5; call 2 the outer one for rows 7, 0, 3, 10, 4.
    """
    gen = torch.Generator().manual_seed(hq + d + prefix_len)
    t, inner, own = 11, 7, 9
    c = make_case(hq, hkv, d, bs, [1], [prefix_len + inner + own], prefix_len, flavor.dtype)
    kc, vc = c["k_cache"], c["v_cache"]
    bt = c["block_tables"][0].tolist()
    slots_all = [bt[i // bs] * bs + i % bs for i in range(prefix_len + inner + own)]
    k = kc.reshape(-1, hkv, d)[slots_all].double()  # [L, Hkv, D]
    v = vc.reshape(-1, hkv, d)[slots_all].double()
    q = (torch.randn(t, hq + 2 * hkv, d, generator=gen) * 2).to(flavor.dtype)[:, :hq]  # a slice
    grp = hq // hkv
    scale = 0.3

    def attend(keys: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        qh = q.double().contiguous().view(t, hkv, grp, d)
        s = torch.einsum("thgd,khd->thgk", qh, k[keys]) * scale
        lse = torch.logsumexp(s, -1)
        o = torch.einsum("thgk,khd->thgd", s.softmax(-1), v[keys])
        return o.reshape(t, hq, d).float().contiguous(), lse.reshape(t, hq).float().contiguous()

    outer = list(range(prefix_len))
    mid = list(range(prefix_len, prefix_len + inner))
    mine = list(range(prefix_len + inner, prefix_len + inner + own))
    out, lse = attend(mine)  # each row's own part
    before, lse_before = out.clone(), lse.clone()

    def call(parts: list[tuple[list[int], list[int]]]) -> None:
        """parts: (key positions, rows) per prefix."""
        slots = torch.tensor([slots_all[i] for keys, _ in parts for i in keys])
        rows = torch.tensor([r for _, rs in parts for r in rs])
        slot_off = torch.tensor([0] + [len(keys) for keys, _ in parts]).cumsum(0)
        row_off = torch.tensor([0] + [len(rs) for _, rs in parts]).cumsum(0)
        flavor.kernel.prefix_attention_merge_(
            q, kc, vc, slots, slot_off, rows, row_off, out, lse, scale
        )

    call([(mid, [7, 0, 3]), (outer, [1, 5])])
    call([(outer, [7, 0, 3, 10, 4])])
    for rows, keys in (([7, 0, 3], outer + mid + mine), ([1, 5, 10, 4], outer + mine)):
        want, want_lse = attend(keys)
        torch.testing.assert_close(out[rows], want[rows], atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(lse[rows], want_lse[rows], atol=2e-5, rtol=1e-5)
    others = [2, 6, 8, 9]
    assert torch.equal(out[others], before[others])
    assert torch.equal(lse[others], lse_before[others])


@pytest.mark.parametrize("num_rows", [33, 70])
def test_prefix_attention_merge_many_rows(flavor: Flavor, num_rows: int) -> None:
    """More (row, head) pairs than one work item takes (128): several items per prefix and KV
    head, several 16-lane tiles per item (the last one partial), over a multi-chunk prefix."""
    hq, hkv, d, bs, prefix_len = 8, 2, 64, 16, 100
    gen = torch.Generator().manual_seed(num_rows)
    c = make_case(hq, hkv, d, bs, [1], [prefix_len], prefix_len, flavor.dtype)
    kc, vc = c["k_cache"], c["v_cache"]
    bt = c["block_tables"][0].tolist()
    slots = torch.tensor([bt[i // bs] * bs + i % bs for i in range(prefix_len)])
    k = kc.reshape(-1, hkv, d)[slots].double()  # [P, Hkv, D]
    v = vc.reshape(-1, hkv, d)[slots].double()
    q = (torch.randn(num_rows, hq, d, generator=gen) * 2).to(flavor.dtype)
    # The rows' own part: nothing attended yet (lse -inf: the merge takes the prefix alone).
    out = torch.zeros(num_rows, hq, d)
    lse = torch.full((num_rows, hq), float("-inf"))
    flavor.kernel.prefix_attention_merge_(
        q, kc, vc, slots, torch.tensor([0, prefix_len]), torch.arange(num_rows),
        torch.tensor([0, num_rows]), out, lse, 0.3,
    )  # fmt: skip
    qh = q.double().view(num_rows, hkv, hq // hkv, d)
    s = torch.einsum("thgd,khd->thgk", qh, k) * 0.3
    want = torch.einsum("thgk,khd->thgd", s.softmax(-1), v).reshape(num_rows, hq, d)
    torch.testing.assert_close(out, want.float(), atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(lse, torch.logsumexp(s, -1).reshape(num_rows, hq).float(),
                               atol=2e-5, rtol=1e-5)  # fmt: skip


@pytest.fixture(params=["native", "avx2"])
def race_kernel(request: pytest.FixtureRequest) -> CpuKernels:
    """The build for this CPU, and the AVX2 build (8 lanes; skipped where that is the native)."""
    return kernels_of("native") if request.param == "native" else avx2_kernels()


@pytest.mark.parametrize("vocab", [1, 8, 9, 16, 17, 4099])
def test_race_draw_matches_float64_race(race_kernel: CpuKernels, vocab: int) -> None:
    """The fused draw is argmax_j softmax(x / T)_j / E_j with the sampler's noise, first index on
    ties; checked against the race in float64 on every row whose winner is not a near-tie."""
    kernel = race_kernel
    gen = torch.Generator().manual_seed(vocab)
    rows = 300
    scale = torch.tensor([0.1, 1.0, 5.0, 40.0]).repeat(rows // 4)[:, None]
    logits = torch.randn(rows, vocab, generator=gen) * scale  # [S, V]
    logits[0] = 2.0  # a flat row: every token ties on weight
    if vocab > 3:
        logits[1, 2] = logits[1, 3] = logits[1].max() + 1.0  # two maxima
    temperature = torch.rand(rows, generator=gen) * 1.5 + 0.05
    keys = torch.randint(0, 2**63 - 1, (rows,), generator=gen)
    pos = torch.randint(0, 10**6, (rows,), generator=gen)
    state = noise.row_state(keys, pos)
    got = kernel.race_draw(logits, temperature, state)

    u = noise.uniform_noise(keys, pos, vocab).double()
    s = logits.double() / temperature.double()[:, None]
    ratio = (s - s.amax(1, keepdim=True)).exp() / -torch.log1p(-u)  # [S, V]
    want = ratio.argmax(1)
    top2 = ratio.topk(min(2, vocab), dim=1).values
    clear = (top2[:, 0] > top2[:, -1] * (1 + 1e-5)) if vocab > 1 else torch.ones(rows, dtype=bool)
    assert int(clear.sum()) > rows * 0.9
    assert torch.equal(got[clear], want[clear])
    assert bool(((got >= 0) & (got < vocab)).all())


def test_race_draw_is_the_samplers_plain_draw(race_kernel: CpuKernels) -> None:
    """sample() on CPU draws the same tokens with the C race as with the PyTorch formula
    (temperature only), row by row, at every temperature."""
    kernel = race_kernel
    gen = torch.Generator().manual_seed(9)
    rows, vocab = 64, 1000
    logits = torch.randn(rows, vocab, generator=gen) * 4
    params = [SamplingParams(temperature=0.3 + 0.05 * i, seed=i) for i in range(rows)]
    batch = sampler.SamplingBatch.from_rows(
        params, list(range(100, 100 + rows)), [5] * rows, None, None, vocab
    )
    calls = []

    def race_draw(logits: torch.Tensor, temperature: torch.Tensor, state: torch.Tensor):
        calls.append(logits.shape)
        return kernel.race_draw(logits, temperature, state)

    native = SamplerKernels(uniform_noise=kernel.uniform_noise, race_draw=race_draw)
    got = sampler.sample(logits, batch, logprobs=False, kernels=native)
    assert got.logprobs is None
    assert calls == [(rows, vocab)]  # every row went through the C race
    want = sampler.sample(logits, batch, kernels=TORCH_FORMULA)
    assert torch.equal(got.tokens, want.tokens)


def test_concurrent_first_loads_both_get_the_kernels(
    monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    """A caller arriving while another one compiles the library waits for it (it used to get
    None: the loader marked itself done before the build finished)."""
    require("cpu_kernels")
    monkeypatch.setenv("BATCHGEN_CACHE_DIR", str(tmp_path))  # nothing cached: a real build
    fresh_loader(monkeypatch)
    compiling, second_done = threading.Event(), threading.Event()
    real_compile = cpu_kernels._compile

    def slow_compile(cc: str, flags: list[str]):
        compiling.set()
        second_done.wait(timeout=2.0)  # the second caller returns early, or waits on the lock
        return real_compile(cc, flags)

    monkeypatch.setattr(cpu_kernels, "_compile", slow_compile)
    got: dict[str, object] = {}

    def call(name: str) -> None:
        got[name] = cpu_kernels.load()
        if name == "second":
            second_done.set()

    first = threading.Thread(target=call, args=("first",))
    first.start()
    assert compiling.wait(timeout=60)
    second = threading.Thread(target=call, args=("second",))
    second.start()
    first.join()
    second.join()
    assert got["first"] is not None and got["second"] is got["first"]
