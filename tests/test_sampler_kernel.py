"""The Triton sampler kernels (batchgen.kernels.sampler) against the PyTorch formula: the noise
bit for bit, the race's tokens exactly (random logits have no near ties). Interpreted on the CPU,
compiled in a GPU session, where the engine also runs them."""

from __future__ import annotations

import pytest
import torch

from batchgen.engine.noise import TORCH_FORMULA, SamplerKernels, row_state, uniform_at
from batchgen.engine.sampler import _draw_plain, sample
from tests.devices import kernel_device
from tests.test_sampler import make_batch

pytestmark = pytest.mark.kernel
DEVICE = torch.device(kernel_device())


def kernels() -> SamplerKernels:
    from batchgen.kernels.sampler import race_draw, uniform_noise

    return SamplerKernels(uniform_noise=uniform_noise, race_draw=race_draw, device_type=DEVICE.type)


def keys_and_positions(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randint(0, 2**63 - 1, (n,), generator=gen, dtype=torch.int64)
    keys[0] = 0  # the extremes of the key range
    keys[-1] = 2**63 - 1
    positions = torch.randint(0, 100_000, (n,), generator=gen, dtype=torch.int64)
    return keys, positions


@pytest.mark.parametrize("shared_ids", [True, False])
def test_noise_is_bit_identical(shared_ids: bool) -> None:
    keys, pos = keys_and_positions(6, seed=1)
    width = 1500  # two tiles and a tail
    if shared_ids:
        ids = torch.arange(width, dtype=torch.int64)[None, :]
    else:
        ids = torch.randint(0, 200_000, (6, width), generator=torch.Generator().manual_seed(2))
    want = uniform_at(keys, pos, ids, TORCH_FORMULA)  # the formula, on the CPU
    state = row_state(keys, pos).to(DEVICE)
    got = kernels().uniform_noise(state, ids.to(DEVICE), width).cpu()
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert 0.0 < float(got.min()) and float(got.max()) < 1.0


def test_race_draws_the_formulas_tokens() -> None:
    keys, pos = keys_and_positions(8, seed=3)
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(8, 2500, generator=gen) * 3.0
    logits[1, 2400:] += 20.0  # a row whose mass sits in the last tile
    temperature = torch.tensor([0.3, 0.7, 1.0, 1.0, 1.5, 2.0, 0.9, 1.2])
    want = _draw_plain(logits, temperature, keys, pos, TORCH_FORMULA)
    got = kernels().race_draw(
        logits.to(DEVICE), temperature.to(DEVICE), row_state(keys, pos).to(DEVICE)
    )
    assert got.cpu().tolist() == want.tolist()
    assert int(got[1]) >= 2400


def test_sample_with_the_kernels_matches_the_cpu_formula() -> None:
    """sample() on the kernel device with the kernels wired (plain, top-k, top-p and greedy rows
    mixed) gives the CPU formula's tokens."""
    from batchgen.engine.request import SamplingParams

    params = [
        SamplingParams(temperature=1.0, seed=1),
        SamplingParams(temperature=0.7, top_k=30, seed=2),
        SamplingParams(temperature=1.1, top_p=0.8, seed=3),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.3, min_p=0.05, seed=4),
    ]
    vocab = 1200
    logits = torch.randn(len(params), vocab, generator=torch.Generator().manual_seed(5)) * 2.5
    want = sample(logits, make_batch(params, vocab), logprobs=False).tokens
    got = sample(
        logits.to(DEVICE), make_batch(params, vocab, device=DEVICE.type), logprobs=False,
        kernels=kernels(),
    ).tokens  # fmt: skip
    assert got.cpu().tolist() == want.tolist()
