"""Sampler: every parameter's effect, the law of the draw, determinism and batch invariance."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys

import pytest
import torch

from batchgen.engine.noise import SamplerKernels, _mix64, rng_key, uniform_at, uniform_noise
from batchgen.engine.request import SamplingParams
from batchgen.engine.sampler import SamplingBatch, apply_penalties, sample
from tests.optional import require

GREEDY = SamplingParams(temperature=0.0)
PLAIN = SamplingParams(temperature=1.0)


def make_batch(
    params: list[SamplingParams],
    vocab_size: int,
    keys: list[int] | None = None,
    positions: list[int] | None = None,
    prompts: list[list[int]] | None = None,
    outputs: list[list[int]] | None = None,
    device: str = "cpu",
) -> SamplingBatch:
    n = len(params)
    return SamplingBatch.from_rows(
        params,
        rng_keys=keys if keys is not None else [rng_key(0, i, 0) for i in range(n)],
        positions=positions if positions is not None else [0] * n,
        prompt_ids=prompts if prompts is not None else [[] for _ in range(n)],
        output_ids=outputs if outputs is not None else [[] for _ in range(n)],
        vocab_size=vocab_size,
        device=device,
    )


@pytest.mark.parametrize(
    "settings",
    [
        dict(temperature=0.0),
        dict(temperature=0.7),
        dict(temperature=0.9, top_k=5, top_p=0.8, min_p=0.05),
        dict(temperature=1.0, top_p=0.5, repetition_penalty=1.2, frequency_penalty=0.3),
    ],
)
def test_one_shared_params_object_packs_like_equal_copies(settings: dict) -> None:
    """from_rows reads a setting once when every row holds the same SamplingParams object: the
    batch is the same as from equal copies, one per row (read row by row)."""
    shared = SamplingParams(**settings)
    copies = [SamplingParams(**settings) for _ in range(5)]
    got, want = make_batch([shared] * 5, 50), make_batch(copies, 50)
    for name, value in vars(want).items():
        other = getattr(got, name)
        if isinstance(value, torch.Tensor):
            assert isinstance(other, torch.Tensor) and torch.equal(other, value), name
        else:
            assert other == value, name


def draw_many(
    logits_row: torch.Tensor, params: SamplingParams, n: int = 20_000, seed: int = 0
) -> torch.Tensor:
    """Draw ``n`` tokens from one logit row: 100 sample keys x n/100 positions."""
    keys = [rng_key(seed, f"row{i % 100}", 0) for i in range(n)]
    positions = [i // 100 for i in range(n)]
    batch = make_batch([params] * n, logits_row.shape[0], keys=keys, positions=positions)
    return sample(logits_row.expand(n, -1).contiguous(), batch).tokens


def empirical(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab_size).double() / tokens.numel()


def chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's statistic over the tokens with positive expected count (others must be 0)."""
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    expected = probs.double() * tokens.numel()
    assert counts[expected == 0].sum() == 0, "drew a token of probability 0"
    support = expected > 0
    return float((((counts - expected) ** 2) / expected)[support].sum())


# Upper 0.999 quantiles of chi-square with df degrees of freedom (df -> value).
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 15: 37.70}


