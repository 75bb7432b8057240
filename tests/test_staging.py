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
    (e,) = staging.upload(torch.float32, [[0.5, -2.25]])
    assert e.tolist() == [0.5, -2.25] and e.dtype == torch.float32


def test_staged_steps_equal_unstaged_ones(tiny_model, monkeypatch) -> None:
    engine = make_engine(tiny_model("llama", num_layers=1), max_num_batched_tokens=20)
    compared = []
    real = batch_mod.build_step

    def both(batch, block_size, device, staging=None, in_flight=None):
        assert staging is engine.staging
        got = real(batch, block_size, device, staging, in_flight)
        want = real(batch, block_size, device, in_flight=in_flight)
        for name in ("input_ids", "positions", "logits_indices", "fill_rows", "fill_src"):
            x, y = getattr(got, name), getattr(want, name)
            assert (x is None and y is None) or torch.equal(x, y), name
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


def test_padded_decode_graph_steps_match_eager_ones(tiny_model) -> None:
    """The static-buffer decode path of engine.cuda_graphs, run eagerly (capture=False): padding
    rows to the bucket (slot -1, one key) changes no real row's tokens."""
    from batchgen.engine.cuda_graphs import DecodeGraphs, graph_buckets

    assert graph_buckets(6) == [1, 2, 4, 6] and graph_buckets(8) == [1, 2, 4, 8]
    model = tiny_model("llama", num_layers=1)
    prompts = random_prompts([2, 5, 9, 3, 7])
    params = SamplingParams(temperature=0.0, max_tokens=6)  # 5 sequences: bucket 8
    want = generate(make_engine(model, "triton", max_num_seqs=8), prompts, params)
    engine = make_engine(model, "triton", max_num_seqs=8)
    engine.graphs = DecodeGraphs(
        engine.model, engine.kv_cache, block_size=engine.config.block_size, max_num_seqs=8,
        max_model_len=engine.config.max_model_len, device=engine.device, capture=False,
    )  # fmt: skip
    used: list[int] = []
    run = engine.graphs.run
    engine.graphs.run = lambda step: (used.append(step.input_ids.shape[0]), run(step))[1]
    got = generate(engine, prompts, params)
    assert {k: r.token_ids for k, r in got.items()} == {k: r.token_ids for k, r in want.items()}
    assert used and any(n not in (1, 2, 4, 8) for n in used)  # some steps were padded


def test_sampling_settings_through_staging_equal_direct_ones() -> None:
    """SamplingBatch.from_rows with the engine's staging (one float32 and one int64 upload):
    the same tensors as made one by one, row partitions included."""
    import dataclasses

    from batchgen.engine.sampler import SamplingBatch

    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7, top_p=0.9),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.5, top_k=5, min_p=0.1, presence_penalty=0.25),
    ]
    keys, positions = [11, 12, 13, 2**60], [3, 4, 5, 6]
    prompts, outputs = [[1, 2], [3], [4, 5, 6], [7]], [[8], [], [9, 9], [10]]
    args = (params, keys, positions, prompts, outputs, 32)
    want = SamplingBatch.from_rows(*args)
    got = SamplingBatch.from_rows(*args, staging=Staging(torch.device("cpu")))
    for f in dataclasses.fields(SamplingBatch):
        x, y = getattr(got, f.name), getattr(want, f.name)
        if isinstance(y, torch.Tensor):
            assert x.dtype == y.dtype and torch.equal(x, y), f.name
        else:
            assert x == y, f.name
    assert want.random_rows is not None and want.filtered_rows is not None
