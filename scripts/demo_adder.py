#!/usr/bin/env python
"""The quick start's model: a tiny Llama trained here to add two numbers, so that what it writes
can be checked.

    python scripts/demo_adder.py train demo/adder          # about a minute on two CPU cores
    python scripts/demo_adder.py data demo/adder.parquet   # 200 questions with their answers
    python scripts/demo_adder.py check out/quickstart out/quickstart-greedy

The model reads ``<s>14+9=`` and answers ``23</s>``. Its tokenizer has one token per byte (a
byte-level BPE without merges), so digits are read one at a time. Training is deterministic for a
given torch build and thread count: the same seed gives the same model on the same machine.
``check`` counts right answers in output folders written by jobs/quickstart.yaml (which keeps the
``answer`` column).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # runnable without installing

from batchgen.tiny_model import (  # noqa: E402
    BOS_ID,
    END_OF_TURN_ID,
    EOS_ID,
    PAD_ID,
    SPECIAL_TOKENS,
    wrap_tokenizer,
)

MAX_OPERAND = 19  # questions are a+b with 0 <= a, b <= MAX_OPERAND


def question(a: int, b: int) -> str:
    return f"{a}+{b}="


def byte_tokenizer() -> Any:
    """A ``PreTrainedTokenizerFast`` with the special tokens of batchgen.tiny_model and one token
    per byte (BOS prepended to every text, the same chat template)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {tok: i for i, tok in enumerate([*SPECIAL_TOKENS, *alphabet])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return wrap_tokenizer(tok)


def _batch(tokenizer: Any, rng: random.Random, size: int) -> tuple[Any, Any]:
    """input_ids ``[size, T]`` (right-padded) and labels ``[size, T]``: the answer and EOS are
    learned, the question and padding are not (-100)."""
    import torch

    seqs, starts = [], []
    for _ in range(size):
        a, b = rng.randint(0, MAX_OPERAND), rng.randint(0, MAX_OPERAND)
        prompt = tokenizer(question(a, b))["input_ids"]
        answer = tokenizer(str(a + b), add_special_tokens=False)["input_ids"] + [EOS_ID]
        seqs.append(prompt + answer)
        starts.append(len(prompt))
    width = max(map(len, seqs))
    ids = torch.full((size, width), PAD_ID, dtype=torch.long)
    labels = torch.full((size, width), -100, dtype=torch.long)
    for i, (seq, start) in enumerate(zip(seqs, starts, strict=True)):
        ids[i, : len(seq)] = torch.tensor(seq)
        labels[i, start : len(seq)] = torch.tensor(seq[start:])
    return ids, labels


def _all_right(model: Any, ids: Any, labels: Any) -> Any:
    """``[B]`` bool: every answer token (and EOS) is the argmax after its prefix. For these
    prompts that is exactly "greedy decoding answers right"."""
    import torch

    with torch.no_grad():
        predicted = model(input_ids=ids).logits[:, :-1].argmax(-1)  # [B, T-1]
    target = labels[:, 1:]
    return ((predicted == target) | (target == -100)).all(-1)


def train(
    out_dir: Path,
    max_steps: int = 1000,
    batch_size: int = 64,
    lr: float = 3e-3,
    seed: int = 0,
    target: float = 0.98,
) -> None:
    """Train until ``target`` of 256 held-out questions are answered right (checked every 50
    steps), or ``max_steps``; write the model and tokenizer to ``out_dir``."""
    import torch
    import transformers
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    torch.manual_seed(seed)
    tokenizer = byte_tokenizer()
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        architectures=["LlamaForCausalLM"],
    )
    model = transformers.LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    rng = random.Random(seed)
    held_out = _batch(tokenizer, random.Random(seed + 1000), 256)
    warmup = max(1, max_steps // 25)
    start = time.monotonic()
    for step in range(max_steps):
        # linear warm-up, then linear decay to 5% of lr at max_steps
        scale = min(1.0, (step + 1) / warmup) * max(0.05, 1.0 - step / max_steps)
        for group in optimizer.param_groups:
            group["lr"] = lr * scale
        ids, labels = _batch(tokenizer, rng, batch_size)
        loss = model(input_ids=ids, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if (step + 1) % 50 == 0 or step + 1 == max_steps:
            right = _all_right(model, *held_out).float().mean().item()
            print(
                f"step {step + 1}  loss {loss.item():.3f}  held-out right {100 * right:.1f}%  "
                f"{time.monotonic() - start:.0f}s",
                flush=True,
            )
            if right >= target:
                break
    model.generation_config.eos_token_id = [EOS_ID, END_OF_TURN_ID]
    model.generation_config.bos_token_id = BOS_ID
    model.generation_config.pad_token_id = PAD_ID
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    print(f"wrote the adder model to {out_dir}")


def write_questions(path: Path, rows: int, seed: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(seed)
    pairs = [(rng.randint(0, MAX_OPERAND), rng.randint(0, MAX_OPERAND)) for _ in range(rows)]
    table = pa.table(
        {
            "id": list(range(rows)),
            "prompt": [question(a, b) for a, b in pairs],
            "answer": [str(a + b) for a, b in pairs],
        }
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path)
    print(f"wrote {rows} questions to {path}")


def score(rows: list[dict[str, Any]]) -> dict[str, int]:
    """Counts over output rows (``id``, ``text``, ``answer``): samples, right samples,
    questions, questions with at least one right sample, and questions whose most frequent
    answer (ties broken by the smallest text) is right."""
    by_id: dict[Any, list[tuple[str, str]]] = {}
    for row in rows:
        by_id.setdefault(row["id"], []).append(((row["text"] or "").strip(), row["answer"]))
    right = sum(text == answer for samples in by_id.values() for text, answer in samples)
    any_right = sum(any(t == a for t, a in samples) for samples in by_id.values())
    majority = 0
    for samples in by_id.values():
        counts = Counter(text for text, _ in samples)
        top = min(counts, key=lambda text: (-counts[text], text))
        majority += top == samples[0][1]
    return {
        "samples": sum(map(len, by_id.values())),
        "right": right,
        "questions": len(by_id),
        "any_right": any_right,
        "majority_right": majority,
    }


def check(folders: list[Path], examples: int) -> int:
    import pyarrow.dataset as ds

    for folder in folders:
        table = ds.dataset(folder, format="parquet").to_table()
        if "answer" not in table.column_names:
            print(f"{folder}: no `answer` column (run jobs/quickstart.yaml, which keeps it)")
            return 2
        rows = table.sort_by([("id", "ascending"), ("sample_index", "ascending")]).to_pylist()
        s = score(rows)
        n = s["samples"] // max(1, s["questions"])
        print(
            f"{folder}: {s['right']}/{s['samples']} answers right "
            f"({100 * s['right'] / max(1, s['samples']):.1f}%, {n} per question)"
        )
        if n > 1:
            print(
                f"  questions with a right answer among the {n}: {s['any_right']}/"
                f"{s['questions']}; right by majority vote: {s['majority_right']}/"
                f"{s['questions']}"
            )
        for row in rows[:examples]:
            mark = "right" if (row["text"] or "").strip() == row["answer"] else "WRONG"
            print(f"  id {row['id']} sample {row['sample_index']}: {row['text']!r} ({mark})")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train the model and write it as a Hugging Face folder")
    t.add_argument("out_dir", type=Path)
    t.add_argument("--max-steps", type=int, default=1000)
    t.add_argument("--batch-size", type=int, default=64)
    t.add_argument("--lr", type=float, default=3e-3)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--target", type=float, default=0.98, help="held-out share right to stop at")
    d = sub.add_parser("data", help="write the questions (id, prompt, answer) as Parquet")
    d.add_argument("path", type=Path)
    d.add_argument("--rows", type=int, default=200)
    d.add_argument("--seed", type=int, default=1)
    c = sub.add_parser("check", help="count right answers in output folders")
    c.add_argument("folders", type=Path, nargs="+")
    c.add_argument("--examples", type=int, default=4, help="rows to print per folder")
    args = p.parse_args(argv)
    if args.command == "train":
        train(args.out_dir, args.max_steps, args.batch_size, args.lr, args.seed, args.target)
    elif args.command == "data":
        write_questions(args.path, args.rows, args.seed)
    else:
        return check(args.folders, args.examples)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