def crafted_logits(vocab_size: int = 16, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(vocab_size, generator=g) * 1.5  # [V]


# ------------------------------------------------------------------------------------------------
# Keys and noise
# ------------------------------------------------------------------------------------------------


def test_rng_key_is_pinned_and_typed() -> None:
    # Pinned: a change here changes every seeded output ever produced.
    assert rng_key(1234, "row-42", 3) == 5776120875047302529
    assert rng_key(0, 7, 0) == 6946176116833143605
    assert rng_key(0, 7, 0) != rng_key(0, "7", 0)
    assert rng_key(0, 7, 0) != rng_key(1, 7, 0) != rng_key(0, 7, 1)
    assert all(0 <= rng_key(s, i, k) < 2**63 for s in range(3) for i in range(20) for k in range(3))
    with pytest.raises(TypeError):
        rng_key(0, 1.5, 0)  # type: ignore[arg-type]


def test_rng_key_independent_of_hash_seed() -> None:
    # rng_key's own source, run in fresh interpreters with different string-hash salts (without
    # importing torch, to keep this fast).
    from batchgen.engine import noise

    code = "\n".join(
        [
            "from __future__ import annotations",
            "import hashlib, json, operator",
            f"_KEY_DOMAIN = {noise._KEY_DOMAIN!r}",
            f"_MASK63 = {noise._MASK63}",
            inspect.getsource(noise.rng_key),
            "print(rng_key(1234, 'row-42', 3))",
        ]
    )
    for hash_seed in ("0", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        assert int(out.stdout) == 5776120875047302529


def _ref_mix64(z: int) -> int:
    """splitmix64's output function on Python ints (unsigned 64-bit reference)."""
    m = (1 << 64) - 1
    z &= m
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    return z ^ (z >> 31)


def test_mix64_matches_unsigned_reference() -> None:
    # The first output of splitmix64 seeded with 0 is a published value.
    assert _ref_mix64(0x9E3779B97F4A7C15) == 0xE220A8397B1DCDAF
    g = torch.Generator().manual_seed(0)
    xs = torch.randint(-(2**63), 2**63 - 1, (1000,), dtype=torch.int64, generator=g)
    xs = torch.cat([xs, torch.tensor([0, -1, 2**63 - 1, -(2**63), 0x9E3779B97F4A7C15 - 2**64])])
    got = _mix64(xs).tolist()
    want = [_ref_mix64(x) for x in xs.tolist()]
    assert [v & ((1 << 64) - 1) for v in got] == want


def test_uniform_noise_range_determinism_and_independence() -> None:
    keys = torch.tensor([rng_key(0, i, 0) for i in range(64)])
    pos = torch.arange(64) * 3
    u = uniform_noise(keys, pos, 1000)  # [64, 1000]
    assert u.shape == (64, 1000) and u.dtype == torch.float32
    assert bool(((u > 0) & (u < 1)).all())
    assert torch.equal(u, uniform_noise(keys.clone(), pos.clone(), 1000))
    # Roughly uniform: mean, and 10 equal bins.
    assert abs(float(u.double().mean()) - 0.5) < 0.005
    bins = torch.histc(u.double(), bins=10, min=0, max=1) / u.numel()
    assert float((bins - 0.1).abs().max()) < 0.005
    # Each row depends only on its own (key, position): alone == inside the batch.
    assert torch.equal(uniform_noise(keys[5:6], pos[5:6], 1000), u[5:6])
    # Different keys, or positions, give unrelated rows.
    same_key_next_pos = uniform_noise(keys[:1], pos[:1] + 1, 1000)
    assert not torch.equal(u[0], same_key_next_pos[0])
    assert abs(float(torch.corrcoef(torch.stack([u[0], u[1]]))[0, 1])) < 0.15
    # Noise hashed at a permutation of the ids equals the permuted full noise.
    perm = torch.randperm(1000, generator=torch.Generator().manual_seed(3))
    ids = perm.expand(64, -1)
    assert torch.equal(uniform_at(keys, pos, ids), u.gather(1, ids))


# ------------------------------------------------------------------------------------------------
# Each parameter's effect
# ------------------------------------------------------------------------------------------------


def test_greedy_is_first_argmax() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=g)
    logits[2, 7] = logits[2, 30] = 10.0  # a tie: the lower id wins
    out = sample(logits, make_batch([GREEDY] * 6, 50))
    assert torch.equal(out.tokens, logits.argmax(-1))
    assert int(out.tokens[2]) == 7


def test_top_k_1_is_greedy_and_top_k_bounds_the_support() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(200, 64, generator=g)
    batch = make_batch([SamplingParams(top_k=1)] * 200, 64, positions=list(range(200)))
    assert torch.equal(sample(logits, batch).tokens, logits.argmax(-1))

    row = crafted_logits(64)
    tokens = draw_many(row, SamplingParams(top_k=5, temperature=1.5), n=5000)
    top5 = set(row.topk(5).indices.tolist())
    assert set(tokens.tolist()) == top5


def test_temperature_spreads_the_distribution() -> None:
    row = crafted_logits(16)

    def entropy(t: torch.Tensor) -> float:
        p = empirical(t, 16)
        p = p[p > 0]
        return float(-(p * p.log()).sum())

    cold, warm, hot = (draw_many(row, SamplingParams(temperature=t), n=5000) for t in (0.3, 1, 3))
    assert entropy(cold) < entropy(warm) < entropy(hot)
    # Cold concentrates on the argmax.
    assert empirical(cold, 16)[row.argmax()] > empirical(warm, 16)[row.argmax()]


def test_top_p_small_keeps_only_the_top_token_and_top_p_cuts_the_tail() -> None:
    row = crafted_logits(16)
    tokens = draw_many(row, SamplingParams(top_p=1e-6), n=2000)
    assert set(tokens.tolist()) == {int(row.argmax())}

    row = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()
    # 0.4 < 0.5, 0.4 + 0.3 >= 0.5: the nucleus is {0, 1}.
    tokens = draw_many(row, SamplingParams(top_p=0.5), n=4000)
    assert set(tokens.tolist()) == {0, 1}
    assert chi_square(tokens, torch.tensor([4 / 7, 3 / 7, 0, 0])) < CHI2_999[1]


def test_ties_break_by_lowest_id() -> None:
    row = torch.tensor([0.0, 3.0, 1.0, 3.0, 3.0, 2.0])
    assert set(draw_many(row, SamplingParams(top_k=1), n=500).tolist()) == {1}
    assert set(draw_many(row, SamplingParams(top_k=2), n=2000).tolist()) == {1, 3}


def reference_kept(row: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The kept set by a full stable sort (probability descending, vocab id ascending on ties):
    top-k, then top-p over what top-k kept, then min-p. ``[V]`` bool."""
    p = torch.softmax(row / params.temperature, -1)
    order = p.sort(descending=True, stable=True).indices
    sp = p[order]
    keep = torch.ones(row.numel(), dtype=torch.bool)
    if params.top_k:
        keep[params.top_k :] = False
    sp = torch.where(keep, sp, 0)
    if params.top_p < 1:
        cum = sp.cumsum(0)
        mass = cum[-1] if params.top_k else 1.0
        keep &= torch.cat([torch.zeros(1), cum[:-1]]) < params.top_p * mass
    keep &= sp >= params.min_p * sp[0]
    kept = torch.zeros_like(keep)
    kept[order[keep]] = True
    return kept


def kept_by_sampler(row: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The tokens the sampler keeps, read off its draw: row t of a ``[V, V]`` batch (every row
    the same logits) gets noise that makes token t win the race ``argmax p_i / E_i`` whenever it
    survives the filters (``E_t`` about 1e-30, every other ``E_i = ln 2``); a token that does not
    survive has ``p_t = 0`` and never wins. So token t is drawn in row t iff it is kept. ``[V]``
    bool."""
    vocab = row.numel()

    def one_winner_per_row(state: torch.Tensor, ids: torch.Tensor, k: int) -> torch.Tensor:
        rows = torch.arange(state.shape[0])[:, None]  # [S, 1]: row t favours token t
        return torch.where(ids == rows, 1e-30, 0.5).float()  # [S, k] uniforms

    kernels = SamplerKernels(uniform_noise=one_winner_per_row)
    batch = make_batch([params] * vocab, vocab)
    tokens = sample(row.expand(vocab, -1).contiguous(), batch, kernels=kernels).tokens
    return tokens == torch.arange(vocab)


def tie_cuts(row: torch.Tensor, temperature: float) -> tuple[int, float]:
    """A top-k and a top-p that cut through a group of tied tokens (equal bf16 logits), so that
    only the vocab-id order decides which of them are kept."""
    p = torch.softmax(row / temperature, -1)
    sp, _ = p.sort(descending=True, stable=True)
    cum = torch.cat([torch.zeros(1), sp.cumsum(0)])  # mass before each rank
    ties = [i for i in range(3, row.numel() - 1) if sp[i] == sp[i + 1] and sp[i] > 1e-4]
    assert len(ties) >= 2, "the row has no ties to cut"
    k = ties[0] + 1  # keeps rank ties[0], drops its twin ties[0] + 1
    j = ties[-1]  # top-p keeps rank j (mass before it < top_p) but not j + 1
    return k, float((cum[j] + cum[j + 1]) / 2)


def test_filters_keep_exactly_the_reference_set() -> None:
    """Kept sets equal a full-sort reference on a 500-token vocabulary, exactly, with ties (bf16
    logits): top-k and top-p cuts through tied tokens keep the lower vocab ids."""
    g = torch.Generator().manual_seed(0)  # any seed must pass
    cases = [
        SamplingParams(temperature=1.5, top_p=0.8),
        SamplingParams(temperature=0.7, top_k=40, top_p=0.6),
        SamplingParams(temperature=1.0, min_p=0.02),
        SamplingParams(temperature=2.0, top_p=0.95, min_p=0.01),
        SamplingParams(temperature=1.0, top_k=7),
    ]
    rows = [(torch.randn(500, generator=g) * 2).bfloat16().float() for _ in cases]  # many ties
    row = rows[0]
    k, top_p = tie_cuts(row, 1.0)
    cases += [
        SamplingParams(temperature=1.0, top_k=k),
        SamplingParams(temperature=1.0, top_p=top_p),
    ]
    rows += [row, row]
    for row, params in zip(rows, cases, strict=True):
        want = reference_kept(row, params)
        assert 0 < int(want.sum()) < 500, params  # the filter cuts somewhere
        got = kept_by_sampler(row, params)
        assert torch.equal(got, want), (params, got.nonzero().flatten(), want.nonzero().flatten())


def test_min_p_filters() -> None:
    row = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    tokens = draw_many(row, SamplingParams(min_p=0.2), n=4000)  # threshold 0.1: drops token 3
    assert set(tokens.tolist()) == {0, 1, 2}
    assert chi_square(tokens, torch.tensor([0.5, 0.3, 0.15, 0]) / 0.95) < CHI2_999[2]


def test_repetition_penalty_over_prompt_and_output() -> None:
    logits = torch.tensor([[2.0, 1.9, 0.0], [-1.0, -1.1, -5.0], [2.0, 1.9, 0.0]])
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.2)] * 3
    # Row 0: token 0 in the prompt (2.0 / 1.2 < 1.9). Row 1: negative logit is multiplied
    # (-1.2 < -1.1). Row 2: token 0 in the output counts too.
    batch = make_batch(params, 3, prompts=[[0], [0, 2], [2]], outputs=[[], [], [0]])
    assert sample(logits, batch).tokens.tolist() == [1, 1, 1]
    penalised = apply_penalties(logits, batch)
    assert torch.allclose(penalised[0], torch.tensor([2.0 / 1.2, 1.9, 0.0]))
    assert torch.allclose(penalised[1], torch.tensor([-1.2, -1.1, -6.0]))
    # Without the penalty the top token wins.
    assert sample(logits, make_batch([GREEDY] * 3, 3)).tokens.tolist() == [0, 0, 0]


