"""The mixture-of-experts Triton kernel (batchgen.kernels.fused_moe) against its PyTorch reference
(batchgen.kernels.reference.fused_moe_ref) and against the model's CPU path
(batchgen.model.layers.moe.FusedExperts), over many shapes; and the expert alignment it runs on.

In a CPU session the kernel runs under Triton's interpreter (tests/devices.py), so shapes are
small; in a GPU session (BATCHGEN_TEST_GPU=1) the same tests run compiled.
"""

from __future__ import annotations

import pytest
import torch

from batchgen.kernels import fused_moe
from batchgen.kernels.moe import align_by_expert
from batchgen.kernels.reference import fused_moe_ref
from tests.devices import kernel_device

pytestmark = pytest.mark.kernel
DEVICE = torch.device(kernel_device())
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
# (atol, rtol): fp32 IEEE dots; in half types the gate-up output is rounded before SwiGLU, so a
# one-ulp difference there (another fp32 summation order) moves an output by a few of its ulps:
# atol is relative to the output's largest magnitude
TOLERANCE = {F32: (1e-5, 1e-5), F16: (5e-3, 5e-3), BF16: (3e-2, 2e-2)}


def assert_moe_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    atol, rtol = TOLERANCE[dtype]
    scale = max(1.0, want.abs().max().item())
    torch.testing.assert_close(got.float(), want.float(), atol=atol * scale, rtol=rtol)


def weights(e: int, h: int, inter: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    w13 = 0.2 * torch.randn(e, 2 * inter, h, generator=gen)
    w2 = 0.2 * torch.randn(e, h, inter, generator=gen)
    return w13.to(DEVICE, dtype), w2.to(DEVICE, dtype)


def random_ids(t: int, e: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """k distinct experts per token (as a top-k gives), drawn at random."""
    return torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])


# (T, E, k, H, I, dtype, explicit ids or None)
CASES = [
    (1, 4, 2, 64, 32, F32, None),  # a batch of one
    (2, 8, 2, 64, 32, F32, [[5, 1], [1, 5]]),  # 6 of 8 experts get no token
    (3, 8, 2, 32, 16, F32, [[3, 6], [3, 6], [3, 6]]),  # every token with the same experts
    (5, 6, 3, 48, 24, F32, None),  # H and I not multiples of the tiles
    (9, 4, 1, 64, 40, BF16, None),  # top-1
    (20, 8, 2, 64, 32, BF16, None),  # experts with more than one row tile's worth? (16 rows)
    (7, 16, 4, 80, 48, F16, None),
    (40, 2, 2, 32, 16, F32, None),  # 40 pairs per expert: several row tiles per expert
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{c[0]}-E{c[1]}-k{c[2]}-{c[5]}")
def test_fused_moe_matches_reference(case) -> None:
    t, e, k, h, inter, dtype, given = case
    gen = torch.Generator().manual_seed(t * 31 + e)
    w13, w2 = weights(e, h, inter, dtype, seed=t)
    x = torch.randn(t, h, generator=gen).to(DEVICE, dtype)
    ids = torch.tensor(given) if given is not None else random_ids(t, e, k, gen)
    ids = ids.to(DEVICE)
    got = fused_moe(x, w13, w2, ids)
    want = fused_moe_ref(x, w13, w2, ids)
    assert got.shape == (t * k, h) and got.dtype == dtype
    assert_moe_close(got, want, dtype)


def test_fused_moe_strided_input_and_empty_step() -> None:
    gen = torch.Generator().manual_seed(4)
    w13, w2 = weights(4, 32, 16, F32, seed=4)
    wide = torch.randn(6, 64, generator=gen).to(DEVICE)
    x = wide[:, ::2]  # [6, 32], row stride 64, column stride 2
    ids = random_ids(6, 4, 2, gen).to(DEVICE)
    torch.testing.assert_close(
        fused_moe(x, w13, w2, ids), fused_moe_ref(x, w13, w2, ids), atol=1e-5, rtol=1e-5
    )
    empty = fused_moe(x[:0], w13, w2, ids[:0])
    assert empty.shape == (0, 32)
    with pytest.raises(ValueError, match="shapes disagree"):
        fused_moe(x, w13, w2[:, :, :8], ids)


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
def test_model_experts_on_the_kernel_match_the_cpu_path(dtype: torch.dtype) -> None:
    """The model's FusedExperts with its CUDA path (the kernel, then the combine) against the
    same module's CPU path (torch GEMMs per expert) on the same routing."""
    from batchgen.model.layers.backend import LayerBackend
    from batchgen.model.layers.moe import FusedExperts, route

    gen = torch.Generator().manual_seed(8)
    e, h, inter, t, k = 8, 64, 32, 12, 2
    w13, w2 = weights(e, h, inter, dtype, seed=8)
    x = torch.randn(t, h, generator=gen).to(dtype)
    w, ids = route(torch.randn(t, e, generator=gen), k, renormalize=True)

    def experts(device: torch.device, use_triton: bool) -> FusedExperts:
        with torch.device("meta"):
            module = FusedExperts(e, h, inter, LayerBackend.select(device, dtype, False))
        module.gate_up_proj = torch.nn.Parameter(w13.to(device), requires_grad=False)
        module.down_proj = torch.nn.Parameter(w2.to(device), requires_grad=False)
        module.use_triton = use_triton  # on CUDA it is already; interpreted here
        return module

    with torch.no_grad():
        want = experts(torch.device("cpu"), False)(x, w, ids)
        got = experts(DEVICE, True)(x.to(DEVICE), w.to(DEVICE), ids.to(DEVICE)).cpu()
    assert got.dtype == torch.float32
    assert_moe_close(got, want, dtype)


@pytest.mark.parametrize("block_m", [1, 4, 16])
def test_align_by_expert(block_m: int) -> None:
    """Every pair exactly once; each tile holds one expert's pairs in token order, then padding;
    tiles past the last expert's run are marked with num_experts."""
    gen = torch.Generator().manual_seed(block_m)
    e, t, k = 6, 11, 2
    ids = random_ids(t, e, k, gen)
    ids[:, 0] = 2  # expert 2 gets every token; some experts likely none
    pairs, tile_expert = align_by_expert(ids, e, block_m)
    p = t * k
    assert pairs.shape == (tile_expert.shape[0] * block_m,)
    real = pairs[pairs < p]
    assert sorted(real.tolist()) == list(range(p))
    flat = ids.reshape(-1)
    last = -1
    for tile, expert in enumerate(tile_expert.tolist()):
        rows = pairs[tile * block_m : (tile + 1) * block_m].tolist()
        members = [r for r in rows if r < p]
        if expert == e:
            assert not members
            continue
        assert expert >= last
        last = expert
        assert members and all(int(flat[r]) == expert for r in members)
        assert members == sorted(members) and rows[: len(members)] == members
