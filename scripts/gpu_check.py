"""The model-level part of scripts/gpu_check.sh: engine parity, throughput and a profile on CUDA.

    python scripts/gpu_check.py --out OUT_DIR                 # a CUDA GPU, a few minutes
    python scripts/gpu_check.py --out OUT_DIR --cpu-dry-run   # tiny shapes, CPU, interpreter

Writes ``OUT_DIR/checks.json``: one entry per check with ``ok`` (true / false / null when only
informative) and its figures. Checks:

- ``parity``: random-weight models of Llama-3-8B (32:8) and Qwen2.5-7B (28:4) geometry with few
  layers; the engine (Triton attention) against transformers on the same device, greedy, each
  prompt alone for transformers. fp32: tokens identical, except at a confirmed near tie
  (transformers' own top two within 1e-3 of each other). bf16: identical-token share and
  first-divergence positions (statistical; reported, loosely bounded).
- ``kv_sizing``: the measured activation peak and the KV budget ``kv_cache_memory: auto`` gives.
- ``throughput``: a workload like A of docs/performance.md (a ~500-token shared system prompt +
  16-64 unique tokens, n=4, 64 new tokens) on the 8B-geometry model in bf16: engine output tokens/s
  against transformers ``generate`` (batches of 64 prompts, left padding,
  ``num_return_sequences=4``).
- ``profile``: device-busy time against wall time over decode steps, and the top kernels.
- ``variants``: binaries each Triton kernel compiled over the run (its JIT cache).
- ``graphs``: ``engine.cuda_graphs`` on against off: the same greedy tokens, decode time.
- ``overlap``: ``engine.overlap`` on against off: the same tokens (greedy bf16 to max_tokens,
  seeded fp32 with stop tokens that end samples early), the run times, steps launched ahead and
  tokens discarded.
- ``sampler``: the Triton sampler kernels on a 152k vocabulary: noise bit-identical to the
  formula, tokens equal, both timed; the filtered draw (top-k / top-p / min-p, bf16 logits: many
  exact ties) against the formula's kept sets and tokens, both timed.

Everything runs from a checkout: ``batchgen`` must be importable with ``batchgen.kernels``
(gpu_check.sh lays out such a copy).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Geometry:
    name: str
    arch: str  # "llama" | "qwen2"
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    rope_theta: float


LLAMA3_8B = Geometry("llama3-8b", "llama", 4096, 32, 8, 14336, 128256, 500000.0)
QWEN25_7B = Geometry("qwen2.5-7b", "qwen2", 3584, 28, 4, 18944, 152064, 1000000.0)
TINY = [
    Geometry("tiny-llama-4:2", "llama", 128, 4, 2, 256, 512, 10000.0),
    Geometry("tiny-qwen2-7:1", "qwen2", 112, 7, 1, 256, 512, 10000.0),
]


@dataclass(frozen=True)
class Sizes:
    """How big each check runs: the GPU's or the dry run's."""

    layers: int
    parity_prompts: int
    parity_tokens: int
    rows: int
    n: int
    new_tokens: int
    system_tokens: int
    hf_batch: int
    profile_steps: int


GPU_SIZES = Sizes(2, 8, 32, 128, 4, 64, 500, 64, 20)
DRY_SIZES = Sizes(1, 3, 5, 4, 2, 4, 40, 2, 3)


def make_model(folder: Path, geo: Geometry, layers: int, device: Any) -> Path:
    """A random model of ``geo`` with ``layers`` layers, saved in bf16 (exact in fp32 too)."""
    import torch
    import transformers

    cls = transformers.LlamaConfig if geo.arch == "llama" else transformers.Qwen2Config
    config = cls(
        vocab_size=geo.vocab,
        hidden_size=geo.hidden,
        intermediate_size=geo.intermediate,
        num_hidden_layers=layers,
        num_attention_heads=geo.heads,
        num_key_value_heads=geo.kv_heads,
        head_dim=geo.hidden // geo.heads,
        max_position_embeddings=8192,
        rope_theta=geo.rope_theta,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        initializer_range=0.02,
        bos_token_id=1,
        eos_token_id=2,
        architectures=["LlamaForCausalLM" if geo.arch == "llama" else "Qwen2ForCausalLM"],
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():  # norms and biases random too: a missing one shows
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            elif name.endswith(".bias"):
                param.copy_(0.02 * torch.randn_like(param))
    model.save_pretrained(folder)
    del model
    return folder


def random_prompts(count: int, vocab: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        [1] + [rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(count)
    ]


def make_engine(model_dir: Path, device: Any, dtype: Any, num_blocks: int | None = None,
                max_num_seqs: int = 256, max_tokens_per_step: int = 8192,
                cuda_graphs: bool = False, overlap: bool = False) -> Any:  # fmt: skip
    """A Triton-backend engine (as the runner builds it), KV sized as ``auto`` does on CUDA."""
    import torch

    from batchgen.engine.engine import Engine, EngineSettings
    from batchgen.model.attention import make_attention_backend
    from batchgen.model.loader import load_model

    model, info = load_model(model_dir, device, dtype, make_attention_backend("triton"))
    sizing: dict[str, Any] = {}
    if num_blocks is None:
        from batchgen.engine.memory import measure_activation_peak
        from batchgen.plan import cuda_kv_budget

        peak = measure_activation_peak(model, info, max_num_batched_tokens=max_tokens_per_step,
                                       max_num_seqs=max_num_seqs, block_size=16, device=device,
                                       dtype=dtype)  # fmt: skip
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
        budget = cuda_kv_budget(free, total, peak)
        num_blocks = budget // (info.kv_bytes_per_token(dtype) * 16)
        sizing = dict(activation_peak=peak, free=free, total=total, kv_budget=budget,
                      num_blocks=num_blocks)  # fmt: skip
    config = EngineSettings(
        block_size=16,
        num_blocks=num_blocks,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_tokens_per_step,
        max_model_len=min(info.max_model_len, num_blocks * 16),
        attention_backend="triton",
        cuda_graphs=cuda_graphs,
        overlap=overlap,
    )
    start = time.perf_counter()
    engine = Engine(model, info, config, device=device, dtype=dtype)  # warms up on CUDA
    sizing["engine_start_s"] = time.perf_counter() - start
    engine.sizing = sizing
    return engine


def run_engine(engine: Any, prompts: list[list[int]], n: int, max_tokens: int,
               temperature: float, stop_token_ids: tuple[int, ...] = ()) -> tuple[dict, float]:  # fmt: skip
    """(row, sample) -> token ids, and the seconds the steps took."""
    from batchgen.engine.noise import rng_key
    from batchgen.engine.request import Request, SampleTarget, SamplingParams

    params = SamplingParams(n=n, max_tokens=max_tokens, temperature=temperature, ignore_eos=True,
                            stop_token_ids=stop_token_ids, seed=1)  # fmt: skip
    for row, p in enumerate(prompts):
        targets = tuple(SampleTarget(row, k, rng_key(0, row, k)) for k in range(n))
        engine.add(Request(tuple(p), params, targets))
    out: dict[tuple[int, int], list[int]] = {}
    sync = _sync_fn(engine.device)
    start = time.perf_counter()
    while engine.has_work():
        for res in engine.step():
            out[(res.target.row, res.target.sample_index)] = list(res.token_ids)
    sync()
    return out, time.perf_counter() - start


def _sync_fn(device: Any) -> Callable[[], None]:
    import torch

    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)


def hf_model(model_dir: Path, device: Any, dtype: Any) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()


def hf_greedy(hf: Any, prompts: list[list[int]], max_new: int, device: Any) -> list[list[int]]:
    import torch

    outs = []
    for ids in prompts:
        x = torch.tensor([ids], device=device)
        with torch.no_grad():
            y = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                            max_new_tokens=max_new, min_new_tokens=max_new, pad_token_id=0)  # fmt: skip
        outs.append(y[0, len(ids) :].tolist())
    return outs


def first_divergence(a: list[int], b: list[int]) -> int:
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def check_parity(geos: list[Geometry], sizes: Sizes, device: Any, work: Path) -> dict:
    """Greedy tokens of the engine against transformers, fp32 (exact up to near ties) and bf16
    (statistics), on each geometry."""
    import torch

    result: dict[str, Any] = {"ok": True, "models": {}}
    for geo in geos:
        folder = make_model(work / geo.name, geo, sizes.layers, device)
        prompts = random_prompts(sizes.parity_prompts, geo.vocab, 8, 200, seed=7)
        entry: dict[str, Any] = {}
        for dtype in (torch.float32, torch.bfloat16):
            engine = make_engine(folder, device, dtype, num_blocks=512, max_num_seqs=16)
            got, _ = run_engine(engine, prompts, 1, sizes.parity_tokens, 0.0)
            del engine
            hf = hf_model(folder, device, dtype)
            want = hf_greedy(hf, prompts, sizes.parity_tokens, device)
            firsts = [first_divergence(got[(i, 0)], w) for i, w in enumerate(want)]
            same = sum(
                a == b for i, w in enumerate(want) for a, b in zip(got[(i, 0)], w, strict=True)
            )
            name = str(dtype).removeprefix("torch.")
            stats: dict[str, Any] = dict(
                first_divergence=firsts, identical_share=same / (len(want) * sizes.parity_tokens)
            )
            if dtype == torch.float32:
                ties = []
                for i, p in enumerate(firsts):
                    if p == sizes.parity_tokens:
                        continue
                    with torch.no_grad():
                        ctx = torch.tensor([prompts[i] + want[i][:p]], device=device)
                        logits = hf(ctx).logits[0, -1].float()
                    a, b = got[(i, 0)][p], want[i][p]
                    gap = abs(float(logits[a] - logits[b]))
                    ties.append(dict(prompt=i, position=p, gap=gap,
                                     tie=gap <= 1e-3 * max(1.0, float(logits.abs().max()))))  # fmt: skip
                stats["divergences"] = ties
                stats["ok"] = all(t["tie"] for t in ties)
            else:  # bf16 rounds differently everywhere: loose bounds, as tests/test_bf16.py
                stats["ok"] = stats["identical_share"] >= 0.5 and statistics.median(firsts) >= (
                    sizes.parity_tokens / 4
                )
            result["ok"] = result["ok"] and stats["ok"]
            entry[name] = stats
            del hf
            if device.type == "cuda":
                torch.cuda.empty_cache()
        result["models"][geo.name] = entry
    return result


def workload_a(sizes: Sizes, vocab: int) -> list[list[int]]:
    rng = random.Random(11)
    system = [1] + [rng.randrange(3, vocab) for _ in range(sizes.system_tokens)]
    return [system + [rng.randrange(3, vocab) for _ in range(rng.randint(16, 64))]
            for _ in range(sizes.rows)]  # fmt: skip


def hf_generate_throughput(hf: Any, prompts: list[list[int]], sizes: Sizes, device: Any) -> float:
    """Output tokens/s of transformers ``generate`` in left-padded batches."""
    import torch

    sync = _sync_fn(device)
    tokens = 0
    start = time.perf_counter()
    for b in range(0, len(prompts), sizes.hf_batch):
        batch = prompts[b : b + sizes.hf_batch]
        width = max(map(len, batch))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=mask, do_sample=True, top_k=0, temperature=1.0,
                              num_return_sequences=sizes.n, max_new_tokens=sizes.new_tokens,
                              min_new_tokens=sizes.new_tokens, pad_token_id=0)  # fmt: skip
        tokens += (out.shape[1] - width) * out.shape[0]
    sync()
    return tokens / (time.perf_counter() - start)


def check_throughput_and_profile(geo: Geometry, sizes: Sizes, device: Any, work: Path,
                                 dry: bool) -> dict:  # fmt: skip
    import torch

    dtype = torch.bfloat16
    folder = work / geo.name
    if not (folder / "config.json").exists():
        make_model(folder, geo, sizes.layers, device)
    engine = make_engine(folder, device, dtype, num_blocks=512 if dry else None)
    prompts = workload_a(sizes, geo.vocab)
    out, seconds = run_engine(engine, prompts, sizes.n, sizes.new_tokens, 1.0)
    tokens = sum(map(len, out.values()))
    ours = tokens / seconds
    result: dict[str, Any] = {
        "kv_sizing": {"ok": None, **engine.sizing},
        "throughput": {
            "ok": None,
            "rows": sizes.rows,
            "n": sizes.n,
            "new_tokens": sizes.new_tokens,
            "engine_tokens_per_s": ours,
            "engine_steps": engine.stats.steps,
        },
    }
    result["profile"] = profile_decode(engine, prompts[: max(1, sizes.rows // 4)], sizes, device)
    result["variants"] = triton_variants(device)
    del engine
    if device.type == "cuda":
        torch.cuda.empty_cache()
    hf = hf_model(folder, device, dtype)
    theirs = hf_generate_throughput(hf, prompts, sizes, device)
    result["throughput"].update(hf_generate_tokens_per_s=theirs, speedup=ours / theirs)
    return result


def profile_decode(engine: Any, prompts: list[list[int]], sizes: Sizes, device: Any) -> dict:
    """Device-busy time against wall time over a few steps (after the prefills)."""
    from torch.profiler import ProfilerActivity, profile

    from batchgen.engine.noise import rng_key
    from batchgen.engine.request import Request, SampleTarget, SamplingParams

    params = SamplingParams(n=sizes.n, max_tokens=4 * sizes.profile_steps, temperature=1.0,
                            ignore_eos=True)  # fmt: skip
    for row, p in enumerate(prompts):
        engine.add(Request(tuple(p), params, tuple(SampleTarget(row, k, rng_key(1, row, k))
                                                   for k in range(sizes.n))))  # fmt: skip
    for _ in range(3):  # prefills and forks
        engine.step()
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync = _sync_fn(device)
    sync()
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(sizes.profile_steps):
            if engine.has_work():
                engine.step()
        sync()
        wall = time.perf_counter() - start
    while engine.has_work():
        engine.step()
    events = [e for e in prof.key_averages() if (e.device_time_total if cuda else 0) > 0]
    busy_us = sum(e.self_device_time_total for e in events) if cuda else 0.0
    top = sorted(events, key=lambda e: e.self_device_time_total, reverse=True)[:12]
    return {
        "ok": None,
        "steps": sizes.profile_steps,
        "wall_s": wall,
        "device_busy_s": busy_us / 1e6,
        "device_busy_share": (busy_us / 1e6) / wall if wall else None,
        "top_kernels": [
            dict(name=e.key[:120], self_ms=e.self_device_time_total / 1e3, calls=e.count)
            for e in top
        ],  # fmt: skip
    }


def triton_variants(device: Any) -> dict:
    """Binaries in each Triton kernel's JIT cache (compiled kernels only)."""
    import importlib

    found: dict[str, Any] = {"ok": None}
    for module, names in (
        ("attention", ("_paged_attention_kernel", "_merge_splits_kernel")),
        ("kv_store", ("_store_kv_kernel",)),
        ("block_copy", ("_copy_blocks_kernel",)),
        ("sampler", ("_uniform_noise_kernel", "_race_draw_kernel", "_filtered_draw_kernel")),
    ):
        mod = importlib.import_module(f"batchgen.kernels.{module}")
        for name in names:
            kernel = getattr(mod, name)
            caches = getattr(kernel, "device_caches", None)
            if caches is None:
                found[name] = "interpreted"
                continue
            found[name] = sum(len(entry[0]) for entry in caches.values())
    return found


