"""Write the example jobs' input files (jobs/*.yaml read them from demo/).

- prompts.parquet: rows sharing a long system prompt, with a `topic` column (no job in jobs/ reads
                   it; a prompt_column input to try settings on)
- fewshot.parquet: rows built from a handful of few-shot templates, shuffled (fewshot.yaml)
- chat.parquet:    chat conversations in a `messages` column with string ids (chat.yaml)
- extract.parquet: texts to extract records from, each with the JSON schema of its record in a
                   `schema` column (extract.yaml: structured outputs)

Usage: python scripts/make_demo_data.py demo [--rows 200]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.tiny_model import make_words

TOPICS = ("weather", "history", "cooking", "travel")


def words(n: int, seed: int) -> str:
    return " ".join(make_words(n, seed=seed))


def shared_system_prompt(rows: int, rng: random.Random) -> pa.Table:
    system = "You are a helpful assistant. " + words(120, seed=1)
    topics = [rng.choice(TOPICS) for _ in range(rows)]
    prompts = [
        f"{system}\nTopic: {t}\nQuestion: {words(rng.randint(5, 30), seed=100 + i)}\nAnswer:"
        for i, t in enumerate(topics)
    ]
    return pa.table({"id": list(range(rows)), "topic": topics, "prompt": prompts})


def few_shot(rows: int, rng: random.Random, num_templates: int = 4) -> pa.Table:
    templates = []
    for t in range(num_templates):
        shots = "\n".join(
            f"Q: {words(12, seed=1000 * t + s)}\nA: {words(20, seed=1000 * t + 500 + s)}"
            for s in range(4)
        )
        templates.append(f"Answer like the examples.\n{shots}\nQ: ")
    chosen = [rng.randrange(num_templates) for _ in range(rows)]
    prompts = [
        templates[t] + words(rng.randint(5, 20), seed=5000 + i) + "\nA:"
        for i, t in enumerate(chosen)
    ]
    return pa.table({"id": list(range(rows)), "template": chosen, "prompt": prompts})


def chat(rows: int, rng: random.Random) -> pa.Table:
    system = {"role": "system", "content": "Be brief. " + words(40, seed=2)}
    conversations = []
    for i in range(rows):
        turns = [system, {"role": "user", "content": words(rng.randint(4, 20), seed=9000 + i)}]
        if rng.random() < 0.3:
            turns += [
                {"role": "assistant", "content": words(10, seed=9500 + i)},
                {"role": "user", "content": words(6, seed=9800 + i)},
            ]
        conversations.append(turns)
    return pa.table(
        {"conversation_id": [f"conv-{i:04d}" for i in range(rows)], "messages": conversations}
    )


# The record kinds of extract.parquet: a row's `schema` is the JSON schema of its kind.
EXTRACT_SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "product": {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 32},
            "price": {"type": "number", "minimum": 0},
            "in_stock": {"type": "boolean"},
        },
        "required": ["title", "price", "in_stock"],
        "additionalProperties": False,
    },
    "review": {
        "type": "object",
        "properties": {
            "label": {"enum": ["positive", "negative", "neutral"]},
            "stars": {"type": "integer", "minimum": 1, "maximum": 5},
        },
        "required": ["label", "stars"],
        "additionalProperties": False,
    },
}


def extract(rows: int, rng: random.Random) -> pa.Table:
    kinds = [rng.choice(sorted(EXTRACT_SCHEMAS)) for _ in range(rows)]
    prompts = [
        f"Extract the {k} as JSON.\nText: {words(rng.randint(8, 30), seed=7000 + i)}\nJSON:"
        for i, k in enumerate(kinds)
    ]
    schemas = [json.dumps(EXTRACT_SCHEMAS[k]) for k in kinds]
    return pa.table({"id": list(range(rows)), "kind": kinds, "prompt": prompts, "schema": schemas})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--rows", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    args.folder.mkdir(parents=True, exist_ok=True)
    makers = (
        ("prompts", shared_system_prompt),
        ("fewshot", few_shot),
        ("chat", chat),
        ("extract", extract),
    )
    for name, make in makers:
        table = make(args.rows, random.Random(args.seed))
        pq.write_table(table, args.folder / f"{name}.parquet")
        print(f"wrote {table.num_rows} rows to {args.folder / name}.parquet")


if __name__ == "__main__":
    main()
