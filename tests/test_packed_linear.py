"""MKL pre-packed weights (batchgen.model.packed_linear, layers.linear.PackedLinear) against
F.linear, and the fallbacks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from batchgen.model import packed_linear
from batchgen.model.layers.linear import Linear, PackedLinear, pack_linears_
from batchgen.model.once import Once
from tests.optional import require

CPU = torch.device("cpu")


@pytest.fixture
def mkl() -> packed_linear.Mkl:
    """MKL's packed GEMM; the test fails where torch exports none (tests/optional.py)."""
    require("mkl")
    found = packed_linear.for_dtype(CPU, torch.float32)
    assert found is not None
    return found


def make_linear(n_in: int, n_out: int, bias: bool, seed: int) -> tuple[Linear, nn.Linear]:
    """Two copies of one layer: the first to be packed, the second kept as the reference."""
    torch.manual_seed(seed)
    ref = nn.Linear(n_in, n_out, bias=bias).requires_grad_(False)
    layer = Linear(n_in, n_out, bias=bias).requires_grad_(False)
    layer.load_state_dict(ref.state_dict())
    return layer, ref


def packed(layer: Linear, mkl: packed_linear.Mkl) -> PackedLinear:
    return PackedLinear(layer.weight, layer.bias, mkl)


def fresh_lookup(monkeypatch: pytest.MonkeyPatch) -> None:
    """Forget the process's MKL lookup for this test: the next load() looks again."""
    monkeypatch.setattr(packed_linear, "_MKL", Once(packed_linear._find))


@pytest.mark.parametrize("rows", [0, 1, 7, 64, 257])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_f_linear(mkl: packed_linear.Mkl, rows: int, bias: bool) -> None:
    layer, ref = make_linear(96, 80, bias, seed=rows)
    p = packed(layer, mkl)
    assert p.out_features == 80 and not hasattr(p, "weight")
    h = torch.randn(rows, 96)
    torch.testing.assert_close(p(h), F.linear(h, ref.weight, ref.bias))


@pytest.mark.parametrize("bias", [False, True])
def test_add_in_place_from_a_column_slice(mkl: packed_linear.Mkl, bias: bool) -> None:
    """h a column slice (row stride > width, as SwiGLU's output in gate_up) and x updated in
    place: the GEMM's beta = 1."""
    layer, ref = make_linear(48, 32, bias, seed=3)
    p = packed(layer, mkl)
    wide = torch.randn(70, 2 * 48)
    h = wide[:, :48]
    x = torch.randn(70, 32)
    expected = x + F.linear(h, ref.weight, ref.bias)
    got = p.add_(x, h)
    assert got.data_ptr() == x.data_ptr()
    torch.testing.assert_close(got, expected)


def test_non_unit_strides_are_copied_first(mkl: packed_linear.Mkl) -> None:
    layer, ref = make_linear(16, 24, False, seed=4)
    p = packed(layer, mkl)
    h = torch.randn(16, 10).t()  # [10, 16], column-major
    x = torch.randn(24, 10).t()  # [10, 24], column-major: no in-place GEMM into it
    torch.testing.assert_close(p(h), F.linear(h, ref.weight))
    expected = x + F.linear(h, ref.weight)
    torch.testing.assert_close(p.add_(x, h), expected)


@pytest.mark.parametrize("bias", [False, True])
def test_plain_linear(bias: bool) -> None:
    layer, ref = make_linear(20, 12, bias, seed=5)  # never packed
    h, x = torch.randn(9, 20), torch.randn(9, 12)
    torch.testing.assert_close(layer(h), F.linear(h, ref.weight, ref.bias))
    expected = x + F.linear(h, ref.weight, ref.bias)
    torch.testing.assert_close(layer.add_(x, h), expected)


def test_no_packing_off_cpu_fp32() -> None:
    assert packed_linear.for_dtype(torch.device("meta"), torch.float32) is None
    assert packed_linear.for_dtype(CPU, torch.bfloat16) is None
    model = nn.Sequential(Linear(8, 8))
    assert pack_linears_(model, None) == 0 and isinstance(model[0], Linear)


def test_disabled_by_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATCHGEN_PACK_WEIGHTS", "0")
    fresh_lookup(monkeypatch)
    assert packed_linear.for_dtype(CPU, torch.float32) is None


def test_missing_library_falls_back(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """A torch without MKL's packed GEMM (other platforms): nothing is packed."""
    fresh_lookup(monkeypatch)
    fake = tmp_path / "torch" / "__init__.py"
    fake.parent.mkdir()
    monkeypatch.setattr(packed_linear.torch, "__file__", str(fake))
    assert packed_linear.for_dtype(CPU, torch.float32) is None


def test_model_weights_are_packed(mkl: packed_linear.Mkl, tmp_path) -> None:
    """load_model packs every projection and the LM head, tied to the embedding or not."""
    from batchgen.model.attention import TorchAttention
    from batchgen.model.loader import load_model
    from batchgen.tiny_model import make_tiny_model

    for tied in (False, True):
        folder = tmp_path / f"tied-{tied}"
        make_tiny_model(folder, tie_word_embeddings=tied)
        model, _ = load_model(folder, CPU, torch.float32, TorchAttention())
        assert not [m for m in model.modules() if isinstance(m, nn.Linear)]
        packs = [m for m in model.modules() if isinstance(m, PackedLinear)]
        assert len(packs) == 4 * model.cfg.num_layers + 1
        assert model.embed_tokens.weight is not None
        if tied:  # the head is a packed copy of the embedding
            hidden = torch.randn(3, model.cfg.hidden_size)
            expected = F.linear(hidden, model.embed_tokens.weight)
            torch.testing.assert_close(model.compute_logits(hidden), expected)
