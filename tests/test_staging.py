"""A step's integer tensors go up packed through the engine's staging buffers (pinned on CUDA):
the same values as building them one by one, on every step of an engine run."""

from __future__ import annotations

import torch

from batchgen.engine import batch as batch_mod
from batchgen.engine.request import SamplingParams
from batchgen.engine.staging import Staging
from tests.test_engine import generate, make_engine, random_prompts


def test_upload_packs_and_never_aliases() -> None:
    staging = Staging(torch.device("cpu"))
    a, b, empty = staging.upload(torch.int64, [[1, 2, 3], [2**40, -5], []])
    assert a.tolist() == [1, 2, 3] and b.tolist() == [2**40, -5] and empty.numel() == 0
    assert a.dtype == torch.int64
    (c,) = staging.upload(torch.int32, [[7, 8]])
    (d,) = staging.upload(torch.int32, [[9, 10]])
    assert c.tolist() == [7, 8] and d.tolist() == [9, 10] and c.dtype == torch.int32


def test_staged_steps_equal_unstaged_ones(tiny_model, monkeypatch) -> None:
    engine = make_engine(tiny_model("llama", num_layers=1), max_num_batched_tokens=20)
    compared = []
    real = batch_mod.build_step

    def both(batch, block_size, device, staging=None):
        assert staging is engine.staging
        got = real(batch, block_size, device, staging)
        want = real(batch, block_size, device)
        for name in ("input_ids", "positions", "logits_indices"):
            assert torch.equal(getattr(got, name), getattr(want, name)), name
        for name in ("slot_mapping", "block_tables", "cu_seqlens_q", "seq_lens"):
            x, y = getattr(got.meta, name), getattr(want.meta, name)
            assert x.dtype == y.dtype and torch.equal(x, y), name
        for name in ("max_seqlen_q", "max_seqlen_k", "num_decodes"):
            assert getattr(got.meta, name) == getattr(want.meta, name), name
        compared.append(got.meta.num_decodes)
        return got

    monkeypatch.setattr("batchgen.engine.engine.build_step", both)
    params = SamplingParams(temperature=0.0, max_tokens=5, n=2)
    generate(engine, random_prompts([1, 4, 9, 17, 30]), params)
    assert len(compared) == engine.stats.steps
    assert any(0 < n for n in compared)  # decode rows, mixed steps among them
