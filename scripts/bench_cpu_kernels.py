"""Time the CPU C kernels (batchgen/model/cpu_kernels.c) against the PyTorch path they replace,
side by side in one run, on the benchmark model's shapes (8 query heads, 2 KV heads, head 64,
block 16, vocabulary 4096).

    python scripts/bench_cpu_kernels.py [--threads 2] [--reps 15] [--bf16 | --bf16-only]
        [--int8 | --int8-only] [--json bench-out/cpu-kernels.json]

Cases:
- prefill / extend: the tiled kernel vs the per-token kernel vs SDPA on contiguous K/V (the
  PyTorch path also gathers K/V out of the paged cache first; that copy is not counted here);
- cascade prefix: the fused prefix attention + merge vs the PyTorch path (gathers, SDPA, merge);
- decode: the per-token kernel over scattered blocks of a cache larger than the data (K/V bytes
  read over time: the figure to compare with the machine's DRAM read rate);
- sampler: the fused temperature-only draw vs the PyTorch formula;
- bf16 (``--bf16``, also on a Qwen2.5-0.5B head shape, 14:2): decode, prefill and extend
  attention in the fp32 kernels, the bf16 kernels (this CPU's build and the portable one) and the
  PyTorch bf16 path (``TorchAttention(native=False)``: gathers and SDPA), all through the paged
  cache; ``bf16_plan``: what a bf16 native plan runs (the kernels, SDPA for long fresh
  prefills).
- int8 (``--int8``): long-context decode attention (16 sequences of 2k-3k keys, Qwen2.5-0.5B's
  14:2 heads of 64) over fp32, bf16 and int8 caches (int8 with fp32 and with bf16 q), side by
  side, with the K/V bytes each reads per second (int8: bytes and scales).

Every case first checks that both sides agree. Times are medians of ``--reps``; the machine is
noisy, so compare ratios within one run. Slow-ish (a minute); not part of the tests.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from batchgen.engine import noise, sampler
from batchgen.model import cpu_kernels
from batchgen.model.attention import AttentionMetadata, TorchAttention
from batchgen.model.attention.torch_plan import Cascade as _Cascade

HQ, HKV, D, BS, VOCAB = 8, 2, 64, 16, 4096


def median_ms(fn: Callable[[], object], reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def paged_case(n: int, keys: int, q_len: int, spread: int = 1, seed: int = 0) -> dict:
    """n sequences of ``keys`` keys (the last q_len of them new) in a paged cache ``spread``
    times larger than they need, blocks in random order."""
    gen = torch.Generator().manual_seed(seed)
    per = -(-keys // BS)
    num_blocks = n * per * spread + 1
    return dict(
        q=torch.randn(n * q_len, HQ, D, generator=gen),
        k_cache=torch.randn(num_blocks, BS, HKV, D, generator=gen),
        v_cache=torch.randn(num_blocks, BS, HKV, D, generator=gen),
        block_tables=(torch.randperm(num_blocks - 1, generator=gen)[: n * per] + 1)
        .view(n, per)
        .to(torch.int32),
        cu_seqlens_q=torch.arange(n + 1, dtype=torch.int32) * q_len,
        seq_lens=torch.full((n,), keys, dtype=torch.int32),
    )


def attention_flops(n: int, keys: int, q_len: int) -> float:
    """QK and PV multiply-adds x 2 over the keys each new token sees (causal)."""
    return 4.0 * HQ * D * n * sum(keys - q_len + i + 1 for i in range(q_len))


def prefill_case(kern: cpu_kernels.CpuKernels, reps: int, n: int, keys: int, q_len: int) -> dict:
    c = paged_case(n, keys, q_len)
    seqs = torch.arange(n, dtype=torch.int32)
    out = torch.empty_like(c["q"])
    times = {}
    for name, tiled in (("per_token", False), ("tiled", True)):  # tiled last: its out is kept
        times[name] = median_ms(
            lambda t=tiled: kern.paged_attention(**c, seqs=seqs, out=out, scale=0.125, tiled=t),
            reps,
        )
    # SDPA on contiguous K/V, the same keys in position order
    slots = (c["block_tables"].long()[:, :, None] * BS + torch.arange(BS)).view(n, -1)[:, :keys]
    k = c["k_cache"].view(-1, HKV, D)[slots].transpose(1, 2)  # [n, Hkv, keys, D]
    v = c["v_cache"].view(-1, HKV, D)[slots].transpose(1, 2)
    q = c["q"].view(n, q_len, HQ, D).transpose(1, 2)
    fresh = keys == q_len  # the PyTorch path runs fresh prefills with is_causal
    pos = torch.arange(keys - q_len, keys)
    mask = None
    if not fresh:
        mask = torch.zeros(q_len, keys).masked_fill_(torch.arange(keys) > pos[:, None], -torch.inf)

    def sdpa() -> torch.Tensor:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=0.125, is_causal=fresh, enable_gqa=True
        )

    times["sdpa"] = median_ms(sdpa, reps)
    ref = sdpa().transpose(1, 2).reshape(n * q_len, HQ, D)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    flops = attention_flops(n, keys, q_len)
    return dict(
        case=f"attend {n} seqs x {q_len} new of {keys} keys",
        **times,
        tiled_gflops=flops / times["tiled"] / 1e6,
    )


def bench_prefill(kern: cpu_kernels.CpuKernels, reps: int) -> list[dict]:
    shapes = [(16, 256, 256), (8, 400, 400), (2, 1024, 1024), (32, 300, 40), (64, 300, 16),
              (128, 300, 8)]  # fmt: skip
    return [prefill_case(kern, reps, *shape) for shape in shapes]


def prefix_case(kern: cpu_kernels.CpuKernels, reps: int, members: int, prefix: int) -> dict:
    c = paged_case(1, prefix, 1)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(members, HQ + 2 * HKV, D, generator=gen)[:, :HQ]  # a slice of qkv
    bt = c["block_tables"][0].long()
    slots = (bt[:, None] * BS + torch.arange(BS)).reshape(-1)[:prefix].contiguous()
    rows = torch.arange(members)
    out0 = torch.randn(members, HQ, D, generator=gen)
    lse0 = torch.randn(members, HQ, generator=gen)
    k_flat, v_flat = c["k_cache"].view(-1, HKV, D), c["v_cache"].view(-1, HKV, D)
    attn = TorchAttention(native=False)
    casc = _Cascade(rows, slots)
    outs = {}

    def fused() -> None:
        outs["c"] = out0.clone()
        kern.prefix_attention_merge_(
            q, c["k_cache"], c["v_cache"], slots, torch.tensor([0, prefix]), rows,
            torch.tensor([0, members]), outs["c"], lse0.clone(), 0.125,
        )  # fmt: skip

    def torch_path() -> None:
        outs["t"] = out0.clone()
        attn._merge_prefix(casc, q, k_flat, v_flat, outs["t"], lse0.clone(), 0.125)

    times = {"c_fused": median_ms(fused, reps), "torch": median_ms(torch_path, reps)}
    torch.testing.assert_close(outs["c"], outs["t"], atol=1e-4, rtol=1e-4)
    flops = 4.0 * HQ * D * members * prefix
    return dict(
        case=f"cascade prefix {prefix} keys x {members} rows",
        **times,
        c_gflops=flops / times["c_fused"] / 1e6,
    )


def bench_prefix(kern: cpu_kernels.CpuKernels, reps: int) -> list[dict]:
    return [prefix_case(kern, reps, m, p) for m, p in [(256, 496), (64, 300)]]


def decode_case(kern: cpu_kernels.CpuKernels, reps: int, n: int, keys: int, spread: int) -> dict:
    layers = 8  # a different cache per call, as the layers of one step
    cases = [paged_case(n, keys, 1, spread, seed=s) for s in range(layers)]
    seqs = torch.arange(n, dtype=torch.int32)
    out = torch.empty(n, HQ, D)

    def step() -> None:
        for c in cases:
            kern.paged_attention(**c, seqs=seqs, out=out, scale=0.125)

    ms = median_ms(step, reps) / layers
    kv_bytes = n * keys * 2 * HKV * D * 4
    return dict(
        case=f"decode {n} seqs x {keys} keys, cache x{spread}",
        per_token=ms,
        gb_per_s=kv_bytes / ms / 1e6,
    )


def bench_decode(kern: cpu_kernels.CpuKernels, reps: int) -> list[dict]:
    return [
        decode_case(kern, reps, *shape) for shape in [(128, 300, 1), (128, 300, 4), (256, 80, 4)]
    ]


def bench_sampler(kern: cpu_kernels.CpuKernels, reps: int) -> list[dict]:
    gen = torch.Generator().manual_seed(2)
    r = 512
    logits = torch.randn(r, VOCAB, generator=gen) * 3
    temperature = torch.full((r,), 0.8)
    key = torch.randint(0, 2**62, (r,), generator=gen)
    pos = torch.randint(0, 1000, (r,), generator=gen)

    def torch_path() -> torch.Tensor:
        probs = torch.softmax(logits / temperature[:, None], dim=-1)
        exp = noise.uniform_noise(key, pos, VOCAB).neg_().log1p_().neg_()
        return probs.div_(exp).argmax(-1)

    native = noise.SamplerKernels(uniform_noise=kern.uniform_noise, race_draw=kern.race_draw)
    c_tokens = sampler._draw_plain(logits, temperature, key, pos, native)
    agree = float((c_tokens == torch_path()).float().mean())
    times = {
        "c_fused": median_ms(
            lambda: sampler._draw_plain(logits, temperature, key, pos, native), reps
        ),
        "torch": median_ms(torch_path, reps),
    }
    return [dict(case=f"sampler draw {r} x {VOCAB}, temperature only", **times, agree=agree)]


def bf16_case(
    kernels: dict[str, cpu_kernels.CpuKernels],
    reps: int,
    heads: tuple[int, int],
    n: int,
    keys: int,
    q_len: int,
    spread: int,
) -> dict:
    """One attention shape through the paged cache: the fp32 kernel, the bf16 kernels of both
    builds, and the PyTorch bf16 path (its whole forward: the K/V store, gathers, SDPA)."""
    hq, hkv = heads
    gen = torch.Generator().manual_seed(0)
    per = -(-keys // BS)
    num_blocks = n * per * spread + 1
    q32 = torch.randn(n * q_len, hq, D, generator=gen)
    cache32 = torch.randn(2, num_blocks, BS, hkv, D, generator=gen)
    tables = torch.randperm(num_blocks - 1, generator=gen)[: n * per].view(n, per) + 1
    pos = torch.arange(keys - q_len, keys)
    slots = (tables[:, pos // BS] * BS + pos % BS).reshape(-1)  # [n * q_len]: the new tokens
    meta = AttentionMetadata(
        slot_mapping=slots,
        block_tables=tables.to(torch.int32),
        cu_seqlens_q=torch.arange(n + 1, dtype=torch.int32) * q_len,
        seq_lens=torch.full((n,), keys, dtype=torch.int32),
        max_seqlen_q=q_len,
        max_seqlen_k=keys,
    )
    seqs = torch.arange(n, dtype=torch.int32)
    tiled = q_len * hq // hkv >= 16  # what a native plan would pick
    times, outs = {}, {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16),
                        ("bf16_portable", torch.bfloat16)):  # fmt: skip
        kern, q, cache = kernels[name], q32.to(dtype), cache32.to(dtype)
        out = torch.empty_like(q)

        def run(kern=kern, q=q, cache=cache, out=out) -> None:
            kern.paged_attention(
                q, cache[0], cache[1], meta.block_tables, meta.cu_seqlens_q, meta.seq_lens,
                seqs, out, 0.125, tiled=tiled,
            )  # fmt: skip

        times[name] = median_ms(run, reps)
        outs[name] = out.float()
    q, cache = q32.bfloat16(), cache32.bfloat16()
    kv = cache.view(2, -1, hkv, D)[:, slots]  # the new tokens' K/V, stored again by forward
    attn = TorchAttention(native=False)
    plan = attn.prepare(meta, cache[None], hq)
    times["torch_bf16"] = median_ms(
        lambda: attn.forward(q, kv[0], kv[1], cache[0], cache[1], plan, 0.125), reps
    )
    ref = attn.forward(q, kv[0], kv[1], cache[0], cache[1], plan, 0.125).float()
    # what a bf16 native plan runs (the kernels, or SDPA for long fresh prefills)
    native_attn = TorchAttention(native=True)
    native_plan = native_attn.prepare(meta, cache[None], hq)
    times["bf16_plan"] = median_ms(
        lambda: native_attn.forward(q, kv[0], kv[1], cache[0], cache[1], native_plan, 0.125),
        reps,
    )
    for name in ("bf16", "bf16_portable"):
        torch.testing.assert_close(outs[name], ref, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(outs["fp32"], ref, atol=5e-2, rtol=5e-2)
    kind = "decode" if q_len == 1 else "prefill" if q_len == keys else "extend"
    return dict(
        case=f"bf16 {hq}:{hkv} {kind} {n} x {q_len} new of {keys} keys"
        + ("" if spread == 1 else f", cache x{spread}")
        + (", tiled" if tiled else ", per token"),
        **times,
    )


def bench_bf16(reps: int) -> list[dict]:
    kernels = {"fp32": cpu_kernels.load(), "bf16_portable": cpu_kernels.build(avx512bf16=False)}
    kernels["bf16"] = kernels["fp32"]
    if kernels["fp32"] is None or kernels["bf16_portable"] is None:
        raise SystemExit("the C kernels cannot be built here")
    print(f"bf16 kernels: AVX512-BF16 {kernels['bf16'].avx512bf16}")  # type: ignore[union-attr]
    shapes = [(128, 300, 1, 4), (256, 80, 1, 4), (2, 1024, 1024, 1), (32, 300, 40, 1)]
    return [
        bf16_case(kernels, reps, heads, *shape)  # type: ignore[arg-type]
        for heads in ((HQ, HKV), (14, 2))
        for shape in shapes
    ]


def int8_case(kern: cpu_kernels.CpuKernels, reps: int, n: int, keys: int) -> dict:
    """Decode attention of n sequences of ``keys`` keys (14:2 heads of 64, blocks in random
    order), one cache per layer of 4 so the caches do not stay in the CPU's caches, over: an
    fp32 cache (fp32 q), a bf16 cache (bf16 q), and int8 caches with fp32 and with bf16 q."""
    hq, hkv, layers = 14, 2, 4
    gen = torch.Generator().manual_seed(0)
    per = -(-keys // BS)
    num_blocks = n * per + 1
    tables = (torch.randperm(num_blocks - 1, generator=gen)[: n * per] + 1).view(n, per)
    q32 = torch.randn(n, hq, D, generator=gen)
    caches: dict[str, list[tuple]] = {"fp32": [], "bf16": [], "int8": []}
    slots = torch.arange(num_blocks * BS)
    for _ in range(layers):
        k = torch.randn(num_blocks, BS, hkv, D, generator=gen)
        v = torch.randn(num_blocks, BS, hkv, D, generator=gen)
        caches["fp32"].append((k, v, None, None))
        caches["bf16"].append((k.bfloat16(), v.bfloat16(), None, None))
        kq, vq = torch.empty_like(k, dtype=torch.int8), torch.empty_like(v, dtype=torch.int8)
        ks, vs = torch.empty(num_blocks, BS, hkv), torch.empty(num_blocks, BS, hkv)
        kern.store_kv(k.view(-1, hkv, D), v.view(-1, hkv, D), kq, vq, slots, ks, vs)
        caches["int8"].append((kq, vq, ks, vs))
    bt = tables.to(torch.int32)
    cu = torch.arange(n + 1, dtype=torch.int32)
    lens = torch.full((n,), keys, dtype=torch.int32)
    seqs = torch.arange(n, dtype=torch.int32)
    times, outs, gbs = {}, {}, {}
    for name, cache, qdt in (("fp32", "fp32", torch.float32), ("bf16", "bf16", torch.bfloat16),
                             ("int8_q_fp32", "int8", torch.float32),
                             ("int8_q_bf16", "int8", torch.bfloat16)):  # fmt: skip
        q = q32.to(qdt)
        out = torch.empty_like(q)

        def step(cache: str = cache, q: Tensor = q, out: Tensor = out) -> None:
            for kc, vc, ks, vs in caches[cache]:
                kern.paged_attention(
                    q, kc, vc, bt, cu, lens, seqs, out, 0.125, k_scale=ks, v_scale=vs
                )

        times[name] = median_ms(step, reps) / layers
        outs[name] = out.float()
        elem = {"fp32": 4, "bf16": 2, "int8": 1}[cache]
        read = n * keys * 2 * hkv * (D * elem + (4 if cache == "int8" else 0))
        gbs[f"{name}_gb_s"] = read / times[name] / 1e6
    # the last layer's output, against the fp32 cache's
    for name in ("bf16", "int8_q_fp32", "int8_q_bf16"):
        torch.testing.assert_close(outs[name], outs["fp32"], atol=3e-2, rtol=3e-2)
    return dict(
        case=f"int8 decode {n} seqs x {keys} keys, {hq}:{hkv} x {D}, per token",
        **times,
        fp32_over_int8=times["fp32"] / times["int8_q_fp32"],
        bf16_over_int8=times["bf16"] / times["int8_q_bf16"],
        **gbs,
    )


def bench_int8(reps: int) -> list[dict]:
    kern = cpu_kernels.load()
    if kern is None:
        raise SystemExit("the C kernels cannot be built here")
    return [int8_case(kern, reps, 16, keys) for keys in (2048, 3000)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--bf16", action="store_true", help="also the bf16 rows")
    parser.add_argument("--bf16-only", action="store_true", help="only the bf16 rows")
    parser.add_argument("--int8", action="store_true", help="also the int8 KV cache rows")
    parser.add_argument("--int8-only", action="store_true", help="only the int8 rows")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kern = cpu_kernels.load()
    if kern is None:
        raise SystemExit("the C kernels cannot be built here (no C compiler, or disabled)")
    results = (
        []
        if args.bf16_only or args.int8_only
        else bench_prefill(kern, args.reps)
        + bench_prefix(kern, args.reps)
        + bench_decode(kern, args.reps)
        + bench_sampler(kern, args.reps)
    )
    if args.bf16 or args.bf16_only:
        results += bench_bf16(args.reps)
    if args.int8 or args.int8_only:
        results += bench_int8(args.reps)
    for row in results:
        cells = [f"{k} {v:.2f}" if isinstance(v, float) else str(v) for k, v in row.items()]
        print(" | ".join(cells))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(dict(threads=args.threads, results=results), indent=1))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
