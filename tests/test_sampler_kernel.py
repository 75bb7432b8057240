"""The Triton sampler kernels (batchgen.kernels.sampler) against the PyTorch formula: the noise
bit for bit, the race's tokens exactly (random logits have no near ties). Interpreted on the CPU,
compiled in a GPU session, where the engine also runs them."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from batchgen.engine.noise import TORCH_FORMULA, SamplerKernels, row_state, uniform_at
from batchgen.engine.sampler import _draw_plain, sample
from tests.devices import GPU_SESSION, kernel_device
from tests.test_sampler import make_batch

pytestmark = pytest.mark.kernel
DEVICE = torch.device(kernel_device())


def kernels(filtered_draw: Callable[..., torch.Tensor] | None = None) -> SamplerKernels:
    from batchgen.kernels import sampler

    return SamplerKernels(
        uniform_noise=sampler.uniform_noise,
        race_draw=sampler.race_draw,
        filtered_draw=filtered_draw or sampler.filtered_draw,
        device_type=DEVICE.type,
    )


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
    mixed) gives the CPU formula's tokens, the filtered rows drawn by the filtered kernel."""
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
    from batchgen.kernels.sampler import filtered_draw

    calls: list[int] = []

    def counted(*args: torch.Tensor) -> torch.Tensor:
        calls.append(args[0].shape[0])
        return filtered_draw(*args)

    got = sample(
        logits.to(DEVICE), make_batch(params, vocab, device=DEVICE.type), logprobs=False,
        kernels=kernels(counted),
    ).tokens  # fmt: skip
    assert got.cpu().tolist() == want.tolist()
    assert calls == [3]  # one launch for the top-k, top-p and min-p rows


# ---------------------------------------------------------------------------------------------
# The filtered draw (top-k / top-p / min-p) against the PyTorch formula
# ---------------------------------------------------------------------------------------------

TINY = 1e-30  # tokens less probable never win a race: kept sets are compared above this
NEAR = 1e-5  # probabilities (relative) or masses (absolute) this close may be cut either way

# Rows every vocabulary tests, then random ones: (top_k, top_p, min_p, temperature, logits).
# Logits: "randn" (x3), "masked" (70% -inf, as a grammar leaves them), "one" (a single finite
# token), "ties" (rounded to integers: many equal values, which must be cut by vocab id).
SPECIAL_ROWS = [
    ("k1", 1.0, 0.0, 1.0, "randn"),  # top-k alone ("kN": k = N, "k/N": V // N, "kV+N": V + N)
    ("k2", 1.0, 0.0, 1.0, "randn"),
    ("k/3", 1.0, 0.0, 1.0, "randn"),
    ("kV-1", 1.0, 0.0, 1.0, "randn"),
    ("kV+0", 0.7, 0.0, 1.0, "randn"),  # top_k >= V is off
    ("kV+9", 1.0, 0.05, 1.0, "randn"),
    ("k0", 0.05, 0.0, 1.0, "randn"),  # top-p alone
    ("k0", 0.5, 0.0, 1.0, "randn"),
    ("k0", 0.95, 0.0, 1.0, "randn"),
    ("k0", 1.0, 0.0, 1.0, "randn"),  # nothing filters: the whole row
    ("k0", 1.0, 0.02, 1.0, "randn"),  # min-p alone
    ("k0", 1.0, 0.3, 1.0, "randn"),
    ("k0", 1.0, 1.0, 1.0, "randn"),
    ("k/4", 0.8, 0.0, 1.0, "randn"),  # combinations
    ("k/2", 0.9, 0.05, 1.0, "randn"),
    ("k0", 0.9, 0.02, 1.0, "randn"),
    ("k5", 1.0, 0.1, 1.0, "randn"),
    ("k/3", 0.7, 0.0, 0.02, "randn"),  # temperature extremes
    ("k0", 0.9, 0.0, 50.0, "randn"),
    ("k/2", 0.5, 0.01, 20.0, "randn"),
    ("kV-1", 0.95, 0.0, 1.0, "masked"),  # top-k past the finite tokens: cut among zeros
    ("k0", 0.9, 0.01, 1.0, "masked"),
    ("k3", 0.5, 0.0, 1.0, "one"),
    ("k/3", 1.0, 0.0, 1.0, "ties"),
    ("k0", 0.5, 0.0, 1.0, "ties"),
    ("k/2", 0.9, 0.0, 0.5, "ties"),
    ("k0", 1.0, 0.1, 1.0, "ties"),
]