def test_presence_and_frequency_penalties_over_output_only() -> None:
    logits = torch.tensor([[2.0, 1.9, 0.0], [2.0, 1.9, 0.0], [2.0, 2.5, 1.0]])
    presence = SamplingParams(temperature=0.0, presence_penalty=0.5)
    frequency = SamplingParams(temperature=0.0, frequency_penalty=0.3)
    batch = make_batch(
        [presence, presence, frequency],
        3,
        prompts=[[1], [0, 0], [2]],  # prompts do not count for presence/frequency
        outputs=[[0, 0], [], [0, 1, 1, 1]],
    )
    penalised = apply_penalties(logits, batch)
    assert torch.allclose(penalised[0], torch.tensor([1.5, 1.9, 0.0]))  # presence: once, not x2
    assert torch.equal(penalised[1], logits[1])  # token 0 only in the prompt: unchanged
    assert torch.allclose(penalised[2], torch.tensor([1.7, 1.6, 1.0]))  # frequency: x count
    assert sample(logits, batch).tokens.tolist() == [1, 0, 0]


def test_neutral_penalty_rows_are_bit_identical() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 100, generator=g)
    batch = make_batch(
        [PLAIN, SamplingParams(repetition_penalty=1.3, frequency_penalty=0.2)],
        100,
        prompts=[list(range(50)), list(range(50))],
        outputs=[[1, 2, 3], [1, 2, 3]],
    )
    assert torch.equal(apply_penalties(logits, batch)[0], logits[0])


