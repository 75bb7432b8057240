"""The last layer at the rows that sample only (``forward(keep=...)``, docs/performance.md).

A prefill step samples one row per sequence (its last prompt token), so the model computes the
last layer's o_proj, MLP and residual at those rows only. What must hold:

- the kept rows' hidden states are those of the full forward: bit for bit on batchgen's own
  dense kernels (no GEMM row depends on how many rows there are), within float rounding on
  PyTorch's and in the experts' kernel (which sums each expert's rows in blocks of its own);
- every row's K/V is stored all the same (the next steps read it), also when no row is kept;
- the engine passes ``keep`` exactly on steps with rows to drop and no prompt scoring, and its
  tokens and logprobs are those it gives without ``keep``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from batchgen.engine import batch as batch_mod
from batchgen.engine.noise import rng_key
from batchgen.engine.request import Request, SampleTarget, SamplingParams
from batchgen.model.attention import AttentionMetadata, TorchAttention
from batchgen.model.loader import load_model
from batchgen.tiny_model import make_tiny_model
from tests.optional import require
from tests.test_engine import generate, make_engine

CPU = torch.device("cpu")
BLOCK = 4

# one decoder-layer family each: Llama's block, Gemma's sandwich norms, a mixture of experts
MODELS = {
    "llama": dict(arch="llama", num_heads=4, num_kv_heads=2),
    "gemma2": dict(arch="gemma2", num_heads=4, num_kv_heads=2, head_dim=16),
    "qwen3_moe": dict(
        arch="qwen3_moe",
        num_heads=4,
        num_kv_heads=2,
        config_overrides={"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
    ),
}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("keep")
    return {name: make_tiny_model(root / name, **kw) for name, kw in MODELS.items()}


def step(lens: list[int], vocab: int, gen: torch.Generator):
    """One prefill step of fresh sequences of ``lens`` tokens (blocks laid out in order): its
    input ids, positions, metadata, the row of each sequence's last token and a NaN cache
    size in blocks."""
    ids, pos, slots, cu, tables = [], [], [0], [0], []
    slots = []
    first_block = 1  # block 0 pads the tables
    for n in lens:
        blocks = -(-n // BLOCK)
        table = list(range(first_block, first_block + blocks))
        first_block += blocks
        ids += torch.randint(0, vocab, (n,), generator=gen).tolist()
        pos += range(n)
        slots += [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(n)]
        cu.append(cu[-1] + n)
        tables.append(table)
    width = max(len(t) for t in tables)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        max_seqlen_q=max(lens),
        max_seqlen_k=max(lens),
    )
    last = [c - 1 for c in cu[1:]]
    return torch.tensor(ids), torch.tensor(pos), meta, last, first_block


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
@pytest.mark.parametrize("name", list(MODELS))
def test_kept_rows_equal_the_full_forward(
    name: str, native: bool, model_dirs: dict[str, Path]
) -> None:
    if native:
        require("cpu_kernels")
        require("kernel_fp32")
    model, info = load_model(
        model_dirs[name], CPU, torch.float32, TorchAttention(native=native), native=native
    )
    cfg = model.cfg
    gen = torch.Generator().manual_seed(0)
    ids, pos, meta, last, num_blocks = step([7, 1, 13, 4, 9], info.vocab_size, gen)
    shape = (cfg.num_layers, 2, num_blocks, BLOCK, cfg.num_kv_heads, cfg.head_dim)

    def run(keep: list[int] | None) -> tuple[torch.Tensor, torch.Tensor]:
        cache = torch.full(shape, float("nan"))
        rows = None if keep is None else torch.tensor(keep, dtype=torch.int64)
        with torch.no_grad():
            hidden = model(ids, pos, cache, meta, keep=rows)
        return hidden, cache

    full, full_cache = run(None)
    assert full.shape == (len(ids), cfg.hidden_size) and torch.isfinite(full).all()
    for keep in (last, last[1:3], [0, 5, len(ids) - 1], []):
        kept, cache = run(keep)
        assert kept.shape == (len(keep), cfg.hidden_size)
        # every row's K/V is stored (the slots no token fills stay NaN)
        torch.testing.assert_close(cache, full_cache, rtol=0, atol=0, equal_nan=True)
        if native and name != "qwen3_moe":
            assert torch.equal(kept, full[keep]), "batchgen's kernels: bit for bit"
        else:
            torch.testing.assert_close(kept, full[keep], rtol=1e-5, atol=1e-5)


class Spy:
    """Records the ``keep`` of every forward pass of ``model``."""

    def __init__(self, model) -> None:
        self.calls: list[tuple[int, list[int] | None]] = []
        forward = model.forward

        def spy(input_ids, *args, keep=None, **kwargs):
            self.calls.append((len(input_ids), None if keep is None else keep.tolist()))
            return forward(input_ids, *args, keep=keep, **kwargs)

        model.forward = spy


def test_engine_keeps_the_sampled_rows(
    model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prefill steps pass the rows that sample; decode-only steps pass None; the samples (greedy
    and drawn, with logprobs) are those of the engine without ``keep``."""
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (30, 5, 17, 44, 9)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=True),
        SamplingParams(temperature=0.9, max_tokens=6, ignore_eos=True, n=2, seed=3, logprobs=True),
    ]

    def run() -> tuple[list, list]:
        engine = make_engine(model_dirs["llama"])
        spy = Spy(engine.model)
        out = [generate(engine, prompts, p) for p in params]
        samples = [
            (key, res.token_ids, res.token_logprobs)
            for results in out
            for key, res in sorted(results.items())
        ]
        return samples, spy.calls

    got, calls = run()
    prefills = [(t, keep) for t, keep in calls if keep is not None]
    assert prefills, "no step passed keep"
    for t, keep in prefills:
        assert keep == sorted(set(keep)) and len(keep) < t and all(0 <= r < t for r in keep)
    # the steps of decodes alone (one row per sequence) keep every row
    assert any(keep is None and t <= 5 for t, keep in calls)

    monkeypatch.setattr(batch_mod, "_kept_rows", lambda *a: (None, None))
    want, calls = run()
    assert all(keep is None for _, keep in calls)
    assert got == want


def test_prompt_scoring_keeps_every_row(model_dirs: dict[str, Path]) -> None:
    """A step that scores prompt tokens reads every row's hidden state: no ``keep``."""
    engine = make_engine(model_dirs["llama"])
    spy = Spy(engine.model)
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    for row, prompt in enumerate([[5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [11, 12, 13]]):
        target = SampleTarget(row, 0, rng_key(0, row, 0))
        engine.add(Request(tuple(prompt), params, (target,), logprobs_from=1))
    scored = []
    while engine.has_work():
        scored += [len(res.prompt_logprobs) for res in engine.step()]
    assert sorted(scored) == [2, 9]
    assert spy.calls and all(keep is None for _, keep in spy.calls)
