"""``kv_cache_memory: auto`` on CUDA: sized from free memory after the allocator's cache is
emptied, minus a measured activation peak and a reserve. Checked on the CPU with numbers and a
stand-in for the CUDA memory calls."""

from __future__ import annotations

import torch

from batchgen.engine import memory
from batchgen.jobfile import load_job
from batchgen.model.attention import make_attention_backend
from batchgen.model.loader import load_model
from batchgen.plan import GPU_RESERVE_SHARE, Placement, cuda_kv_budget, plan_num_blocks
from tests.jobkit import write_job

GiB = 1 << 30


def test_budget_is_free_memory_less_activations_and_reserve() -> None:
    # An H200 with an 8B bf16 model loaded: 143 GiB total, 126 GiB free, 3 GiB peak.
    total, free, peak = 143 * GiB, 126 * GiB, 3 * GiB
    reserve = int(total * GPU_RESERVE_SHARE)
    assert cuda_kv_budget(free, total, peak) == free - peak - reserve
    assert cuda_kv_budget(4 * GiB, total, 3 * GiB) == 0  # never negative
    # More activations or less free memory never give more KV.
    assert cuda_kv_budget(free, total, 2 * peak) < cuda_kv_budget(free, total, peak)
    assert cuda_kv_budget(free - GiB, total, peak) == cuda_kv_budget(free, total, peak) - GiB


def test_cuda_auto_empties_the_cache_before_reading_free_memory(
    tiny_model, tmp_path, monkeypatch
) -> None:
    model_dir = tiny_model("llama", num_layers=1)
    job = load_job(write_job(tmp_path, model_dir, ["a"]))
    model, info = load_model(model_dir, torch.device("cpu"), torch.float32,
                             make_attention_backend("torch"))  # fmt: skip
    calls: list[str] = []
    total, freed = 80 * GiB, 50 * GiB

    def empty_cache() -> None:
        calls.append("empty_cache")

    def mem_get_info(device=None) -> tuple[int, int]:
        calls.append("mem_get_info")
        # what the allocator held for the freed fused halves is free only after empty_cache
        return (freed if "empty_cache" in calls else freed - 9 * GiB), total

    def peak(*args, **kwargs) -> int:
        calls.append("peak")
        return 2 * GiB

    monkeypatch.setattr(torch.cuda, "empty_cache", empty_cache)
    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    monkeypatch.setattr(memory, "measure_activation_peak", peak)
    place = Placement(torch.device("cuda"), torch.float32, "triton")
    blocks = plan_num_blocks(job, info, place, model=model)
    block_bytes = info.kv_bytes_per_token(torch.float32) * job.engine.block_size
    assert calls == ["peak", "empty_cache", "mem_get_info"]
    assert blocks == cuda_kv_budget(freed, total, 2 * GiB) // block_bytes


def test_activation_peak_runs_the_worst_step(tiny_model, monkeypatch) -> None:
    """The profiling step runs the model, the logits and a top-p draw at the engine's limits
    (here on the CPU, with the allocator's counters faked)."""
    model, info = load_model(tiny_model("llama", num_layers=1), torch.device("cpu"),
                             torch.float32, make_attention_backend("torch"))  # fmt: skip
    seen: list[int] = []
    forward = model.forward

    def counting(input_ids, *args, **kwargs):
        seen.append(input_ids.numel())
        return forward(input_ids, *args, **kwargs)

    model.forward = counting
    counters = iter([1000, 5000])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: next(counters))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: next(counters))
    got = memory.measure_activation_peak(
        model, info, max_num_batched_tokens=37, max_num_seqs=5, block_size=4,
        device=torch.device("cpu"), dtype=torch.float32,
    )  # fmt: skip
    assert got == 4000 and seen == [37]
