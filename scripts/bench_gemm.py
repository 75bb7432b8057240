"""GEMM speed of the linear layers at the engine's step shapes: oneDNN-packed bf16
(batchgen/model/onednn_linear.py) vs ``F.linear`` bf16, and MKL-packed fp32
(batchgen/model/packed_linear.py) for reference, on the benchmark model's layers and a
Qwen2.5-0.5B-class model's.

    python scripts/bench_gemm.py [--threads 2] [--models bench,qwen] [--ms 1,8,64]
                                 [--hints] [--invariance] [--json bench-out/gemm.json]

- the table: GFLOP/s per layer and row count M, of the product and of the residual form
  ``x += h @ W^T`` (``Linear.add_``: ``addmm_``; ``OneDnnLinear.add_``: the fused add), best of
  several calls (the machine is shared and noisy, so compare columns within one run); a cell is left out where the output would
  exceed ``--max-out`` elements (the LM head only ever sees one row per sequence);
- ``--hints``: the packed bf16 GEMM with the weight reordered for different row counts (the
  batch-size hint of ``_reorder_linear_weight``), including the exact M;
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

from batchgen.model import onednn_linear, packed_linear

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


def table(models: list[str], ms: list[int], max_out: int, budget: float) -> list[dict]:
    onednn = onednn_linear.load()
    mkl = packed_linear.load()
    rows = []
    print(f"{'layer':>16} {'N':>6} {'K':>5} {'M':>5}  F.linear bf16  packed bf16  ratio  "
          "MKL fp32  addmm_ bf16  packed add_")  # fmt: skip
    for model in models:
        for name, n, k, bias in MODELS[model]:
            w, b = layer(n, k, bias, seed=n + k)
            packed = onednn.pack(w) if onednn else None
            w32, b32 = w.float(), None if b is None else b.float()
            p32 = packed_linear.pack(mkl, w32) if mkl else None
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
                row = dict(model=model, layer=name, n=n, k=k, m=m, flinear_bf16=plain,
                           packed_bf16=fast, mkl_fp32=ref, addmm_bf16=plain_add,
                           packed_add_bf16=fast_add)  # fmt: skip
                rows.append(row)
                print(f"{model + ' ' + name:>16} {n:>6} {k:>5} {m:>5}  {plain:>13.0f}  "
                      f"{fast:>11.0f}  {fast / plain:>5.2f}  {ref:>8.0f}  {plain_add:>10.0f}  "
                      f"{fast_add:>10.0f}", flush=True)  # fmt: skip
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
    ap.add_argument("--budget", type=float, default=0.2, help="seconds of calls per cell")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    models = args.models.split(",")
    ms = [int(m) for m in args.ms.split(",")]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"oneDNN bf16 packing: {onednn_linear.load() is not None}, "
          f"MKL fp32 packing: {packed_linear.load() is not None}")  # fmt: skip
    result: dict = {}
    with torch.inference_mode():
        if not args.no_table:
            result["table"] = table(models, ms, args.max_out, args.budget)
        if args.hints:
            result["hints"] = hints(models, ms, args.max_out, args.budget)
        if args.invariance:
            result["invariance"] = invariance(models, ms, args.max_out)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