# ------------------------------------------------------------------------------------------------
# The law of the draw
# ------------------------------------------------------------------------------------------------


def test_empirical_distribution_matches_softmax() -> None:
    row = crafted_logits(16)
    tokens = draw_many(row, PLAIN, n=20_000)
    probs = torch.softmax(row.double(), -1)
    assert chi_square(tokens, probs) < CHI2_999[15]
    assert float((empirical(tokens, 16) - probs).abs().max()) < 0.015


def test_empirical_distribution_with_temperature_and_filters() -> None:
    row = crafted_logits(16, seed=2)
    params = SamplingParams(temperature=0.7, top_k=6, top_p=0.9, min_p=0.05)
    tokens = draw_many(row, params, n=20_000, seed=5)
    # The expected law, computed directly: top-6, then the 0.9 nucleus, then min-p, renormalised.
    p = torch.softmax(row.double() / 0.7, -1)
    order = p.argsort(descending=True)
    keep = torch.zeros(16, dtype=torch.bool)
    keep[order[:6]] = True
    p_k = torch.where(keep, p, 0) / p[keep].sum()
    mass = 0.0
    for i in order.tolist():
        if keep[i] and mass >= 0.9:
            keep[i] = False
        mass += float(p_k[i])
    keep &= p >= 0.05 * p.max()
    expected = torch.where(keep, p, 0)
    expected /= expected.sum()
    assert int(keep.sum()) >= 3  # the crafted row must exercise the filters, not collapse
    assert chi_square(tokens, expected) < 20.0  # df = support - 1 <= 5; 0.999 quantile 20.5


