#!/usr/bin/env python
"""Write a tiny random Hugging Face model folder (weights + tokenizer), offline.

Example (the benchmark model):

    python scripts/make_tiny_model.py models/bench-llama --layers 8 --hidden 512 --heads 8 \\
        --kv-heads 2 --intermediate 1536 --vocab 4096 --prompts data/prompts.parquet
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # runnable without installing

from batchgen.tiny_model import ARCHITECTURES, make_tiny_model, write_prompts_parquet  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("out_dir", type=Path, help="folder to write (created if missing)")
    p.add_argument("--arch", choices=sorted(ARCHITECTURES), default="llama")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=None, help="default: hidden / heads")
    p.add_argument("--intermediate", type=int, default=128)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--max-positions", type=int, default=2048)
    p.add_argument("--tie", action="store_true", help="tie the LM head to the embedding")
    p.add_argument("--init-range", type=float, default=0.5, help="std of the random weights")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sharded", action="store_true", help="write several safetensors shards")
    p.add_argument("--prompts", type=Path, default=None, help="also write demo prompts (Parquet)")
    p.add_argument("--num-prompts", type=int, default=64)
    args = p.parse_args(argv)

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    out = make_tiny_model(
        args.out_dir,
        args.arch,
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_heads=args.heads,
        num_kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        intermediate_size=args.intermediate,
        vocab_size=args.vocab,
        max_position_embeddings=args.max_positions,
        tie_word_embeddings=args.tie,
        seed=args.seed,
        initializer_range=args.init_range,
        sharded=args.sharded,
    )
    print(f"wrote {args.arch} model to {out}")
    if args.prompts is not None:
        write_prompts_parquet(args.prompts, args.num_prompts, seed=args.seed)
        print(f"wrote {args.num_prompts} prompts to {args.prompts}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
