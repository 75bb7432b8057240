"""Pre-packed weights against F.linear, and the fallbacks: MKL's packed sgemm on CPU fp32
(batchgen.model.packed_linear, layers.linear.PackedLinear; where neither of the others runs),
oneDNN's packed inner product on CPU fp32 and bf16 (batchgen.model.onednn_linear,
layers.linear.OneDnnLinear) and the C kernels' GEMMs (batchgen.model.kernel_linear,
layers.linear.KernelLinear): fp32 on AVX2 or AVX-512, AVX512-BF16 on CPU bf16 without AMX;
their C kernels against the exact sums over many shapes."""

from __future__ import annotations

import gc
import weakref
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from batchgen.model import cpu_kernels, kernel_linear, onednn_linear, packed_linear
from batchgen.model.kernel_linear import KernelGemm
from batchgen.model.layers.linear import Gemm as AnyGemm
from batchgen.model.layers.linear import (
    KernelLinear,
    Linear,
    OneDnnLinear,
    PackedLinear,
    pack_linear,
    pack_linears_,
)
from batchgen.model.once import Once
from batchgen.model.onednn_linear import OneDnn
from batchgen.model.packed_linear import Mkl
from tests.optional import require

CPU = torch.device("cpu")


@dataclass(frozen=True)
class Gemm:
    """A packed GEMM, the dtype it serves and the layer type holding its weights."""

    gemm: AnyGemm
    dtype: torch.dtype
    layer: type[nn.Module]


LAYERS = {Mkl: PackedLinear, OneDnn: OneDnnLinear, KernelGemm: KernelLinear}


def find(kind: str) -> Gemm:
    """The packed GEMM ``kind``; the test fails where it cannot run (tests/optional.py)."""
    require(kind)
    if kind == "mkl":
        mkl = packed_linear.for_dtype(CPU, torch.float32)
        assert mkl is not None
        return Gemm(mkl, torch.float32, PackedLinear)
    if kind in ("dpbf16", "kernel_fp32"):
        dtype = torch.bfloat16 if kind == "dpbf16" else torch.float32
        kernel = kernel_linear.for_dtype(CPU, dtype, cpu_kernels.load())
        assert kernel is not None
        return Gemm(kernel, dtype, KernelLinear)
    dtype = torch.float32 if kind == "onednn_fp32" else torch.bfloat16
    onednn = onednn_linear.for_dtype(CPU, dtype)
    assert onednn is not None
    return Gemm(onednn, dtype, OneDnnLinear)


def chosen(dtype: torch.dtype) -> Gemm:
    """The packed GEMM an engine's plan picks here for ``dtype`` (fp32: the C kernels' GEMM;
    bf16: the AVX512-BF16 GEMM on CPUs with it and no AMX, else oneDNN)."""
    from batchgen.engine.backends import choose_backends

    if dtype == torch.float32:
        require("kernel_fp32")
    elif kernel_linear.for_dtype(CPU, dtype, cpu_kernels.load()) is None:
        require("onednn")
    g = choose_backends(CPU, dtype, "torch").layers.gemm
    assert g is not None
    return Gemm(g, dtype, LAYERS[type(g)])


@pytest.fixture(params=["mkl", "onednn_fp32", "kernel_fp32", "onednn", "dpbf16"])
def gemm(request: pytest.FixtureRequest) -> Gemm:
    return find(request.param)


@pytest.fixture(params=["onednn", "dpbf16"])
def bf16_gemm(request: pytest.FixtureRequest) -> Gemm:
    return find(request.param)


@pytest.fixture
def onednn() -> Gemm:
    return find("onednn")