def check_sampler(device: Any, dry: bool) -> dict:
    """The Triton sampler kernels on a real vocabulary: noise bit-identical to the formula (on
    this device and on the CPU), the race's tokens equal to the formula's, and both timed."""
    import torch

    from batchgen.engine.noise import TORCH_FORMULA, row_state, uniform_at
    from batchgen.engine.sampler import _draw_plain
    from batchgen.kernels.sampler import race_draw, uniform_noise

    rows, vocab = (4, 512) if dry else (256, 152064)
    gen = torch.Generator().manual_seed(0)
    keys = torch.randint(0, 2**63 - 1, (rows,), generator=gen)
    pos = torch.randint(0, 10_000, (rows,), generator=gen)
    logits = (torch.randn(rows, vocab, generator=gen) * 3.0).to(device)
    temperature = torch.full((rows,), 0.8, device=device)
    ids = torch.arange(vocab, device=device)[None, :]
    k_dev, p_dev = keys.to(device), pos.to(device)
    state = row_state(k_dev, p_dev)
    noise = uniform_noise(state, ids, vocab)
    formula = uniform_at(k_dev, p_dev, ids, TORCH_FORMULA)
    cpu = uniform_at(keys[:4], pos[:4], ids.cpu(), TORCH_FORMULA)
    bits = noise.view(torch.int32)
    same_noise = torch.equal(bits, formula.view(torch.int32)) and torch.equal(
        bits[:4].cpu(), cpu.view(torch.int32)
    )
    ours = race_draw(logits, temperature, state)
    theirs = _draw_plain(logits, temperature, k_dev, p_dev, TORCH_FORMULA)
    agree = int((ours == theirs).sum())
    sync = _sync_fn(device)

    def timed(fn: Callable[[], object]) -> float:
        fn()
        sync()
        start = time.perf_counter()
        for _ in range(5):
            fn()
        sync()
        return (time.perf_counter() - start) / 5 * 1e3

    filtered = _check_filtered_draw(device, rows, vocab, gen, timed)
    return {
        "ok": same_noise and agree >= rows - 1 and filtered["ok"],  # one near-tie flip allowed
        "rows": rows,
        "vocab": vocab,
        "noise_bit_identical": same_noise,
        "tokens_equal": agree,
        "kernel_draw_ms": timed(lambda: race_draw(logits, temperature, row_state(k_dev, p_dev))),
        "formula_draw_ms": timed(
            lambda: _draw_plain(logits, temperature, k_dev, p_dev, TORCH_FORMULA)
        ),
        "filtered": filtered,
    }


