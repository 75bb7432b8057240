"""Quality of a quantized KV cache against the float32 cache: teacher-forced next-token
distributions of the same model and tokens, compared position by position.

Usage:
  python scripts/kv_quality.py [--model real|small|PATH] [--kv-cache-dtypes int8]
                               [--seqs 4] [--seq-len 768] [--chunk 256] [--threads N]

``real`` is bench.py's Qwen2.5-0.5B-geometry model (random weights, init 0.02; made under
bench-out/ on first use), ``small`` its 8-layer Llama. Token sequences are the tokenized text of
batchgen's word generator. Each sequence is prefilled in chunks of ``--chunk`` tokens through the
engine's model and attention backend (torch) with a cache of each dtype, so later chunks read the
earlier ones from the (quantized) cache. Prints, per KV cache dtype: mean and max KL divergence
KL(p_fp32 || p_kv) over positions (nats), greedy (argmax) agreement, and the max |logit
difference|. The model computes in float32 in every run; only the cache differs.

``teacher_forced_logits`` and ``compare_logits`` are also used by tests/test_kv_quant_quality.py.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent


def load(model_dir: Path, dtype: torch.dtype = torch.float32) -> tuple[Any, Any]:
    """(model, ModelInfo) on the CPU with the torch attention backend."""
    from batchgen.model.attention import make_attention_backend
    from batchgen.model.loader import load_model

    return load_model(model_dir, torch.device("cpu"), dtype, make_attention_backend("torch"))


@torch.inference_mode()
def teacher_forced_logits(
    model: Any,
    info: Any,
    seq: list[int],
    kv_dtype: torch.dtype,
    chunk: int = 256,
    block_size: int = 16,
) -> torch.Tensor:
    """Logits ``[len(seq), vocab]`` fp32 of every position of ``seq``, prefilled in chunks of
    ``chunk`` tokens over a fresh paged cache of ``kv_dtype`` (int8 / float8_e4m3fn: quantized,
    with its scales)."""
    from batchgen.model.attention import AttentionMetadata

    n = len(seq)
    num_blocks = -(-n // block_size)
    shape = (info.num_layers, 2, num_blocks, block_size, info.num_kv_heads)
    kv_cache = torch.zeros(*shape, info.head_dim, dtype=kv_dtype)
    scales = None
    if kv_dtype in (torch.int8, torch.float8_e4m3fn):
        scales = torch.zeros(*shape, dtype=torch.float32)
    extra = {} if scales is None else {"kv_scales": scales}
    ids = torch.tensor(seq, dtype=torch.int64)
    table = torch.arange(num_blocks, dtype=torch.int32)[None]  # blocks 0..: slot = position
    out = []
    for start in range(0, n, chunk):
        end = min(n, start + chunk)
        meta = AttentionMetadata(
            slot_mapping=torch.arange(start, end, dtype=torch.int64),
            block_tables=table,
            cu_seqlens_q=torch.tensor([0, end - start], dtype=torch.int32),
            seq_lens=torch.tensor([end], dtype=torch.int32),
            max_seqlen_q=end - start,
            max_seqlen_k=end,
        )
        pos = torch.arange(start, end, dtype=torch.int64)
        hidden = model(ids[start:end], pos, kv_cache, meta, **extra)
        out.append(model.compute_logits(hidden))
    return torch.cat(out)


def compare_logits(ref: list[torch.Tensor], got: list[torch.Tensor]) -> dict[str, float]:
    """Over all positions of all sequences: ``kl_mean`` / ``kl_max`` of KL(softmax(ref) ||
    softmax(got)) in nats, ``greedy_agreement`` (share of positions with the same argmax),
    ``max_logit_diff`` (max |ref - got|) and ``positions``. Computed in float64, 128 positions
    at a time (a 150k vocabulary's logits are large)."""
    positions = 0
    kl_sum = kl_max = agree = diff = 0.0
    for r_seq, g_seq in zip(ref, got, strict=True):
        for lo in range(0, r_seq.shape[0], 128):
            r, g = r_seq[lo : lo + 128].double(), g_seq[lo : lo + 128].double()
            lr, lg = torch.log_softmax(r, -1), torch.log_softmax(g, -1)
            kl = (lr.exp() * (lr - lg)).sum(-1).clamp_min(0)  # [positions]
            positions += r.shape[0]
            kl_sum += kl.sum().item()
            kl_max = max(kl_max, kl.max().item())
            agree += (r.argmax(-1) == g.argmax(-1)).sum().item()
            diff = max(diff, (r - g).abs().max().item())
    return {
        "positions": positions,
        "kl_mean": kl_sum / positions,
        "kl_max": kl_max,
        "greedy_agreement": agree / positions,
        "max_logit_diff": diff,
    }


def merge(a: dict[str, float] | None, b: dict[str, float]) -> dict[str, float]:
    """Two ``compare_logits`` results as one over both sets of positions."""
    if a is None:
        return b
    n = a["positions"] + b["positions"]
    return {
        "positions": n,
        "kl_mean": (a["kl_mean"] * a["positions"] + b["kl_mean"] * b["positions"]) / n,
        "kl_max": max(a["kl_max"], b["kl_max"]),
        "greedy_agreement": (
            a["greedy_agreement"] * a["positions"] + b["greedy_agreement"] * b["positions"]
        )
        / n,
        "max_logit_diff": max(a["max_logit_diff"], b["max_logit_diff"]),
    }


def token_sequences(tokenizer: Any, count: int, length: int, seed: int = 0) -> list[list[int]]:
    """``count`` token sequences of exactly ``length`` ids: batchgen's word generator's text."""
    from batchgen.tiny_model import make_words

    seqs = []
    for i in range(count):
        ids: list[int] = []
        k = 0
        while len(ids) < length:
            text = " ".join(make_words(256, seed=seed * 1000 + i * 100 + k))
            ids += tokenizer(text, add_special_tokens=not ids)["input_ids"]
            k += 1
        seqs.append(ids[:length])
    return seqs


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="real", help="real, small, or a model folder")
    parser.add_argument("--kv-cache-dtypes", default="int8", help="comma-separated: int8,...")
    parser.add_argument("--seqs", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=768)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=ROOT / "bench-out")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from transformers import AutoTokenizer

    from batchgen.plan import KV_CACHE_DTYPES

    if args.model in ("real", "small"):
        sys.path.insert(0, str(ROOT / "scripts"))
        import bench

        folder = args.out / ("model" if args.model == "small" else f"model-{args.model}")
        model_dir = bench.ensure_model(folder, bench.MODEL_SPECS[args.model])
    else:
        model_dir = Path(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    seqs = token_sequences(tokenizer, args.seqs, args.seq_len)
    model, info = load(model_dir)
    print(
        f"[kv_quality] {model_dir}: {info.num_layers} layers, {info.num_heads}:"
        f"{info.num_kv_heads} heads of {info.head_dim}; {args.seqs} x {args.seq_len} positions, "
        f"chunks of {args.chunk}",
        flush=True,
    )
    names = [x.strip() for x in args.kv_cache_dtypes.split(",") if x.strip()]
    found: dict[str, dict[str, float] | None] = dict.fromkeys(names)
    seconds = dict.fromkeys(["float32", *names], 0.0)
    for seq in seqs:  # one sequence's logits at a time: [seq_len, vocab] fp32 each
        t = time.perf_counter()
        ref = teacher_forced_logits(model, info, seq, torch.float32, args.chunk)
        seconds["float32"] += time.perf_counter() - t
        for name in names:
            t = time.perf_counter()
            got = teacher_forced_logits(model, info, seq, KV_CACHE_DTYPES[name], args.chunk)
            seconds[name] += time.perf_counter() - t
            found[name] = merge(found[name], compare_logits([ref], [got]))
    print(f"[kv_quality] float32 cache: {seconds['float32']:.1f}s", flush=True)
    for name in names:
        m = found[name]
        assert m is not None
        kv = KV_CACHE_DTYPES[name]
        print(
            f"[kv_quality] {name} vs float32 cache ({seconds[name]:.1f}s): "
            f"{m['positions']} positions, KL mean {m['kl_mean']:.3e} max {m['kl_max']:.3e} nats, "
            f"greedy agreement {m['greedy_agreement']:.4f}, max |logit diff| "
            f"{m['max_logit_diff']:.3e}; bytes/token {info.kv_bytes_per_token(torch.float32)} -> "
            f"{info.kv_bytes_per_token(kv)}",
            flush=True,
        )


if __name__ == "__main__":
    main()