def _top_k(spec: str, vocab: int) -> int:
    if spec.startswith("kV"):
        return vocab + int(spec[2:])
    if spec.startswith("k/"):
        return vocab // int(spec[2:])
    return int(spec[1:])


def filtered_rows(vocab: int, rows: int, seed: int) -> dict[str, torch.Tensor]:
    """The special rows, then random ones, as the kernel's [R] / [R, V] CPU inputs."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen) * 3.0
    temperature = 0.3 + 1.5 * torch.rand(rows, generator=gen)
    coin = torch.rand(4, rows, generator=gen)
    top_k = torch.where(coin[0] < 0.5, torch.randint(1, vocab + 3, (rows,), generator=gen), 0)
    top_p = torch.where(coin[1] < 0.5, 0.05 + 0.95 * torch.rand(rows, generator=gen), 1.0)
    min_p = torch.where(coin[2] < 0.3, 0.3 * torch.rand(rows, generator=gen), 0.0)
    masked = coin[3] < 0.2  # random rows with masked tokens, or with ties, too
    tied = coin[3] > 0.7
    assert rows > len(SPECIAL_ROWS)
    for r, (k, p, m, t, kind) in enumerate(SPECIAL_ROWS):
        top_k[r], top_p[r], min_p[r], temperature[r] = _top_k(k, vocab), p, m, t
        masked[r], tied[r] = kind == "masked", kind == "ties"
        if kind == "one":
            logits[r] = float("-inf")
            logits[r, vocab // 2] = 0.0
    logits[tied] = logits[tied].round()
    drop = torch.rand(rows, vocab, generator=gen) < 0.7
    drop[:, 0] = False  # a finite token in every row
    logits[masked[:, None] & drop] = float("-inf")
    keys, positions = keys_and_positions(rows, seed)
    return dict(logits=logits, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                keys=keys, positions=positions)  # fmt: skip


def formula_kept(rows: dict[str, torch.Tensor]) -> torch.Tensor:
    """The PyTorch formula's kept set, [R, V] bool (tokens of probability 0 left out)."""
    from batchgen.engine.sampler import _filtered_candidates

    logits = rows["logits"]
    scaled = logits / rows["temperature"][:, None]
    ids, cand_p = _filtered_candidates(
        scaled, rows["top_k"], rows["top_p"], rows["min_p"], True, True, True, None
    )
    return torch.zeros(logits.shape, dtype=torch.bool).scatter_(1, ids, cand_p > 0)


def formula_tokens(rows: dict[str, torch.Tensor]) -> torch.Tensor:
    """sample()'s tokens with the PyTorch formula (filtered rows and plain rows alike)."""
    from batchgen.engine.request import SamplingParams
    from batchgen.engine.sampler import SamplingBatch

    params = [
        SamplingParams(temperature=float(t), top_k=int(k), top_p=float(p), min_p=float(m))
        for t, k, p, m in zip(
            rows["temperature"], rows["top_k"], rows["top_p"], rows["min_p"], strict=True
        )
    ]
    batch = SamplingBatch.from_rows(
        params, rows["keys"].tolist(), rows["positions"].tolist(), None, None,
        rows["logits"].shape[1],
    )  # fmt: skip
    return sample(rows["logits"], batch, logprobs=False).tokens


