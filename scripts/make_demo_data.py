"""Write the quick-start prompts: rows that share a long system prompt, with a `topic` column.

Usage: python scripts/make_demo_data.py demo/prompts.parquet [--rows 200]
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.tiny_model import make_words

TOPICS = ("weather", "history", "cooking", "travel")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", type=Path)
    parser.add_argument("--rows", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    rng = random.Random(args.seed)
    system = "You are a helpful assistant. " + " ".join(make_words(120, seed=args.seed))
    ids, prompts, topics = [], [], []
    for i in range(args.rows):
        topic = rng.choice(TOPICS)
        question = " ".join(make_words(rng.randint(5, 30), seed=args.seed * 7919 + i))
        ids.append(i)
        topics.append(topic)
        prompts.append(f"{system}\nTopic: {topic}\nQuestion: {question}\nAnswer:")
    args.path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"id": ids, "topic": topics, "prompt": prompts}), args.path)
    print(f"wrote {args.rows} prompts to {args.path}")


if __name__ == "__main__":
    main()