def _check_filtered_draw(
    device: Any, rows: int, vocab: int, gen: Any, timed: Callable[[Callable[[], object]], float]
) -> dict:
    """filtered_draw against the PyTorch formula on bf16 logits cast to fp32 (exact ties that
    must be cut by vocab id), top-k / top-p / min-p mixed row by row. Kept sets: identical where
    no cumulative mass decides (top_p = 1: value cuts only; one row spared for a threshold within
    an ulp); where top-p's mass does, the rows may differ only in boundary tokens of negligible
    mass (the two sum in different orders). Tokens: equal but for two near-tie flips."""
    import torch

    from batchgen.engine.noise import TORCH_FORMULA, row_state
    from batchgen.engine.sampler import _draw_filtered, _filtered_candidates
    from batchgen.kernels.sampler import filtered_draw, filtered_keep

    logits = (torch.randn(rows, vocab, generator=gen) * 3.0).to(torch.bfloat16).float().to(device)
    temperature = (0.5 + torch.rand(rows, generator=gen)).to(device)
    top_k = torch.tensor([(0, 1, 20, 1000, 0)[i % 5] for i in range(rows)], device=device)
    top_p = torch.tensor([(1.0, 0.9, 0.5, 0.95)[i % 4] for i in range(rows)], device=device)
    min_p = torch.tensor([(0.0, 0.0, 0.05)[i % 3] for i in range(rows)], device=device)
    keys = torch.randint(0, 2**63 - 1, (rows,), generator=gen).to(device)
    pos = torch.randint(0, 10_000, (rows,), generator=gen).to(device)
    state = row_state(keys, pos)
    kept, ours = filtered_keep(logits, temperature, top_k, top_p, min_p, state)
    theirs = _draw_filtered(
        logits, temperature, top_k, top_p, min_p, keys, pos, True, True, True, None, TORCH_FORMULA
    )
    scaled = logits / temperature[:, None]
    ids, cand_p = _filtered_candidates(scaled, top_k, top_p, min_p, True, True, True, None)
    want = torch.zeros_like(kept).scatter_(1, ids, cand_p > 0)
    probs = torch.softmax(scaled, dim=-1)
    differ = (kept & (probs > 1e-30)) != want  # [rows, vocab]
    differ_mass = (probs * differ).sum(dim=-1)  # [rows]
    value_cut = top_p >= 1.0
    value_rows_differ = int((differ.any(dim=-1) & value_cut).sum())
    max_mass = float(differ_mass[~value_cut].max()) if bool((~value_cut).any()) else 0.0
    agree = int((ours == theirs).sum())

    def formula() -> object:
        return _draw_filtered(
            logits, temperature, top_k, top_p, min_p, keys, pos, True, True, True, None,
            TORCH_FORMULA,
        )  # fmt: skip

    return {
        "ok": agree >= rows - 2 and value_rows_differ <= 1 and max_mass <= 1e-4,
        "tokens_equal": agree,
        "kept_sets_equal": int((~differ.any(dim=-1)).sum()),
        "value_cut_rows_differing": value_rows_differ,
        "top_p_rows_max_differing_mass": max_mass,
        "kernel_draw_ms": timed(
            lambda: filtered_draw(logits, temperature, top_k, top_p, min_p, row_state(keys, pos))
        ),
        "formula_draw_ms": timed(formula),
    }


