"""GEMM speed of the linear layers at the engine's step shapes: oneDNN-packed bf16
(batchgen/model/onednn_linear.py) and the C kernels' AVX512-BF16 GEMM
(batchgen/model/kernel_linear.py, where the CPU has AVX512-BF16) vs ``F.linear`` bf16, and
MKL-packed fp32 (batchgen/model/packed_linear.py) for reference, on the benchmark model's
layers, a Qwen2.5-0.5B-class model's and SmolLM2-135M's.

    python scripts/bench_gemm.py [--threads 2] [--models bench,qwen,smollm2] [--ms 1,8,64]
                                 [--hints] [--invariance] [--stream 30]
                                 [--stream-dtype bfloat16|float32]
                                 [--json bench-out/gemm.json]

- the table: GFLOP/s per layer and row count M, of the product and of the residual form
  ``x += h @ W^T`` (``Linear.add_``: ``addmm_``; ``OneDnnLinear.add_``: the fused add), best of
  several calls (the machine is shared and noisy, so compare columns within one run); a cell is left out where the output would
  exceed ``--max-out`` elements (the LM head only ever sees one row per sequence);
- ``--hints``: the packed bf16 GEMM with the weight reordered for different row counts (the
  batch-size hint of ``_reorder_linear_weight``), including the exact M;
- ``--stream L``: a whole model's projections as a step runs them (qkv, o, gate_up, down of L
  layers, every layer's weights distinct: read from memory, not cache, when they exceed it),
  oneDNN-packed against the C kernels' GEMM (``--stream-dtype``: bf16, the AVX512-BF16 one, or
  fp32, the FMA one), milliseconds per pass and their ratio per M;
- ``--invariance``: for each layer, the row counts M at which the first rows of a product
  differ (bitwise) from the same rows computed one at a time, packed and ``F.linear``; and how
  often an output differs from ``(x.float() @ w.float().t()).bfloat16()`` (one rounding of an
  fp32 sum), with the largest difference over one bf16 place plus the fp32 order spread.

Not a test: slow-ish (minutes at the default settings).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from batchgen.model import cpu_kernels, kernel_linear, onednn_linear, packed_linear

# (layer, out_features N, in_features K, bias)
MODELS: dict[str, list[tuple[str, int, int, bool]]] = {
    "bench": [  # hidden 512, 8 q heads + 2 + 2 kv heads of 64, intermediate 1536, vocab 4096
        ("qkv", 768, 512, False),
        ("o", 512, 512, False),
        ("gate_up", 3072, 512, False),
        ("down", 512, 1536, False),
        ("lm_head", 4096, 512, False),
    ],
    "qwen": [  # Qwen2.5-0.5B: hidden 896, 14:2 heads of 64, intermediate 4864, vocab 151936
        ("qkv", 1152, 896, True),
        ("o", 896, 896, False),
        ("gate_up", 9728, 896, False),
        ("down", 896, 4864, False),
        ("lm_head", 151936, 896, False),
    ],
    "smollm2": [  # SmolLM2-135M: hidden 576, 9:3 heads of 64, intermediate 1536, vocab 49152
        ("qkv", 960, 576, False),
        ("o", 576, 576, False),
        ("gate_up", 3072, 576, False),
        ("down", 576, 1536, False),
        ("lm_head", 49152, 576, False),
    ],
}
MS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]
HINTS: list[int | None] = [None, 1, 32, 256, 4096]


def best_seconds(fn: Callable[[], object], budget: float, max_reps: int = 200) -> float:
    """The fastest of at least 3 calls (after a warm-up), more while within ``budget`` s."""
    fn()
    best, spent, reps = float("inf"), 0.0, 0
    while reps < 3 or (spent < budget and reps < max_reps):
        t = time.perf_counter()
        fn()
        dt = time.perf_counter() - t
        best, spent, reps = min(best, dt), spent + dt, reps + 1
    return best


def gflops(m: int, n: int, k: int, seconds: float) -> float:
    return 2 * m * n * k / seconds / 1e9


def layer(n: int, k: int, bias: bool, seed: int) -> tuple[Tensor, Tensor | None]:
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=gen) * k**-0.5).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16() if bias else None
    return w, b


def mkl_linear(
    mkl: packed_linear.Mkl, x: Tensor, w: packed_linear.PackedWeight, out: Tensor, b: Tensor | None
) -> Tensor:
    """What batchgen's fp32 ``PackedLinear`` computes."""
    out = packed_linear.compute(mkl, x, w, out, 0.0)
    return out if b is None else out.add_(b)


