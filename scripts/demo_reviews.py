#!/usr/bin/env python
r"""The quick start's task: a real chat model (SmolLM2-135M-Instruct) labels product reviews
whose labels are known, so that what it writes can be checked.

    python scripts/demo_reviews.py data demo     # demo/reviews.parquet, demo/summarize.parquet
    python scripts/demo_reviews.py check out/quickstart out/quickstart-greedy \
        --summaries out/summaries --reviews demo/reviews.parquet

``data`` writes 200 short reviews (eight product kinds, each review built from a bank of
phrases; half positive, half negative; the same rows on every run) with their ``label`` and the
chat prompt of jobs/quickstart.yaml in ``messages`` (an instruction as the system message, the
review as the user's; the output is constrained to ``positive`` or ``negative``), and the first
24 reviews with a request for a one-line summary (demo/summarize.parquet, jobs/summaries.yaml).
``check`` counts right labels in output folders written by jobs/quickstart.yaml (which keeps
the ``label`` column), per sample and by majority vote over a review's samples, and prints a few
reviews with their labels, predictions and summaries.
"""

from __future__ import annotations

import argparse
import random
from collections import Counter
from pathlib import Path
from typing import Any

LABELS = ("positive", "negative")

# The instruction of jobs/quickstart.yaml, as the system message (the review is the user's).
# Phrasings tried on the first 80 reviews (greedy; the first token constrained as by `choice`):
# this one and the same with "Review: " before the review or ending "Answer with one word:
# positive or negative." got 68/80 right; without "Answer with one word." 64/80; the question as
# the user message before or after the review ("Is the sentiment of this review positive or
# negative?\nReview: ...") 42-57/80, mostly "negative".
SYSTEM = (
    "You classify the sentiment of product reviews as positive or negative. Answer with one word."
)
SUMMARY_REQUEST = "Summarize this product review in one short sentence."

# product kind -> (names, a good detail, a bad detail): the details name the product's own
# strengths and faults, so reviews of different kinds read differently.
PRODUCTS: dict[str, tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]] = {
    "headphones": (
        ("these headphones", "the wireless earbuds", "this headset"),
        (
            "the sound is rich and clear",
            "the battery lasts all week",
            "they sit comfortably for hours",
        ),
        (
            "the left side crackles",
            "the battery dies in an hour",
            "they pinch my ears after ten minutes",
        ),
    ),
    "blender": (
        ("this blender", "the smoothie maker", "this countertop blender"),
        ("it crushes ice in seconds", "cleanup takes a minute", "it is quieter than my old one"),
        (
            "it leaks from the bottom",
            "the motor smells like it is burning",
            "it leaves chunks of fruit",
        ),
    ),
    "backpack": (
        ("this backpack", "the hiking pack", "this laptop bag"),
        (
            "the straps are well padded",
            "it survived a week of rain",
            "every pocket is where I want it",
        ),
        (
            "a zipper broke on day two",
            "the seams are already fraying",
            "the straps dig into my shoulders",
        ),
    ),
    "lamp": (
        ("this desk lamp", "the reading light", "this floor lamp"),
        ("the light is warm and even", "it is easy to angle", "the dimmer works smoothly"),
        ("it flickers constantly", "the switch stopped working", "the base wobbles"),
    ),
    "shoes": (
        ("these running shoes", "the sneakers", "these boots"),
        ("my feet feel great after a long run", "they fit true to size", "the grip is excellent"),
        ("the sole came loose", "they gave me blisters", "they run two sizes small"),
    ),
    "coffee maker": (
        ("this coffee maker", "the espresso machine", "this drip brewer"),
        ("the coffee comes out hot and strong", "it heats up fast", "it is simple to program"),
        ("the coffee tastes burnt", "it takes forever to heat", "the carafe cracked"),
    ),
    "phone case": (
        ("this phone case", "the rugged case", "this slim case"),
        (
            "it survived several drops",
            "it feels solid in the hand",
            "the buttons still click nicely",
        ),
        (
            "it cracked within a week",
            "it makes the buttons hard to press",
            "it slips out of my hand",
        ),
    ),
    "book": (
        ("this novel", "the thriller", "this paperback"),
        ("I could not put it down", "the characters feel real", "the ending surprised me"),
        (
            "the plot drags on forever",
            "the characters are flat",
            "I guessed the ending by page ten",
        ),
    ),
}