def check_graphs(geo: Geometry, sizes: Sizes, device: Any, work: Path, dry: bool) -> dict:
    """engine.cuda_graphs on against off: the same greedy tokens (fp32 and bf16), decode speed."""
    import torch

    if dry:
        return {"ok": None, "skipped": "CUDA graphs need CUDA (tests/test_staging.py runs the "
                "padded static-buffer path eagerly)"}  # fmt: skip
    folder = work / geo.name
    if not (folder / "config.json").exists():
        make_model(folder, geo, sizes.layers, device)
    prompts = random_prompts(48, geo.vocab, 8, 300, seed=3)  # 48 rows: buckets 32 and 48
    result: dict[str, Any] = {"ok": True}
    for dtype in (torch.float32, torch.bfloat16):
        runs = {}
        for graphs in (False, True):
            engine = make_engine(folder, device, dtype, num_blocks=4096, max_num_seqs=48,
                                 cuda_graphs=graphs)  # fmt: skip
            out, seconds = run_engine(engine, prompts, 1, 32, 0.0)
            runs[graphs] = (out, seconds, engine.sizing.get("engine_start_s"))
            del engine
            torch.cuda.empty_cache()
        same = sum(runs[True][0][k] == v for k, v in runs[False][0].items())
        name = str(dtype).removeprefix("torch.")
        result[name] = dict(identical_samples=same, samples=len(prompts),
                            eager_s=runs[False][1], graphs_s=runs[True][1],
                            graphs_start_s=runs[True][2])  # fmt: skip
        # padding rows change GEMM shapes: bf16 may flip near ties, fp32 should not
        result["ok"] = result["ok"] and same >= (
            len(prompts) if name == "float32" else 0.8 * len(prompts)
        )
    return result