def packed_add_(onednn: onednn_linear.OneDnn, res: Tensor, x: Tensor, packed: Tensor) -> Tensor:
    """What ``OneDnnLinear.add_`` computes (no bias): the fused add, copied into res."""
    return res.copy_(onednn.linear_add(x, res, packed, None))


def kernel_gemm(dtype: torch.dtype = torch.bfloat16) -> kernel_linear.KernelGemm | None:
    """The C kernels' GEMM in ``dtype`` (bf16: the AVX512-BF16 one), or None where the CPU or
    the kernels' build lacks it."""
    return kernel_linear.for_dtype(torch.device("cpu"), dtype, cpu_kernels.load())


def table(models: list[str], ms: list[int], max_out: int, budget: float) -> list[dict]:
    onednn = onednn_linear.load()
    mkl = packed_linear.load()
    dot = kernel_gemm()
    rows = []
    print(f"{'layer':>16} {'N':>6} {'K':>5} {'M':>5}  F.linear bf16  packed bf16  ratio  "
          "MKL fp32  addmm_ bf16  packed add_  dpbf16 bf16")  # fmt: skip
    for model in models:
        for name, n, k, bias in MODELS[model]:
            w, b = layer(n, k, bias, seed=n + k)
            packed = onednn.pack(w) if onednn else None
            w32, b32 = w.float(), None if b is None else b.float()
            p32 = packed_linear.pack(mkl, w32) if mkl else None
            pdot = dot.pack(w) if dot else None
            for m in ms:
                if m * n > max_out:
                    continue
                x = torch.randn(m, k).bfloat16()
                x32 = x.float()
                out32 = torch.empty(m, n)
                plain = gflops(m, n, k, best_seconds(partial(F.linear, x, w, b), budget))
                fast = float("nan")
                if onednn is not None and packed is not None:
                    secs = best_seconds(partial(onednn.linear, x, packed, b), budget)
                    fast = gflops(m, n, k, secs)
                ref = float("nan")
                if mkl is not None and p32 is not None:
                    secs = best_seconds(partial(mkl_linear, mkl, x32, p32, out32, b32), budget)
                    ref = gflops(m, n, k, secs)
                # the residual forms: Linear.add_ (addmm_) and OneDnnLinear.add_
                res = torch.randn(m, n).bfloat16()
                plain_add = gflops(m, n, k, best_seconds(partial(res.addmm_, x, w.t()), budget))
                fast_add = float("nan")
                if onednn is not None and packed is not None:
                    secs = best_seconds(partial(packed_add_, onednn, res, x, packed), budget)
                    fast_add = gflops(m, n, k, secs)
                dot_gf = float("nan")
                if dot is not None and pdot is not None:
                    secs = best_seconds(partial(dot.linear, x, pdot, n, b), budget)
                    dot_gf = gflops(m, n, k, secs)
                row = dict(model=model, layer=name, n=n, k=k, m=m, flinear_bf16=plain,
                           packed_bf16=fast, mkl_fp32=ref, addmm_bf16=plain_add,
                           packed_add_bf16=fast_add, dpbf16_bf16=dot_gf)  # fmt: skip
                rows.append(row)
                print(f"{model + ' ' + name:>16} {n:>6} {k:>5} {m:>5}  {plain:>13.0f}  "
                      f"{fast:>11.0f}  {fast / plain:>5.2f}  {ref:>8.0f}  {plain_add:>10.0f}  "
                      f"{fast_add:>10.0f}  {dot_gf:>11.0f}", flush=True)  # fmt: skip
    return rows