# Sentence frames with {product} and {detail}; and verdicts. The negative bank uses negation and
# the positive bank avoids the obvious words often enough that no single keyword decides.
OPENERS = {
    "positive": (
        "I bought {product} last month and {detail}.",
        "Honestly, {detail}, which I did not expect at this price.",
        "{Product}: {detail}.",
        "After a few weeks with {product}, {detail}.",
        "My sister recommended {product}, and {detail}.",
        "I was skeptical, but {detail}.",
    ),
    "negative": (
        "I bought {product} last month and {detail}.",
        "Sadly, {detail}, which I did not expect at this price.",
        "{Product}: {detail}.",
        "After a few weeks with {product}, {detail}.",
        "My sister recommended {product}, but {detail}.",
        "I wanted to like it, but {detail}.",
    ),
}
VERDICTS = {
    "positive": (
        "I love it.",
        "Would buy again.",
        "Highly recommended.",
        "Worth every penny.",
        "Five stars from me.",
        "No complaints at all.",
        "It exceeded my expectations.",
        "",
    ),
    "negative": (
        "I want my money back.",
        "Would not buy again.",
        "Avoid it.",
        "Not worth the money.",
        "One star.",
        "Very disappointed.",
        "It went straight back to the store.",
        "",
    ),
}


def review(label: str, rng: random.Random) -> tuple[str, str]:
    """``(kind, text)``: one review of a random product with this label."""
    kind = rng.choice(sorted(PRODUCTS))
    names, good, bad = PRODUCTS[kind]
    product = rng.choice(names)
    detail = rng.choice(good if label == "positive" else bad)
    opener = rng.choice(OPENERS[label])
    text = opener.format(product=product, Product=product[0].upper() + product[1:], detail=detail)
    text = text[0].upper() + text[1:]
    verdict = rng.choice(VERDICTS[label])
    return kind, f"{text} {verdict}".strip()


def classify_messages(text: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}]


def summary_messages(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"{SUMMARY_REQUEST}\nReview: {text}"}]


def make_rows(rows: int = 200, seed: int = 0) -> list[dict[str, Any]]:
    """``rows`` reviews, half of each label (shuffled), the same for the same seed."""
    rng = random.Random(seed)
    labels = [LABELS[i % 2] for i in range(rows)]
    rng.shuffle(labels)
    out = []
    for i, label in enumerate(labels):
        kind, text = review(label, rng)
        out.append(
            {
                "id": i,
                "product": kind,
                "review": text,
                "label": label,
                "messages": classify_messages(text),
            }
        )
    return out


