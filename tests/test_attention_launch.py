"""How paged attention is launched: mixed steps launch their decodes apart (decode
configuration, split-K) from their prefills, and an engine run compiles a bounded number of
variants (per-step integers are not specialised, split counts are bucketed)."""

from __future__ import annotations

import pytest

from batchgen.engine.request import SamplingParams
from batchgen.kernels.reference import paged_attention_ref
from tests.devices import GPU_SESSION
from tests.test_engine import generate, make_engine, random_prompts
from tests.test_kernels import BF16, F32, AttnCase, assert_attention_close, build_inputs

pytestmark = pytest.mark.kernel


def recorded_launches(kernel) -> list[dict]:
    """Install a pre-run hook on ``kernel``; the returned list gets each launch's keywords."""
    launches: list[dict] = []
    kernel.add_pre_run_hook(lambda *args, **kwargs: launches.append(kwargs))
    return launches


@pytest.mark.parametrize(
    "case",
    [
        AttnCase(((1, 600), (1, 37), (1, 16), (17, 37), (5, 5)), 8, 2, 64, F32, num_splits=None),
        AttnCase(((1, 70), (1, 9), (9, 40)), 7, 1, 64, BF16, num_splits=None, share=True),
        AttnCase(((1, 70), (1, 9), (9, 40)), 8, 2, 64, F32, num_splits=2, share=True),
    ],
    ids=str,
)
def test_mixed_step_launches_decodes_apart(case: AttnCase) -> None:
    from batchgen.kernels import attention

    inputs = build_inputs(case, seed=5)
    nd = sum(q == 1 for q, _ in case.seqs)
    expected = paged_attention_ref(*inputs.args())
    launches = recorded_launches(attention._paged_attention_kernel)
    try:
        actual = attention.paged_attention(
            *inputs.args(), num_splits=case.num_splits, num_decode_seqs=nd
        )
    finally:
        attention._paged_attention_kernel.pre_run_hooks.clear()
    assert_attention_close(actual, expected)
    group = case.num_heads // case.num_kv_heads
    decode_m = max(16, 1 << (group - 1).bit_length())
    assert [k["BLOCK_M"] for k in launches][0] == decode_m  # decode rows: G rows, not 64+
    assert len(launches) == 2 and launches[1]["BLOCK_M"] >= 64
    if case.num_splits is None:  # the decodes split as a decode-only step would; prefills don't
        sm = attention._device_sm_count(inputs.q.device)
        want = attention.choose_num_splits(nd, case.num_kv_heads, 1, inputs.max_seqlen_k, sm)
        assert launches[0]["NUM_SPLITS"] == want and launches[1]["NUM_SPLITS"] == 1
        assert want > 1 or inputs.max_seqlen_k < 512


@pytest.mark.skipif(GPU_SESSION, reason="counts what the interpreter would have compiled")
def test_engine_run_compiles_few_variants(tiny_model) -> None:
    """An engine run with prompts of many lengths (steps with 1..8 sequences, block tables of
    many widths, decode-only and mixed steps) compiles what a warm-up would: per-step integers
    are not specialised, split counts come from a few buckets."""
    from batchgen.kernels import attention
    from tests.triton_variants import VariantCounter

    engine = make_engine(
        tiny_model("llama", num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16),
        backend="triton",
        max_num_batched_tokens=24,
    )
    prompts = random_prompts([1, 2, 3, 5, 8, 13, 17, 21, 30, 33], seed=3)
    kernels = (attention._paged_attention_kernel, attention._merge_splits_kernel)
    with VariantCounter(*kernels) as counter:
        generate(engine, prompts, SamplingParams(temperature=0.0, max_tokens=12))
    steps = engine.stats.steps
    # fp32, contexts under 512 keys (no split-K): exactly the decode (BLOCK_M 16) and the
    # prefill <= 64 (BLOCK_M 64) configurations. Specialising the sequence count, the table
    # width or the alignment of a mixed step's offset views made 6 of them here.
    assert steps > 20
    assert counter.count(attention._paged_attention_kernel) == 2, counter.keys
    assert counter.count(attention._merge_splits_kernel) == 0


def test_per_step_integers_are_not_specialised() -> None:
    """Two launches that differ only in the sequence count (1, which Triton would otherwise make
    a constant, vs 2) and the block-table width (5 vs 19) are one variant."""
    if GPU_SESSION:
        pytest.skip("the interpreter's launches are what is counted")
    from batchgen.kernels import attention
    from tests.triton_variants import VariantCounter

    with VariantCounter(attention._paged_attention_kernel) as counter:
        for seqs in (((1, 40),), ((1, 40), (1, 270))):
            inputs = build_inputs(AttnCase(seqs, 4, 2, 64, F32), spare_blocks=1)
            attention.paged_attention(*inputs.args(), num_splits=1)
    assert counter.count(attention._paged_attention_kernel) == 1, counter.keys


@pytest.mark.skipif(GPU_SESSION, reason="counts what the interpreter would have compiled")
def test_warm_up_compiles_what_an_engine_run_launches(tiny_model) -> None:
    """Every variant an engine run launches (prefill steps over and under 64 query tokens,
    mixed and decode-only steps) was already compiled by the engine's warm-up, which also
    compiles each split-K bucket and its merge."""
    from batchgen.kernels import attention
    from tests.triton_variants import VariantCounter

    engine = make_engine(
        tiny_model("llama", num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16),
        backend="triton",
        max_num_batched_tokens=80,
    )
    kernels = (attention._paged_attention_kernel, attention._merge_splits_kernel)
    with VariantCounter(*kernels) as warm:
        launches = engine.warm_up()
    with VariantCounter(*kernels) as run:
        prompts = random_prompts([70, 3, 9], seed=8)  # 70 tokens: a prefill over 64 queries
        generate(engine, prompts, SamplingParams(temperature=0.0, max_tokens=4))
    buckets = len(attention.split_buckets())
    assert launches == buckets + 2
    # fp32 prefills of any length share one configuration (bf16 has two)
    assert warm.count(attention._paged_attention_kernel) == buckets + 1
    assert warm.count(attention._merge_splits_kernel) == buckets - 1
    name = "batchgen.kernels.attention._paged_attention_kernel"
    assert len(run.keys[name]) == 2  # decode, prefill
    assert run.keys[name] <= warm.keys[name], "compiled mid-run"