# ------------------------------------------------------------------------------------------------
# Determinism and batch invariance
# ------------------------------------------------------------------------------------------------


def test_seeded_determinism() -> None:
    row = crafted_logits(32).expand(50, -1).contiguous()
    params = [SamplingParams(temperature=1.0)] * 50

    def stream(key: int) -> list[int]:
        batch = make_batch(params, 32, keys=[key] * 50, positions=list(range(100, 150)))
        return sample(row, batch).tokens.tolist()

    a, b = rng_key(7, "x", 0), rng_key(7, "x", 1)
    assert stream(a) == stream(a)
    assert stream(a) != stream(b)
    # Same (key, position): the same token, whatever row it sits in.
    batch = make_batch(params[:2], 32, keys=[b, a], positions=[120, 120])
    assert sample(row[:2], batch).tokens.tolist()[1] == stream(a)[20]


TARGET_CONFIGS = {
    "greedy": SamplingParams(temperature=0.0),
    "greedy_penalised": SamplingParams(temperature=0.0, repetition_penalty=1.5),
    "plain": SamplingParams(temperature=0.8),
    "top_k": SamplingParams(temperature=1.2, top_k=20),
    "top_p": SamplingParams(top_p=0.7),
    "min_p": SamplingParams(min_p=0.1),
    "everything": SamplingParams(
        temperature=0.9,
        top_k=50,
        top_p=0.95,
        min_p=0.02,
        repetition_penalty=1.1,
        presence_penalty=0.3,
        frequency_penalty=0.2,
    ),
}