def write_data(folder: Path, rows: int = 200, seed: int = 0, summarize: int = 24) -> None:
    """``folder/reviews.parquet`` (``rows`` reviews: ``id``, ``product``, ``review``, ``label``,
    ``messages``) and ``folder/summarize.parquet`` (the first ``summarize`` of them: ``id``,
    ``review``, ``messages`` asking for a summary)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    reviews = make_rows(rows, seed)
    pq.write_table(pa.Table.from_pylist(reviews), folder / "reviews.parquet")
    firsts = [
        {"id": r["id"], "review": r["review"], "messages": summary_messages(r["review"])}
        for r in reviews[:summarize]
    ]
    pq.write_table(pa.Table.from_pylist(firsts), folder / "summarize.parquet")
    print(f"wrote {rows} reviews to {folder / 'reviews.parquet'}, {len(firsts)} to summarize")


def score(rows: list[dict[str, Any]]) -> dict[str, int]:
    """Counts over output rows (``id``, ``text``, ``label``): samples, right samples, reviews,
    and reviews whose most frequent prediction (ties broken by the smallest text) is right."""
    by_id: dict[Any, list[tuple[str, str]]] = {}
    for row in rows:
        by_id.setdefault(row["id"], []).append(((row["text"] or "").strip(), row["label"]))
    right = sum(text == label for samples in by_id.values() for text, label in samples)
    majority = 0
    for samples in by_id.values():
        counts = Counter(text for text, _ in samples)
        top = min(counts, key=lambda text: (-counts[text], text))
        majority += top == samples[0][1]
    return {
        "samples": sum(map(len, by_id.values())),
        "right": right,
        "reviews": len(by_id),
        "majority_right": majority,
    }


def _read(folder: Path) -> list[dict[str, Any]]:
    import pyarrow.dataset as ds

    table = ds.dataset(folder, format="parquet").to_table()
    return table.sort_by([("id", "ascending"), ("sample_index", "ascending")]).to_pylist()


def _pct(part: int, whole: int) -> str:
    return f"{100 * part / max(1, whole):.1f}%"


def check(folders: list[Path], summaries: Path | None, reviews: Path | None, examples: int) -> int:
    predictions: list[tuple[str, dict[Any, list[str]]]] = []  # per folder: id -> its texts
    for folder in folders:
        rows = _read(folder)
        if rows and "label" not in rows[0]:
            print(f"{folder}: no `label` column (run jobs/quickstart.yaml, which keeps it)")
            return 2
        s = score(rows)
        n = s["samples"] // max(1, s["reviews"])
        print(
            f"{folder}: {s['right']}/{s['samples']} labels right "
            f"({_pct(s['right'], s['samples'])}, {n} per review)"
        )
        if n > 1:
            print(
                f"  right by majority vote of the {n}: {s['majority_right']}/{s['reviews']} "
                f"({_pct(s['majority_right'], s['reviews'])})"
            )
        by_id: dict[Any, list[str]] = {}
        for row in rows:
            by_id.setdefault(row["id"], []).append((row["text"] or "").strip())
        predictions.append((folder.name, by_id))
    texts: dict[Any, dict[str, Any]] = {}
    if reviews is not None:
        import pyarrow.parquet as pq

        texts = {
            r["id"]: r
            for r in pq.read_table(reviews, columns=["id", "review", "label"]).to_pylist()
        }
    said: dict[Any, list[str]] = {}
    if summaries is not None:
        for row in _read(summaries):
            said.setdefault(row["id"], []).append((row["text"] or "").strip())
        print(f"{summaries}: {sum(map(len, said.values()))} summaries of {len(said)} reviews")
    for id_ in sorted(set(texts) | set(said))[:examples]:
        row = texts.get(id_, {})
        print(f"\nreview {id_}: {row.get('review', '?')!r}")
        print(f"  label: {row.get('label', '?')}")
        for name, by_id in predictions:
            print(f"  {name}: {', '.join(by_id.get(id_, []))}")
        for text in said.get(id_, [])[:2]:
            print(f"  summary: {text!r}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("data", help="write FOLDER/reviews.parquet")
    d.add_argument("folder", type=Path)
    d.add_argument("--rows", type=int, default=200)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--summarize", type=int, default=24, help="reviews to summarize (the first)")
    c = sub.add_parser("check", help="count right labels in output folders")
    c.add_argument("folders", type=Path, nargs="+")
    c.add_argument("--summaries", type=Path, help="an output folder of jobs/summaries.yaml")
    c.add_argument("--reviews", type=Path, help="the input (reviews.parquet), to print reviews")
    c.add_argument("--examples", type=int, default=3, help="reviews to print")
    args = p.parse_args(argv)
    if args.command == "data":
        write_data(args.folder, args.rows, args.seed, args.summarize)
        return 0
    return check(args.folders, args.summaries, args.reviews, args.examples)


if __name__ == "__main__":
    raise SystemExit(main())
