"""batchgen.model.packed_linear: MKL pre-packed weights against F.linear, and the fallbacks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from batchgen.model import packed_linear
from batchgen.model.packed_linear import linear, linear_add_, pack_

CPU = torch.device("cpu")
AVAILABLE = packed_linear.packing_available(CPU, torch.float32)
needs_mkl = pytest.mark.skipif(not AVAILABLE, reason="torch here exports no MKL packed GEMM")


def make_linear(n_in: int, n_out: int, bias: bool, seed: int) -> tuple[nn.Linear, nn.Linear]:
    """Two copies of one layer: the first to be packed, the second kept as the reference."""
    torch.manual_seed(seed)
    ref = nn.Linear(n_in, n_out, bias=bias).requires_grad_(False)
    packed = nn.Linear(n_in, n_out, bias=bias).requires_grad_(False)
    packed.load_state_dict(ref.state_dict())
    return packed, ref


@needs_mkl
@pytest.mark.parametrize("rows", [0, 1, 7, 64, 257])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_f_linear(rows: int, bias: bool) -> None:
    layer, ref = make_linear(96, 80, bias, seed=rows)
    assert pack_(layer) == 1
    assert layer.weight is None and layer.packed.out_features == 80
    h = torch.randn(rows, 96)
    torch.testing.assert_close(linear(h, layer), F.linear(h, ref.weight, ref.bias))


@needs_mkl
@pytest.mark.parametrize("bias", [False, True])
def test_linear_add_in_place_from_a_column_slice(bias: bool) -> None:
    """h a column slice (row stride > width, as SwiGLU's output in gate_up) and x updated in
    place: the GEMM's beta = 1."""
    layer, ref = make_linear(48, 32, bias, seed=3)
    pack_(layer)
    wide = torch.randn(70, 2 * 48)
    h = wide[:, :48]
    x = torch.randn(70, 32)
    expected = x + F.linear(h, ref.weight, ref.bias)
    got = linear_add_(x, h, layer)
    assert got.data_ptr() == x.data_ptr()
    torch.testing.assert_close(got, expected)


@needs_mkl
def test_non_unit_strides_are_copied_first() -> None:
    layer, ref = make_linear(16, 24, False, seed=4)
    pack_(layer)
    h = torch.randn(16, 10).t()  # [10, 16], column-major
    x = torch.randn(24, 10).t()  # [10, 24], column-major: no in-place GEMM into it
    torch.testing.assert_close(linear(h, layer), F.linear(h, ref.weight))
    expected = x + F.linear(h, ref.weight)
    torch.testing.assert_close(linear_add_(x, h, layer), expected)


@pytest.mark.parametrize("bias", [False, True])
def test_unpacked_modules_take_the_plain_path(bias: bool) -> None:
    layer, ref = make_linear(20, 12, bias, seed=5)  # never packed
    h, x = torch.randn(9, 20), torch.randn(9, 12)
    torch.testing.assert_close(linear(h, layer), F.linear(h, ref.weight, ref.bias))
    expected = x + F.linear(h, ref.weight, ref.bias)
    torch.testing.assert_close(linear_add_(x, h, layer), expected)


def test_no_packing_off_cpu_fp32() -> None:
    layer = nn.Linear(8, 8).to(torch.bfloat16)
    assert pack_(layer) == 0 and layer.weight is not None
    assert not packed_linear.packing_available(torch.device("meta"), torch.float32)


def test_disabled_by_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATCHGEN_PACK_WEIGHTS", "0")
    monkeypatch.setattr(packed_linear, "_tried", False)
    monkeypatch.setattr(packed_linear, "_mkl", None)
    assert not packed_linear.packing_available(CPU, torch.float32)
    layer = nn.Linear(8, 8)
    assert pack_(layer) == 0 and layer.weight is not None


def test_missing_library_falls_back(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """A torch without MKL's packed GEMM (other platforms): nothing is packed."""
    monkeypatch.setattr(packed_linear, "_tried", False)
    monkeypatch.setattr(packed_linear, "_mkl", None)
    fake = tmp_path / "torch" / "__init__.py"
    fake.parent.mkdir()
    monkeypatch.setattr(packed_linear.torch, "__file__", str(fake))
    assert not packed_linear.packing_available(CPU, torch.float32)


@needs_mkl
def test_model_weights_are_packed(tmp_path) -> None:
    """load_model packs every projection and the LM head, tied to the embedding or not."""
    from batchgen.model.attention import TorchAttention
    from batchgen.model.loader import load_model
    from batchgen.tiny_model import make_tiny_model

    for tied in (False, True):
        folder = tmp_path / f"tied-{tied}"
        make_tiny_model(folder, tie_word_embeddings=tied)
        model, _ = load_model(folder, CPU, torch.float32, TorchAttention())
        linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
        assert len(linears) == 4 * model.cfg.num_layers + 1
        assert all(m.weight is None and m.packed is not None for m in linears)
        assert model.embed_tokens.weight is not None
        if tied:  # the head is a packed copy of the embedding
            hidden = torch.randn(3, model.cfg.hidden_size)
            expected = F.linear(hidden, model.embed_tokens.weight)
            torch.testing.assert_close(model.compute_logits(hidden), expected)