def check_overlap(geo: Geometry, sizes: Sizes, device: Any, work: Path, dry: bool) -> dict:
    """engine.overlap on against off: identical tokens; run time, overlapped and discarded."""
    import torch

    folder = work / geo.name
    if not (folder / "config.json").exists():
        make_model(folder, geo, sizes.layers, device)
    rows = 4 if dry else 64
    prompts = random_prompts(rows, geo.vocab, 8, 40 if dry else 300, seed=4)
    # ~3% of the vocabulary as stop tokens: most samples end early, unforeseen
    stops = tuple(range(3, 3 + geo.vocab // 32))
    cases = {
        "bf16_greedy": (torch.bfloat16, 0.0, (), 6 if dry else 64),
        "fp32_seeded_stops": (torch.float32, 0.8, stops, 6 if dry else 64),
    }
    result: dict[str, Any] = {"ok": True}
    for name, (dtype, temperature, stop_ids, max_tokens) in cases.items():
        runs = {}
        for overlap in (False, True):
            engine = make_engine(folder, device, dtype, num_blocks=256 if dry else 8192,
                                 max_num_seqs=64, overlap=overlap)  # fmt: skip
            run_engine(engine, prompts[:2], 1, 2, temperature)  # warm-up
            engine.stats.overlapped_steps = engine.stats.discarded_tokens = 0
            out, seconds = run_engine(engine, prompts, 2, max_tokens, temperature, stop_ids)
            runs[overlap] = (out, seconds, engine.stats.overlapped_steps,
                             engine.stats.discarded_tokens)  # fmt: skip
            del engine
            if device.type == "cuda":
                torch.cuda.empty_cache()
        want = runs[False][0]
        same = sum(runs[True][0].get(k) == v for k, v in want.items())
        result[name] = dict(identical_samples=same, samples=len(want), off_s=runs[False][1],
                            on_s=runs[True][1], overlapped_steps=runs[True][2],
                            discarded_tokens=runs[True][3],
                            mean_tokens=sum(map(len, want.values())) / len(want))  # fmt: skip
        result["ok"] = result["ok"] and same == len(want) and runs[True][2] > 0
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--cpu-dry-run",
        action="store_true",
        help="tiny shapes on the CPU under the Triton interpreter",
    )
    args = parser.parse_args(argv)  # fmt: skip
    if args.cpu_dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before anything imports the kernels
    import torch

    if args.cpu_dry_run:
        device, sizes, geos = torch.device("cpu"), DRY_SIZES, TINY
    else:
        if not torch.cuda.is_available():
            parser.error("no CUDA device: use --cpu-dry-run")
        device, sizes, geos = torch.device("cuda"), GPU_SIZES, [LLAMA3_8B, QWEN25_7B]
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 parity means IEEE fp32
    args.out.mkdir(parents=True, exist_ok=True)
    checks: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "dry_run": args.cpu_dry_run,
    }
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        work = Path(tmp)
        steps: list[tuple[str, Callable[[], dict]]] = [
            ("sampler", lambda: check_sampler(device, args.cpu_dry_run)),
            ("parity", lambda: check_parity(geos, sizes, device, work)),
            ("throughput", lambda: check_throughput_and_profile(geos[0], sizes, device, work,
                                                                args.cpu_dry_run)),
            ("graphs", lambda: check_graphs(geos[0], sizes, device, work, args.cpu_dry_run)),
            ("overlap", lambda: check_overlap(geos[0], sizes, device, work, args.cpu_dry_run)),
        ]  # fmt: skip
        for name, fn in steps:
            start = time.perf_counter()
            try:
                got = fn()
            except Exception as exc:  # record and go on: one run must report everything
                got = {name: {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                              "traceback": traceback.format_exc()[-3000:]}}  # fmt: skip
            else:
                got = got if name == "throughput" else {name: got}
            for key, value in got.items():
                value["seconds"] = round(time.perf_counter() - start, 1)
                checks[key] = value
                print(f"{key}: {json.dumps(value)[:600]}", flush=True)
            (args.out / "checks.json").write_text(json.dumps(checks, indent=2, default=str))
    failed = [k for k, v in checks.items() if isinstance(v, dict) and v.get("ok") is False]
    print(f"wrote {args.out / 'checks.json'}; failed: {failed or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