NEIGHBOURS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.5, top_k=3),
    SamplingParams(temperature=1.3, top_p=0.5, min_p=0.05),
    SamplingParams(temperature=0.0, frequency_penalty=1.0),
    SamplingParams(temperature=1.0, presence_penalty=-0.5, top_k=200),
    SamplingParams(temperature=2.0, repetition_penalty=0.8, min_p=0.3),
]


@pytest.mark.parametrize("name", list(TARGET_CONFIGS))
def test_batch_invariance(name: str) -> None:
    vocab = 1000  # not a multiple of the SIMD width: exercises vector tails
    target = TARGET_CONFIGS[name]
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, vocab, (int(n),), generator=g).tolist() for n in range(20, 28)]
    outputs = [torch.randint(0, vocab, (int(n),), generator=g).tolist() for n in range(5, 13)]
    for step in range(12):
        logits = torch.randn(8, vocab, generator=g) * 3  # [8, V]
        keys = [rng_key(3, i, 0) for i in range(8)]
        positions = [100 + step + i for i in range(8)]
        at = step % 8  # the target row's place in the batch
        params = NEIGHBOURS[:at] + [target] + NEIGHBOURS[at:]
        full = sample(logits, make_batch(params, vocab, keys, positions, prompts, outputs))
        alone = sample(
            logits[at : at + 1],
            make_batch([target], vocab, keys[at : at + 1], positions[at : at + 1],
                       prompts[at : at + 1], outputs[at : at + 1]),
        )  # fmt: skip
        assert int(alone.tokens[0]) == int(full.tokens[at]), (name, step)
        assert torch.equal(alone.logprobs[0], full.logprobs[at]), (name, step)


def test_logprobs_are_raw_log_softmax_at_the_token() -> None:
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(7, 300, generator=g) * 2
    params = list(TARGET_CONFIGS.values())
    prompts = [[1, 2, 3]] * 7
    outputs = [[4, 5, 5]] * 7
    out = sample(logits, make_batch(params, 300, prompts=prompts, outputs=outputs))
    want = torch.log_softmax(logits, -1).gather(1, out.tokens[:, None]).squeeze(1)
    assert out.logprobs.dtype == torch.float32
    assert torch.allclose(out.logprobs, want, atol=1e-6)
    assert bool((out.logprobs <= 0).all())


# ------------------------------------------------------------------------------------------------
# Building the batch
# ------------------------------------------------------------------------------------------------


def test_from_rows_flags_partitions_and_padding() -> None:
    params = [
        GREEDY,
        SamplingParams(top_k=5),
        PLAIN,
        SamplingParams(top_k=10_000, min_p=0.1),  # top_k >= V is off; min_p filters
        SamplingParams(temperature=0.0, top_p=0.5),  # greedy ignores top_p
        SamplingParams(presence_penalty=0.1),
    ]
    b = make_batch(params, 100, prompts=[[1]] * 6, outputs=[[], [1, 2], [], [3], [], [4, 4, 4]])
    assert (b.all_greedy, b.any_greedy) == (False, True)
    assert (b.any_top_k, b.any_top_p, b.any_min_p) == (True, False, True)
    assert (b.any_penalty, b.any_repetition, b.any_additive_penalty) == (True, False, True)
    assert b.random_rows is not None and b.random_rows.tolist() == [1, 2, 3, 5]
    assert b.filtered_rows is not None and b.filtered_rows.tolist() == [0, 2]
    assert b.plain_rows is not None and b.plain_rows.tolist() == [1, 3]
    assert b.candidate_width is None  # the min-p row's candidate count is data-dependent
    assert b.prompt_ids is None  # no repetition penalty: the prompt is not needed
    assert b.output_ids is not None
    assert b.output_ids.tolist() == [[100] * 3, [1, 2, 100], [100] * 3, [3, 100, 100],
                                     [100] * 3, [4, 4, 4]]  # fmt: skip
    assert b.temperature.dtype == torch.float32 and b.top_k.dtype == torch.int64

    b = make_batch([PLAIN, PLAIN], 100)
    assert b.random_rows is None and b.output_ids is None and not b.any_filtered and b.any_plain
    b = make_batch([SamplingParams(top_k=5), SamplingParams(top_k=7, top_p=0.9, min_p=0.1)], 100)
    assert b.candidate_width == 7 and b.filtered_rows is None and not b.any_plain
    b = make_batch([GREEDY, GREEDY], 100)
    assert b.all_greedy

    with pytest.raises(ValueError, match="penalties need"):
        SamplingBatch.from_rows([SamplingParams(repetition_penalty=1.1)], [1], [0], None, None, 100)