@pytest.fixture(params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def engine_gemm(request: pytest.FixtureRequest) -> Gemm:
    return chosen(request.param)


def make_linear(
    n_in: int, n_out: int, bias: bool, seed: int, dtype: torch.dtype = torch.float32
) -> tuple[Linear, nn.Linear]:
    """Two copies of one layer: the first to be packed, the second kept as the reference."""
    torch.manual_seed(seed)
    ref = nn.Linear(n_in, n_out, bias=bias, dtype=dtype).requires_grad_(False)
    layer = Linear(n_in, n_out, bias=bias, dtype=dtype).requires_grad_(False)
    layer.load_state_dict(ref.state_dict())
    return layer, ref


def packed(layer: Linear, g: Gemm) -> nn.Module:
    p = pack_linear(layer.weight, layer.bias, g.gemm)
    assert type(p) is g.layer
    return p


def fresh_lookups(monkeypatch: pytest.MonkeyPatch) -> None:
    """Forget the process's MKL and oneDNN lookups for this test: the next load() looks again."""
    monkeypatch.setattr(packed_linear, "_MKL", Once(packed_linear._find))
    monkeypatch.setattr(
        onednn_linear,
        "_ONEDNN",
        {dt: Once(lambda dt=dt: onednn_linear._find(dt)) for dt in onednn_linear._ONEDNN},
    )


def fp32_reference(h: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """h @ W^T + bias summed in fp32 (float64 then rounded: no order effects)."""
    out = h.double() @ weight.double().t()
    return (out if bias is None else out + bias.double()).float()


def rounding_bound(h: Tensor, weight: Tensor, ref: Tensor) -> Tensor:
    """Per output: one bf16 place of ref plus the spread of fp32 sums of the terms in any
    order (K * 2^-24 * sum |h_k w_k|, with room)."""
    scale = h.abs().double() @ weight.abs().double().t()
    return 2**-7 * ref.abs() + (h.shape[1] * 2**-22 * scale).float()


@pytest.mark.parametrize("n_in,n_out", [(96, 80), (512, 768), (1536, 512)])
@pytest.mark.parametrize("rows", [0, 1, 2, 7, 33, 64, 257])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_f_linear(gemm: Gemm, rows: int, bias: bool, n_in: int, n_out: int) -> None:
    layer, ref = make_linear(n_in, n_out, bias, seed=rows, dtype=gemm.dtype)
    p = packed(layer, gemm)
    assert p.out_features == n_out and p.in_features == n_in and not hasattr(p, "weight")
    h = torch.randn(rows, n_in, dtype=gemm.dtype)
    got = p(h)
    assert got.dtype == gemm.dtype and got.shape == (rows, n_out)
    torch.testing.assert_close(got, F.linear(h, ref.weight, ref.bias))


@pytest.mark.parametrize("rows", [1, 8, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_is_rounded_once_from_fp32(bf16_gemm: Gemm, rows: int, bias: bool) -> None:
    """Every output is the fp32 sum rounded to bf16 once: within one bf16 place of the exact
    sum (plus fp32 order effects), and equal to ``(h.float() @ w.float().t()).bfloat16()``
    but for rare last-bit differences (fp32 sums in another order landing on the other side of
    a bf16 rounding boundary). A bf16 accumulator, or rounding twice, fails this."""
    layer, _ = make_linear(896, 1152, bias, seed=rows, dtype=torch.bfloat16)
    w, b = layer.weight.clone(), None if layer.bias is None else layer.bias.clone()
    p = packed(layer, bf16_gemm)
    h = torch.randn(rows, 896, dtype=torch.bfloat16)
    got = p(h).float()
    exact = fp32_reference(h, w, b)
    assert ((got - exact).abs() <= rounding_bound(h, w, exact)).all()
    once = fp32_reference(h, w, b).bfloat16().float()
    assert (got != once).float().mean().item() < 1e-2


@pytest.mark.parametrize("n_in,n_out", [(512, 3072), (896, 1152), (4864, 896)])
def test_bf16_rows_depend_on_the_row_count_only_in_the_last_bit(
    onednn: Gemm, n_in: int, n_out: int
) -> None:
    """Row invariance, packed and ``F.linear`` alike: a row's result computed in a call of M
    rows is within the rounding bound of the same row computed alone, but NOT always bitwise
    equal: oneDNN picks its kernel (so the order of the fp32 sums) by M. Measured here (AMX,
    torch 2.13): bitwise equal for M <= 32, a few outputs per 10^4 one bf16 place apart above
    (scripts/bench_gemm.py --invariance)."""
    layer, ref = make_linear(n_in, n_out, False, seed=n_in, dtype=torch.bfloat16)
    w = ref.weight
    p = packed(layer, onednn)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1024, n_in, generator=gen).bfloat16()
    first = 16
    exact = fp32_reference(x[:first], w, None)
    bound = rounding_bound(x[:first], w, exact)
    for fn in (p, lambda h: F.linear(h, w)):
        alone = torch.cat([fn(x[i : i + 1]) for i in range(first)]).float()
        for m in (2, 16, 33, 64, 100, 256, 1024):
            rows = fn(x[:m])[:first].float()
            n = len(rows)
            assert ((rows - alone[:n]).abs() <= bound[:n]).all(), m


@pytest.mark.parametrize("bias", [False, True])
def test_add_in_place_from_a_column_slice(gemm: Gemm, bias: bool) -> None:
    """h a column slice (row stride > width, as SwiGLU's output in gate_up) and x updated in
    place: MKL's beta = 1, oneDNN's binary-add post-op."""
    layer, ref = make_linear(48, 32, bias, seed=3, dtype=gemm.dtype)
    p = packed(layer, gemm)
    wide = torch.randn(70, 2 * 48, dtype=gemm.dtype)
    h = wide[:, :48]
    x = torch.randn(70, 32, dtype=gemm.dtype)
    expected = x.float() + fp32_reference(h, ref.weight, ref.bias)
    got = p.add_(x, h)
    assert got.data_ptr() == x.data_ptr()
    torch.testing.assert_close(got, expected.to(gemm.dtype))


@pytest.mark.parametrize("rows", [1, 5, 64, 200])
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_residual_add_is_rounded_once(bf16_gemm: Gemm, rows: int, bias: bool) -> None:
    """The fused residual ``x + h W^T + b`` is rounded once, from fp32: equal to the fp32 sum
    rounded but for rare last-bit differences (adding a separately rounded product would
    differ far more often), and within rounding of ``Linear.add_``."""
    layer, ref = make_linear(1536, 512, bias, seed=rows, dtype=torch.bfloat16)
    plain, _ = make_linear(1536, 512, bias, seed=rows, dtype=torch.bfloat16)
    p = packed(layer, bf16_gemm)
    h = torch.randn(rows, 1536, dtype=torch.bfloat16)
    x = torch.randn(rows, 512, dtype=torch.bfloat16) * 4
    product = fp32_reference(h, ref.weight, ref.bias)
    exact = x.float() + product
    got = p.add_(x.clone(), h).float()
    assert (got != exact.bfloat16().float()).float().mean().item() < 1e-2
    bound = rounding_bound(h, ref.weight, product) + 2**-7 * exact.abs()
    assert ((got - exact).abs() <= bound).all()
    assert ((plain.add_(x.clone(), h).float() - got).abs() <= 2 * bound).all()


def test_non_unit_strides_are_copied_first(gemm: Gemm) -> None:
    layer, ref = make_linear(16, 24, False, seed=4, dtype=gemm.dtype)
    p = packed(layer, gemm)
    h = torch.randn(16, 10, dtype=gemm.dtype).t()  # [10, 16], column-major
    x = torch.randn(24, 10, dtype=gemm.dtype).t()  # [10, 24], column-major: no in-place GEMM
    torch.testing.assert_close(p(h), F.linear(h, ref.weight))
    expected = x + F.linear(h, ref.weight)
    got = p.add_(x, h)
    assert got.data_ptr() == x.data_ptr()
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("bias", [False, True])
def test_plain_linear(bias: bool) -> None:
    layer, ref = make_linear(20, 12, bias, seed=5)  # never packed
    h, x = torch.randn(9, 20), torch.randn(9, 12)
    torch.testing.assert_close(layer(h), F.linear(h, ref.weight, ref.bias))
    expected = x + F.linear(h, ref.weight, ref.bias)
    torch.testing.assert_close(layer.add_(x, h), expected)


def test_each_gemm_serves_its_dtypes_on_the_cpu() -> None:
    """MKL fp32 only, oneDNN fp32 and bf16; the plan takes the C kernels' GEMM for fp32 where it
    is there."""
    from batchgen.engine.backends import choose_backends

    meta = torch.device("meta")
    for module in (packed_linear, onednn_linear):
        assert module.for_dtype(meta, torch.float32) is None
        assert module.for_dtype(meta, torch.bfloat16) is None
        assert module.for_dtype(CPU, torch.float16) is None
    assert packed_linear.for_dtype(CPU, torch.bfloat16) is None
    require("kernel_fp32")
    assert isinstance(choose_backends(CPU, torch.float32, "torch").layers.gemm, KernelGemm)
    model = nn.Sequential(Linear(8, 8))
    assert pack_linears_(model, None) == 0 and isinstance(model[0], Linear)


def test_disabled_by_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from batchgen.engine.backends import choose_backends

    monkeypatch.setenv("BATCHGEN_PACK_WEIGHTS", "0")
    fresh_lookups(monkeypatch)
    assert choose_backends(CPU, torch.float32, "torch").layers.gemm is None
    assert choose_backends(CPU, torch.bfloat16, "torch").layers.gemm is None


def test_missing_library_falls_back(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """A torch without MKL's packed GEMM (other platforms): nothing is packed."""
    fresh_lookups(monkeypatch)
    fake = tmp_path / "torch" / "__init__.py"
    fake.parent.mkdir()
    monkeypatch.setattr(packed_linear.torch, "__file__", str(fake))
    assert packed_linear.for_dtype(CPU, torch.float32) is None


def test_onednn_without_bf16_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU where oneDNN cannot run bf16, or a torch without the ops: F.linear."""
    fresh_lookups(monkeypatch)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    assert onednn_linear.for_dtype(CPU, torch.bfloat16) is None
    fresh_lookups(monkeypatch)
    monkeypatch.setattr(onednn_linear, "OneDnn", lambda ops: ops._no_such_op)
    assert onednn_linear.for_dtype(CPU, torch.bfloat16) is None


def test_onednn_failing_its_check_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16: F.linear; fp32 without the C kernels' GEMM: MKL's packed GEMM."""
    from batchgen.engine.backends import choose_backends

    fresh_lookups(monkeypatch)
    monkeypatch.setattr(OneDnn, "linear_add", lambda self, h, other, w, b: other)  # drops h W^T
    assert onednn_linear.for_dtype(CPU, torch.bfloat16) is None
    assert onednn_linear.for_dtype(CPU, torch.float32) is None
    require("mkl")
    monkeypatch.setattr(kernel_linear, "for_dtype", lambda device, dtype, kernels: None)
    assert isinstance(choose_backends(CPU, torch.float32, "torch").layers.gemm, Mkl)


def test_packed_layers_drop_the_original_weight(gemm: Gemm) -> None:
    """No doubled memory: once packed, nothing holds the plain weight; oneDNN's copy takes
    the same bytes."""
    model = nn.Sequential(Linear(256, 384, dtype=gemm.dtype), Linear(384, 256, dtype=gemm.dtype))
    weights = [weakref.ref(m.weight) for m in model]
    assert pack_linears_(model, gemm.gemm) == 2
    gc.collect()
    assert all(w() is None for w in weights)
    assert all(type(m) is gemm.layer for m in model)
    if gemm.layer is OneDnnLinear:
        size = gemm.dtype.itemsize
        assert [torch.ops.mkldnn._nbytes(m.packed) for m in model] == [384 * 256 * size] * 2


def load_tiny(folder: Path, dtype: torch.dtype, tied: bool):
    from batchgen.engine.backends import choose_backends
    from batchgen.model.loader import load_model
    from batchgen.tiny_model import make_tiny_model

    if not folder.exists():
        make_tiny_model(folder, tie_word_embeddings=tied)
    backends = choose_backends(CPU, dtype, "torch")  # as an engine's plan chooses them
    return load_model(folder, CPU, dtype, backends.attention, layers=backends.layers)[0]


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_model_weights_are_packed(engine_gemm: Gemm, tied: bool, tmp_path: Path) -> None:
    """load_model packs every projection and the LM head, tied to the embedding or not (a tied
    head gets its own packed copy); no plain projection weight is left."""
    gemm = engine_gemm
    model = load_tiny(tmp_path / "model", gemm.dtype, tied)
    assert model.layer_backend.gemm is gemm.gemm
    assert not [m for m in model.modules() if isinstance(m, nn.Linear)]
    packs = [m for m in model.modules() if type(m) is gemm.layer]
    assert len(packs) == 4 * model.cfg.num_layers + 1
    assert all(n in ("embed_tokens.weight", "norm.weight") or "norm" in n or n.endswith(".bias")
               for n, _ in model.named_parameters())  # fmt: skip
    assert model.embed_tokens.weight is not None
    if tied:  # the head is a packed copy of the embedding
        hidden = torch.randn(3, model.cfg.hidden_size, dtype=gemm.dtype)
        expected = F.linear(hidden, model.embed_tokens.weight).float()
        torch.testing.assert_close(model.compute_logits(hidden), expected)


def test_bf16_model_unpacked_when_disabled(
    onednn: Gemm, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("BATCHGEN_PACK_WEIGHTS", "0")
    fresh_lookups(monkeypatch)
    model = load_tiny(tmp_path / "model", torch.bfloat16, tied=False)
    assert model.layer_backend.gemm is None
    assert not [
        m for m in model.modules() if isinstance(m, OneDnnLinear | PackedLinear | KernelLinear)
    ]
    assert type(model.layers[0].mlp.down_proj) is Linear and type(model.lm_head) is Linear


def test_bf16_model_logits_packed_match_unpacked(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The whole bf16 model, packed (the GEMM the engine picks here) vs F.linear: the same
    logits up to bf16 rounding."""
    from tests.test_model import run_paged

    layer = chosen(torch.bfloat16).layer
    folder = tmp_path / "model"
    fast = load_tiny(folder, torch.bfloat16, tied=False)
    monkeypatch.setenv("BATCHGEN_PACK_WEIGHTS", "0")
    fresh_lookups(monkeypatch)
    plain = load_tiny(folder, torch.bfloat16, tied=False)
    assert type(fast.lm_head) is layer and type(plain.lm_head) is Linear
    gen = torch.Generator().manual_seed(0)
    vocab = fast.cfg.vocab_size
    seqs = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (37, 12)]
    schedules = [[20, 17], [5, 4, 1, 1, 1]]
    logits = [
        run_paged(model, seqs, schedules, 4, torch.Generator().manual_seed(1))
        for model in (fast, plain)
    ]
    for ours, ref in zip(*logits, strict=True):
        assert torch.isfinite(ours).all()
        cos = F.cosine_similarity(ours, ref, dim=-1)
        assert cos.min() > 0.999, cos.min()
        assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9


def test_onednn_rows_are_padded_to_few_sizes() -> None:
    """oneDNN builds a kernel per row count: calls run at one of ~100 sizes up to 8192 rows,
    never more than 12.5% above the rows asked for, and exactly at up to 32 rows."""
    from batchgen.model.onednn_linear import padded_rows

    sizes = [padded_rows(m) for m in range(1, 8193)]
    assert sizes[:32] == list(range(1, 33))
    assert all(m <= s <= m * 1.125 for m, s in enumerate(sizes, start=1))
    assert sizes == sorted(sizes)
    assert len(set(sizes)) <= 100
    assert all(padded_rows(s) == s for s in set(sizes))


# ---- the C kernels' GEMMs (batchgen/model/cpu_kernels_gemm.c): AVX512-BF16, then fp32 ----


@pytest.fixture
def dpbf16() -> KernelGemm:
    g = find("dpbf16").gemm
    assert isinstance(g, KernelGemm)
    return g


def test_dpbf16_pack_layout() -> None:
    """``[b, j, c, t] = W[16 b + c, 2 j + t]``, zero beyond W (pure PyTorch: runs anywhere)."""
    w = torch.arange(19 * 5, dtype=torch.float32).view(19, 5).bfloat16()
    p = kernel_linear.pack(w)
    assert p.shape == (2, 3, 16, 2) and p.is_contiguous()
    for b, j, c, t in [(0, 0, 0, 0), (0, 0, 0, 1), (0, 2, 15, 0), (1, 1, 2, 1), (1, 0, 2, 0)]:
        assert p[b, j, c, t] == w[16 * b + c, 2 * j + t]
    assert (p[0, 2, :, 1] == 0).all() and (p[1, :, 3:] == 0).all()


@pytest.mark.parametrize(
    "n,k",
    [(1, 1), (5, 3), (16, 2), (17, 33), (48, 64), (83, 37), (100, 2048), (960, 576), (576, 1536)],
)
@pytest.mark.parametrize("bias", [False, True])
def test_dpbf16_kernel_matches_the_fp32_sum(dpbf16: KernelGemm, n: int, k: int, bias: bool) -> None:
    """Every shape class: outputs and inputs not multiples of the 16-output blocks or input
    pairs (masked stores, the odd last input), tiles of 1-8 rows, panels of 1-3 blocks, more
    rows than one pass over the weights takes (K = 2048: 256-row passes). Each output is the
    fp32 sum plus bias plus residual rounded once: within one bf16 place plus fp32 order
    effects of the exact sum, and mostly equal to it rounded."""
    gen = torch.Generator().manual_seed(n * 7 + k)
    w = torch.randn(n, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16() if bias else None
    p = dpbf16.pack(w)
    for m in (1, 2, 7, 8, 9, 23, 64, 300):
        h = torch.randn(m, k, generator=gen).bfloat16()
        x = torch.randn(m, n, generator=gen).bfloat16()
        exact = fp32_reference(h, w, b)
        bound = rounding_bound(h, w, exact)
        got = dpbf16.linear(h, p, n, b).float()
        assert ((got - exact).abs() <= bound).all(), (m, (got - exact).abs().max())
        assert (got != exact.bfloat16().float()).float().mean().item() < 2e-2
        added = dpbf16.linear_add_(x.clone(), h, p, b).float()
        exact_add = exact + x.float()
        bound_add = bound + 2**-7 * exact_add.abs()
        assert ((added - exact_add).abs() <= bound_add).all(), m


@pytest.mark.parametrize("n,k", [(960, 576), (83, 37), (576, 2048)])
def test_dpbf16_rows_do_not_depend_on_the_rows_beside_them(dpbf16: KernelGemm, n: int, k: int) -> None:
    """Bitwise: a row computed alone equals it computed among M rows, at any place in the call
    (unlike oneDNN's, whose sum order changes with M)."""
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(n, k, generator=gen).bfloat16()
    p = dpbf16.pack(w)
    x = torch.randn(600, k, generator=gen).bfloat16()
    alone = torch.cat([dpbf16.linear(x[i : i + 1], p, n, None) for i in (0, 5, 299)])
    for m in (6, 9, 64, 300, 600):
        rows = dpbf16.linear(x[:m], p, n, None)
        picks = [i for i in (0, 5, 299) if i < m]
        assert torch.equal(rows[picks], alone[: len(picks)]), m


def test_dpbf16_is_chosen_only_without_amx(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's bf16 GEMM: this kernel where the CPU has AVX512-BF16 and no AMX and the
    kernels were built with it; oneDNN (or nothing) on AMX CPUs, in the portable build, and where
    its check fails."""
    from batchgen.model.cpu_features import Bf16Support

    kernels = cpu_kernels.load()
    if kernels is None or not kernels.gemm_dpbf16:
        pytest.skip("the C kernels here have no AVX512-BF16 GEMM")
    amx = Bf16Support(("AMX-BF16", "AVX512-BF16"))
    monkeypatch.setattr(kernel_linear, "bf16_support", lambda: amx)
    assert kernel_linear.for_dtype(CPU, torch.bfloat16, kernels) is None
    monkeypatch.setattr(kernel_linear, "bf16_support", lambda: Bf16Support(("AVX512-BF16",)))
    assert kernel_linear.for_dtype(CPU, torch.bfloat16, kernels) is not None
    assert kernel_linear.for_dtype(CPU, torch.float16, kernels) is None
    assert kernel_linear.for_dtype(torch.device("meta"), torch.bfloat16, kernels) is None
    assert kernel_linear.for_dtype(CPU, torch.bfloat16, None) is None
    portable = cpu_kernels.load(avx512bf16=False)
    assert portable is not None and not portable.gemm_dpbf16
    assert kernel_linear.for_dtype(CPU, torch.bfloat16, portable) is None
    monkeypatch.setattr(kernel_linear, "_CHECKED", {})
    monkeypatch.setattr(KernelGemm, "linear_add_", lambda self, x, h, w, b: x)  # drops h W^T
    assert kernel_linear.for_dtype(CPU, torch.bfloat16, kernels) is None


def test_dpbf16_kernel_rejects_mislaid_tensors(dpbf16: KernelGemm) -> None:
    p = dpbf16.pack(torch.randn(32, 16).bfloat16())
    h = torch.randn(4, 16).bfloat16()
    with pytest.raises(ValueError, match="cpu gemm"):
        dpbf16.linear(h.float(), p, 32, None)
    with pytest.raises(ValueError, match="cpu gemm"):
        dpbf16.linear(h, p, 33, None)  # another N than packed
    with pytest.raises(ValueError, match="cpu gemm"):
        dpbf16.linear(torch.randn(4, 18).bfloat16(), p, 32, None)  # another K


@pytest.fixture
def fma() -> KernelGemm:
    g = find("kernel_fp32").gemm
    assert isinstance(g, KernelGemm)
    return g


def fp32_bound(h: Tensor, weight: Tensor, ref: Tensor) -> Tensor:
    """Per output: the spread of fp32 sums of the terms in any order (K * 2^-24 * sum |h_k w_k|,
    with room) plus a few places of the result itself."""
    scale = h.abs().double() @ weight.abs().double().t()
    return (h.shape[1] * 2**-22 * scale).float() + 2**-21 * ref.abs()


def test_fp32_pack_layout() -> None:
    """``[b, k, c] = W[16 b + c, k]``, zero beyond W (pure PyTorch: runs anywhere)."""
    w = torch.arange(19 * 5, dtype=torch.float32).view(19, 5)
    p = kernel_linear.pack(w)
    assert p.shape == (2, 5, 16) and p.is_contiguous() and p.dtype == torch.float32
    for b, k, c in [(0, 0, 0), (0, 4, 15), (1, 2, 2), (1, 0, 0)]:
        assert p[b, k, c] == w[16 * b + c, k]
    assert (p[1, :, 3:] == 0).all()


@pytest.mark.parametrize(
    "n,k",
    [(1, 1), (5, 3), (8, 2), (16, 7), (17, 33), (40, 64), (83, 37), (100, 2048), (24, 3001), (960, 576)],
)
@pytest.mark.parametrize("bias", [False, True])
def test_fp32_kernel_matches_the_exact_sum(fma: KernelGemm, n: int, k: int, bias: bool) -> None:
    """Every shape class: outputs not multiples of the 16-output blocks or of 8 lanes (masked
    loads and stores), tiles of 1-8 rows, panels of 1-3 blocks, more rows than one pass over
    the weights takes, inputs split into 2 or 3 blocks (K = 2048, 3001). Within fp32 order
    effects of the exact sum, with bias and with the residual added."""
    gen = torch.Generator().manual_seed(n * 7 + k)
    w = torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    p = fma.pack(w)
    for m in (1, 2, 5, 7, 8, 9, 13, 23, 64, 300):
        h = torch.randn(m, k, generator=gen)
        x = torch.randn(m, n, generator=gen)
        exact = fp32_reference(h, w, b)
        bound = fp32_bound(h, w, exact)
        got = fma.linear(h, p, n, b)
        assert ((got - exact).abs() <= bound).all(), (m, (got - exact).abs().max())
        added = fma.linear_add_(x.clone(), h, p, b)
        exact_add = exact + x
        assert ((added - exact_add).abs() <= bound + 2**-21 * exact_add.abs()).all(), m


@pytest.mark.parametrize("n,k", [(960, 576), (83, 37), (576, 2048)])
def test_fp32_rows_do_not_depend_on_the_rows_beside_them(fma: KernelGemm, n: int, k: int) -> None:
    """Bitwise: a row computed alone equals it computed among M rows, at any place in the call
    (tiles of every size, several passes over the weights)."""
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(n, k, generator=gen)
    p = fma.pack(w)
    x = torch.randn(600, k, generator=gen)
    alone = torch.cat([fma.linear(x[i : i + 1], p, n, None) for i in (0, 5, 299)])
    for m in (6, 9, 13, 64, 300, 600):
        rows = fma.linear(x[:m], p, n, None)
        picks = [i for i in (0, 5, 299) if i < m]
        assert torch.equal(rows[picks], alone[: len(picks)]), m


def test_fp32_avx2_build_gives_the_same_bits(fma: KernelGemm) -> None:
    """The AVX2 build (6 x 16 tiles of 8-lane vectors) computes every output with the same
    operations as the AVX-512 one (8 x 48 tiles of 16 lanes): equal bit for bit."""
    from tests.test_cpu_kernels import avx2_kernels

    avx2 = KernelGemm(avx2_kernels())
    gen = torch.Generator().manual_seed(5)
    for n, k in [(83, 37), (960, 576), (40, 1536)]:
        w, b = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
        p = fma.pack(w)
        for m in (1, 7, 32, 300):
            h, x = torch.randn(m, k, generator=gen), torch.randn(m, n, generator=gen)
            assert torch.equal(avx2.linear(h, p, n, b), fma.linear(h, p, n, b)), (n, k, m)
            assert torch.equal(avx2.linear_add_(x.clone(), h, p, b), fma.linear_add_(x, h, p, b))


@pytest.mark.parametrize("kind", ["dpbf16", "kernel_fp32"])
def test_kernel_gemm_strided_rows_and_nan(kind: str) -> None:
    """Rows of h and of the residual at a stride (column slices), and a NaN input stays NaN."""
    g = find(kind)
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(40, 24, generator=gen).to(g.dtype)
    p = g.gemm.pack(w)
    h = torch.randn(11, 60, generator=gen).to(g.dtype)[:, 10:34]
    wide = torch.randn(11, 90, generator=gen).to(g.dtype)
    before = wide.clone()
    x = wide[:, 5:45]
    expected = (x.float() + fp32_reference(h, w, None)).to(g.dtype)
    g.gemm.linear_add_(x, h, p, None)
    tol = {"rtol": 2**-7, "atol": 1e-2} if g.dtype == torch.bfloat16 else {}
    torch.testing.assert_close(x, expected, **tol)
    # the columns beside the slice are untouched
    assert torch.equal(wide[:, :5], before[:, :5]) and torch.equal(wide[:, 45:], before[:, 45:])
    h2 = h.contiguous()
    h2[3, 7] = float("nan")
    out = g.gemm.linear(h2, p, 40, None)
    assert out[3].isnan().all() and not out[[0, 1, 2, 4]].isnan().any()


def test_fp32_kernel_is_chosen_where_built(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's fp32 GEMM: this kernel where the build has it and its check passes; else
    oneDNN."""
    from batchgen.engine.backends import choose_backends

    kernels = cpu_kernels.load()
    if kernels is None or not kernels.gemm_f32:
        pytest.skip("the C kernels here have no fp32 GEMM")
    assert kernel_linear.for_dtype(CPU, torch.float32, kernels) is not None
    assert kernel_linear.for_dtype(torch.device("meta"), torch.float32, kernels) is None
    monkeypatch.setattr(kernel_linear, "_CHECKED", {})
    monkeypatch.setattr(KernelGemm, "linear_add_", lambda self, x, h, w, b: x)  # drops h W^T
    assert kernel_linear.for_dtype(CPU, torch.float32, kernels) is None
    require("onednn_fp32")
    assert isinstance(choose_backends(CPU, torch.float32, "torch").layers.gemm, OneDnn)


def test_fp32_kernel_rejects_mislaid_tensors(fma: KernelGemm) -> None:
    p = fma.pack(torch.randn(32, 16))
    h = torch.randn(4, 16)
    with pytest.raises(ValueError, match="cpu gemm"):
        fma.linear(h.bfloat16(), p, 32, None)
    with pytest.raises(ValueError, match="cpu gemm"):
        fma.linear(h, p, 33, None)  # another N than packed
    with pytest.raises(ValueError, match="cpu gemm"):
        fma.linear(torch.randn(4, 18), p, 32, None)  # another K