def stream(
    models: list[str], ms: list[int], layers: int, budget: float, dtype: torch.dtype
) -> list[dict]:
    """Milliseconds per pass over ``layers`` layers' projections (distinct weights per layer),
    oneDNN-packed and the C kernels' GEMM, in ``dtype``, per M."""
    onednn, dot = onednn_linear.load(dtype), kernel_gemm(dtype)
    assert onednn is not None and dot is not None, f"needs oneDNN and the C kernels' {dtype} GEMM"
    rows = []
    print(f"\nwhole passes over {layers} layers' projections (weights read from memory), "
          f"{dtype}: ms per pass")  # fmt: skip
    print(f"{'model':>10} {'M':>5}  {'oneDNN':>8}  {'kernel':>8}  ratio  kernel GFLOP/s")
    for model in models:
        shapes = [(n, k) for name, n, k, _ in MODELS[model] if name != "lm_head"]
        weights = [[layer(n, k, False, seed=i * 8 + j)[0].to(dtype)
                    for j, (n, k) in enumerate(shapes)] for i in range(layers)]  # fmt: skip
        by_onednn = [[onednn.pack(w) for w in ws] for ws in weights]
        by_dot = [[dot.pack(w) for w in ws] for ws in weights]
        del weights
        flops_per_row = 2 * layers * sum(n * k for n, k in shapes)
        for m in ms:
            xs = [torch.randn(m, k).to(dtype) for _, k in shapes]

            def run_onednn(xs: list[Tensor] = xs, packs: list = by_onednn) -> None:
                for layer_packs in packs:
                    for x, p in zip(xs, layer_packs, strict=True):
                        onednn.linear(x, p, None)

            def run_dot(xs: list[Tensor] = xs, packs: list = by_dot, shapes=shapes) -> None:
                for layer_packs in packs:
                    for x, p, (n, _) in zip(xs, layer_packs, shapes, strict=True):
                        dot.linear(x, p, n, None)

            a = best_seconds(run_onednn, budget * 5, max_reps=10)
            d = best_seconds(run_dot, budget * 5, max_reps=10)
            rows.append(dict(model=model, m=m, layers=layers, dtype=str(dtype), onednn_ms=a * 1e3,
                             kernel_ms=d * 1e3))  # fmt: skip
            print(f"{model:>10} {m:>5}  {a * 1e3:>8.2f}  {d * 1e3:>8.2f}  {a / d:>5.2f}  "
                  f"{flops_per_row * m / d / 1e9:>8.0f}", flush=True)  # fmt: skip
    return rows


def hints(models: list[str], ms: list[int], max_out: int, budget: float) -> list[dict]:
    """Packed bf16 GFLOP/s with the weight reordered for each hint, and for exactly M."""
    onednn = onednn_linear.load()
    assert onednn is not None, "oneDNN bf16 packing is unavailable here"
    ops = torch.ops.mkldnn
    rows = []
    print("\npacking hint: GFLOP/s by hint (None = oneDNN's choice; 'M' = repacked for each M)")
    print(f"{'layer':>16} {'M':>5}  " + "  ".join(f"{str(h):>6}" for h in HINTS) + "       M")
    for model in models:
        for name, n, k, bias in MODELS[model]:
            w, b = layer(n, k, bias, seed=n + k)
            by_hint = {h: ops._reorder_linear_weight(w, h) for h in HINTS}
            for m in ms:
                if m * n > max_out:
                    continue
                x = torch.randn(m, k).bfloat16()
                got = {}
                for h, p in [*by_hint.items(), ("M", ops._reorder_linear_weight(w, m))]:
                    s = best_seconds(partial(onednn.linear, x, p, b), budget / 2)
                    got[str(h)] = gflops(m, n, k, s)
                rows.append(dict(model=model, layer=name, n=n, k=k, m=m, gflops=got))
                print(f"{model + ' ' + name:>16} {m:>5}  "
                      + "  ".join(f"{v:>6.0f}" for v in got.values()), flush=True)  # fmt: skip
    return rows