def near_ties(rows: dict[str, torch.Tensor], kept: torch.Tensor) -> tuple[list[int], list[int]]:
    """Rows whose kept set float rounding may decide (a probability, a cumulative mass or the
    min-p threshold within NEAR of the cut), and rows whose race's two best are within NEAR.
    Exactly equal scaled logits are no near tie: both sides compute equal probabilities and
    must cut them by id."""
    from batchgen.engine.noise import TORCH_FORMULA, exponential_at

    logits, vocab = rows["logits"], rows["logits"].shape[1]
    scaled = logits / rows["temperature"][:, None]
    probs = torch.softmax(scaled, dim=-1)
    key = (probs.view(torch.int32).to(torch.int64) << 31) + (vocab - 1 - torch.arange(vocab))
    order = key.argsort(dim=-1, descending=True)  # (p desc, id asc)
    ids = torch.arange(vocab)[None, :]
    race = probs * kept / exponential_at(rows["keys"], rows["positions"], ids, TORCH_FORMULA)
    cut_ties, race_ties = [], []
    for r in range(logits.shape[0]):
        p, s = probs[r, order[r]].double(), scaled[r, order[r]]
        n = int((kept[r] & (probs[r] > TINY)).sum())  # the kept prefix (where it matters)
        near = n < vocab and p[n] > TINY and s[n - 1] != s[n] and p[n - 1] - p[n] <= NEAR * p[n - 1]
        top_k, top_p, min_p = (rows[name][r].item() for name in ("top_k", "top_p", "min_p"))
        if top_p < 1.0:
            head = p[:top_k] if 0 < top_k < vocab else p
            target = top_p * (float(head.sum()) if 0 < top_k < vocab else 1.0)
            before = head.cumsum(0) - head
            near |= bool(((before - target).abs() <= NEAR).any())
        if min_p > 0.0:  # (tokens at p_max are kept by both, even with min_p = 1)
            threshold = min_p * float(p[0])
            near |= bool(((p - threshold).abs() <= NEAR * threshold)[p != p[0]].any())
        if near:
            cut_ties.append(r)
        best = race[r].topk(2).values
        if best[0] - best[1] <= NEAR * best[0]:
            race_ties.append(r)
    return cut_ties, race_ties


def tie_cuts(rows: dict[str, torch.Tensor], kept: torch.Tensor) -> list[int]:
    """Rows whose kept set ends inside a run of equal scaled logits (cut by vocab id)."""
    logits, vocab = rows["logits"], rows["logits"].shape[1]
    scaled = logits / rows["temperature"][:, None]
    probs = torch.softmax(scaled, dim=-1)
    found = []
    for r in range(logits.shape[0]):
        n = int((kept[r] & (probs[r] > TINY)).sum())
        last, first_out = scaled[r][kept[r]].min(), scaled[r][~kept[r]].max() if n < vocab else None
        if first_out is not None and probs[r][~kept[r]].max() > TINY and last == first_out:
            found.append(r)
    return found