def test_mixed_greedy_and_random_rows() -> None:
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(4, 40, generator=g)
    params = [GREEDY, PLAIN, GREEDY, SamplingParams(top_k=1)]
    out = sample(logits, make_batch(params, 40))
    argmax = logits.argmax(-1)
    assert out.tokens[[0, 2, 3]].tolist() == argmax[[0, 2, 3]].tolist()


@pytest.mark.gpu
def test_cuda_matches_cpu() -> None:
    require("cuda")
    keys = torch.tensor([rng_key(0, i, 0) for i in range(64)])
    pos = torch.arange(64)
    assert torch.equal(
        uniform_noise(keys, pos, 4096), uniform_noise(keys.cuda(), pos.cuda(), 4096).cpu()
    )
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 4096, generator=g) * 3
    params = [TARGET_CONFIGS[k] for k in TARGET_CONFIGS] * 9 + [PLAIN]
    prompts = [[1, 2, 3]] * 64
    outputs = [[5, 6]] * 64
    cpu = sample(logits, make_batch(params, 4096, prompts=prompts, outputs=outputs))
    gpu = sample(
        logits.cuda(), make_batch(params, 4096, prompts=prompts, outputs=outputs, device="cuda")
    )
    # Softmax and log1p may differ in the last bit between devices: allow rare near-tie flips.
    assert (cpu.tokens == gpu.tokens.cpu()).float().mean() >= 0.95
    assert torch.allclose(cpu.logprobs, gpu.logprobs.cpu(), atol=1e-4)


def test_native_kernels_are_passed_in_and_the_module_imports_no_model_code() -> None:
    """sample() uses the kernels it is given (none by default: the PyTorch formula); the sampler
    module does not pick them itself from batchgen.model."""
    code = "import sys, batchgen.engine.sampler; print([m for m in sys.modules if 'model' in m])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "batchgen.model" not in out.stdout

    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 50, generator=gen) * 3
    calls = {"noise": 0, "race": 0}

    def constant_noise(state: torch.Tensor, ids: torch.Tensor, k: int) -> torch.Tensor:
        calls["noise"] += 1
        return torch.full((state.shape[0], k), 0.5)  # equal noise: the race picks the top token

    def race_seven(logits: torch.Tensor, temperature: torch.Tensor, state: torch.Tensor):
        calls["race"] += 1
        return torch.full((logits.shape[0],), 7, dtype=torch.int64)

    kernels = SamplerKernels(uniform_noise=constant_noise, race_draw=race_seven)
    plain = make_batch([PLAIN] * 6, 50)
    assert sample(logits, plain, kernels=kernels).tokens.tolist() == [7] * 6
    assert sample(logits, plain).tokens.tolist() != [7] * 6
    top_k = make_batch([SamplingParams(temperature=1.0, top_k=5)] * 6, 50)
    assert torch.equal(sample(logits, top_k, kernels=kernels).tokens, logits.argmax(dim=-1))
    assert calls == {"noise": 1, "race": 1}