def worst_over_bound(got: Tensor, ref: Tensor, x: Tensor, w: Tensor) -> float:
    """max |got - ref| / (one bf16 place of ref + the spread of fp32 sums of the K terms in any
    order, K * 2^-24 * sum |x_k w_k|): at most 1 where got is ref up to rounding."""
    scale = x.abs().double() @ w.abs().double().t()
    bound = torch.exp2(torch.floor(torch.log2(ref.double().abs().clamp_min(1e-30))) - 7)
    bound += x.shape[1] * 2**-24 * scale
    return ((got.double() - ref.double()).abs() / bound).max().item()


def invariance(models: list[str], ms: list[int], max_out: int, rows_checked: int = 64) -> dict:
    """Per layer: the M at which rows differ from the same rows computed alone, and the
    rounding of each path against one rounding of an fp32 sum."""
    onednn = onednn_linear.load()
    assert onednn is not None, "oneDNN bf16 packing is unavailable here"
    found: dict = {}
    print(f"\nrow invariance: M at which the first {rows_checked} rows differ from those rows "
          "computed one at a time (bitwise)")  # fmt: skip
    for model in models:
        for name, n, k, bias in MODELS[model]:
            w, b = layer(n, k, bias, seed=n + k + 1)
            packed = onednn.pack(w)
            fns: dict[str, Callable[[Tensor], Tensor]] = {
                "packed": lambda x, packed=packed, b=b: onednn.linear(x, packed, b),
                "F.linear": lambda x, w=w, b=b: F.linear(x, w, b),
            }
            big = max(m for m in ms if m * n <= max_out)
            x = torch.randn(big, k).bfloat16()
            head = x[:rows_checked]
            once = (head.float() @ w.float().t() + (0 if b is None else b.float())).bfloat16()
            entry: dict = {}
            for label, fn in fns.items():
                alone = torch.cat([fn(x[i : i + 1]) for i in range(rows_checked)])
                differ = []
                for m in ms:
                    if m <= big and not torch.equal(
                        fn(x[:m])[:rows_checked], alone[: min(m, rows_checked)]
                    ):
                        differ.append(m)
                entry[label] = dict(
                    differs_at_m=differ,
                    fraction_not_fp32_rounded_once=(alone != once).float().mean().item(),
                    worst_over_rounding_bound=worst_over_bound(alone, once, head, w),
                )
                print(f"{model + ' ' + name:>16} {label:>8}: differs at M={differ}; not fp32 "
                      f"rounded once: {entry[label]['fraction_not_fp32_rounded_once']:.1e} of "
                      f"outputs, worst |diff| / rounding bound "
                      f"{entry[label]['worst_over_rounding_bound']:.2f}", flush=True)  # fmt: skip
            found[f"{model} {name}"] = entry
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--models", default="bench,qwen")
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    ap.add_argument("--max-out", type=int, default=1 << 27, help="largest M*N timed")
    ap.add_argument("--no-table", action="store_true")
    ap.add_argument("--hints", action="store_true")
    ap.add_argument("--invariance", action="store_true")
    ap.add_argument("--stream", type=int, default=0, metavar="L", help="layers per pass")
    ap.add_argument("--stream-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--budget", type=float, default=0.2, help="seconds of calls per cell")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    models = args.models.split(",")
    ms = [int(m) for m in args.ms.split(",")]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"oneDNN bf16 packing: {onednn_linear.load() is not None}, "
          f"MKL fp32 packing: {packed_linear.load() is not None}, "
          f"AVX512-BF16 GEMM: {kernel_gemm() is not None}, "
          f"fp32 kernel GEMM: {kernel_gemm(torch.float32) is not None}")  # fmt: skip
    result: dict = {}
    with torch.inference_mode():
        if not args.no_table:
            result["table"] = table(models, ms, args.max_out, args.budget)
        if args.hints:
            result["hints"] = hints(models, ms, args.max_out, args.budget)
        if args.stream:
            result["stream"] = stream(
                models, ms, args.stream, args.budget, getattr(torch, args.stream_dtype)
            )
        if args.invariance:
            result["invariance"] = invariance(models, ms, args.max_out)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