@pytest.mark.parametrize(("vocab", "num_rows"), [(37, 48), (300, 48), (1100, 40)])
def test_filtered_kept_set_and_tokens_match_the_formula(vocab: int, num_rows: int) -> None:
    """One launch per vocabulary: the kernel's kept set equals the formula's exactly and its
    tokens equal sample()'s, except in rows where float rounding decides (counted: rare)."""
    from batchgen.kernels.sampler import filtered_keep

    rows = filtered_rows(vocab, num_rows, seed=vocab)
    args = [rows[n].to(DEVICE) for n in ("logits", "temperature", "top_k", "top_p", "min_p")]
    state = row_state(rows["keys"], rows["positions"]).to(DEVICE)
    kept, tokens = filtered_keep(*args, state)
    kept, tokens = kept.cpu(), tokens.cpu()

    want_kept, want_tokens = formula_kept(rows), formula_tokens(rows)
    cut_ties, race_ties = near_ties(rows, want_kept)
    significant = torch.softmax(rows["logits"] / rows["temperature"][:, None], -1) > TINY
    compared = [r for r in range(num_rows) if r not in cut_ties]
    wrong_sets = [r for r in compared if not torch.equal(kept[r] & significant[r], want_kept[r])]
    drawn = [r for r in compared if r not in race_ties]
    wrong_tokens = [r for r in drawn if tokens[r] != want_tokens[r]]
    assert wrong_sets == [] and wrong_tokens == [], (wrong_sets, wrong_tokens)
    # near ties are rare, and the comparison is not vacuous
    assert len(cut_ties) <= num_rows // 10 and len(drawn) >= num_rows * 8 // 10, (
        cut_ties, race_ties,
    )  # fmt: skip
    sizes = want_kept[compared].sum(dim=-1)
    assert int((sizes == 1).sum()) >= 3 and int(((sizes > 1) & (sizes < vocab)).sum()) >= 10
    assert len(set(tie_cuts(rows, want_kept)) - set(cut_ties)) >= 2  # cuts through equal logits
    # every row (near ties included) draws a kept, finite token
    picked = tokens[:, None]
    assert bool(kept.gather(1, picked).all())
    assert bool(rows["logits"].gather(1, picked).isfinite().all())


def test_filtered_kernel_compiles_one_variant_for_any_batch() -> None:
    """sample()'s launches for steps of 1, 2, 3 and 6 filtered rows (settings at offsets of
    every alignment in the packed per-row tensors) are one compiled variant."""
    if GPU_SESSION:
        pytest.skip("the interpreter's launches are what is counted")
    from batchgen.engine.request import SamplingParams
    from batchgen.kernels import sampler as kernel_module
    from tests.triton_variants import VariantCounter

    vocab = 37
    with VariantCounter(kernel_module._filtered_draw_kernel) as counter:
        for rows in (1, 2, 3, 6):
            params = [SamplingParams(top_k=5, top_p=0.9, min_p=0.01)] * rows
            logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(rows))
            batch = make_batch(params, vocab, device=DEVICE.type)
            sample(logits.to(DEVICE), batch, logprobs=False, kernels=kernels())
    assert counter.count(kernel_module._filtered_draw_kernel) == 1, counter.keys


def test_filtered_kernel_cuts_ties_by_id() -> None:
    """Equal logits: the kept set is the smallest ids among the tied tokens, whichever filter
    cuts (top-k and top-p need the id search, min-p keeps every tie)."""
    from batchgen.kernels.sampler import filtered_keep

    vocab = 50
    logits = torch.zeros(4, vocab)
    logits[:, 10:30] = 1.0  # 20 tied tokens on top, 30 tied below
    top_k = torch.tensor([7, 0, 25, 0])
    top_p = torch.tensor([1.0, 0.3, 1.0, 1.0])
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.5])
    args = (logits, torch.ones(4), top_k, top_p, min_p, torch.arange(4))
    kept, tokens = filtered_keep(*(x.to(DEVICE) for x in args))
    p_top = float(torch.softmax(logits[0], -1)[10])
    n_top_p = int(torch.ceil(torch.tensor(0.3 / p_top)))  # tokens before the mass reaches 0.3
    want = torch.zeros(4, vocab, dtype=torch.bool)
    want[0, 10:17] = True
    want[1, 10 : 10 + n_top_p] = True
    want[2, 0:5] = want[2, 10:30] = True  # 20 on top, then the 5 smallest ids of the rest
    want[3, 10:30] = True  # p >= 0.5 p_max: the top 20, all of them
    assert kept.cpu().tolist() == want.tolist()
    assert torch.equal(kept.cpu(), formula_kept(dict(zip(
        ("logits", "temperature", "top_k", "top_p", "min_p"), args[:5], strict=True
    ))))  # fmt: skip
    assert all(bool(want[r, int(t)]) for r, t in enumerate(tokens.cpu()))
