"""Structured outputs on the real model (SmolLM2-135M-Instruct, tests/real_model.py): a
constraint must cut off invalid outputs without costing the model accuracy.

Labelled sets (tests/extraction.py, tests/sentiment.py) run through the CLI, greedy, in
float32. Figures are printed (``-s``) and quoted in the README ("Structured outputs").
"""

from __future__ import annotations

import json

import jsonschema
import pyarrow as pa
import pytest

from tests import extraction, real_model, sentiment
from tests.jobkit import run_job, write_job

ROWS = 60
MAX_TOKENS = 48


@pytest.mark.timeout(600)  # two jobs: 50 s on 2 cores at load ~3, 212 s at load ~7
def test_json_schema_keeps_the_models_extraction_accuracy(tmp_path) -> None:
    model = real_model.gguf()
    examples = extraction.examples(ROWS)
    table = pa.table({"id": list(range(ROWS)), "messages": [e.messages() for e in examples]})
    texts: dict[str, list[str]] = {}
    for name, structured in [("free", None), ("schema", {"json_schema": extraction.SCHEMA})]:
        sampling = {"temperature": 0, "max_tokens": MAX_TOKENS, "structured": structured}
        job = write_job(
            tmp_path / name, model, table=table, sampling=sampling,
            input_extra={"messages_column": "messages"},
        )  # fmt: skip
        rows = run_job(job)
        assert [r["id"] for r in rows] == list(range(ROWS))
        if structured is not None:  # every output conforms
            for r in rows:
                assert r["finish_reason"] == "stop", r
                jsonschema.validate(json.loads(r["text"]), extraction.SCHEMA)
        texts[name] = [r["text"] for r in rows]

    # Accuracy is compared on the rows whose unconstrained answer parses (the constraint may
    # only help on the others).
    parsed = [i for i, t in enumerate(texts["free"]) if extraction.parse_object(t) is not None]
    assert len(parsed) >= ROWS // 2, texts["free"]
    subset = [examples[i] for i in parsed]
    free = extraction.score(subset, [texts["free"][i] for i in parsed])
    schema = extraction.score(subset, [texts["schema"][i] for i in parsed])
    overall = extraction.score(examples, texts["schema"])
    print(
        f"\n{ROWS} sentences; unconstrained: {free['parsed']} parse, correct name/age/city "
        f"{free['name']}/{free['age']}/{free['city']}; json_schema (auto layout) on those rows: "
        f"{schema['name']}/{schema['age']}/{schema['city']}; on all {ROWS}: "
        f"{overall['name']}/{overall['age']}/{overall['city']}"
    )
    for field in extraction.FIELDS:
        assert schema[field] >= free[field], (field, schema, free)


def test_choice_is_exact_and_starts_with_a_whole_word(tmp_path) -> None:
    """``choice`` outputs are exactly a choice. With a leading space (for completion prompts)
    the pinned first token keeps a greedy model off the bare " " token, which the same choices
    in any tokenization (a ``grammar``) let it take; in chat, choices without a space fit the
    answer's first token."""
    model = real_model.gguf()
    reviews = sentiment.reviews()
    labels = [label for _, label in reviews]
    spaced = [f" {label}" for label in sentiment.LABELS]
    any_tokenization = "start: " + " | ".join(json.dumps(c) for c in spaced) + "\n"
    cases = {
        "completion, choice": ("prompt", {"choice": spaced}),
        "completion, grammar": ("prompt", {"grammar": any_tokenization}),
        "chat, choice": ("messages", {"choice": list(sentiment.LABELS)}),
    }
    correct = {}
    for name, (column, structured) in cases.items():
        prompts = [
            sentiment.completion_prompt(r) if column == "prompt" else sentiment.chat_messages(r)
            for r, _ in reviews
        ]
        table = pa.table({"id": list(range(len(reviews))), column: prompts})
        extra = {"messages_column": "messages"} if column == "messages" else {}
        sampling = {"temperature": 0, "max_tokens": 4, "structured": structured}
        job = write_job(
            tmp_path / name.replace(", ", "-"), model, table=table, sampling=sampling,
            input_extra=extra,
        )  # fmt: skip
        rows = run_job(job)
        texts = [r["text"] for r in rows]
        choices = structured.get("choice", spaced)
        assert all(r["finish_reason"] == "stop" for r in rows) and set(texts) <= set(choices)
        if "choice" in structured:
            assert all(r["num_output_tokens"] == 1 for r in rows), texts  # one word, one token
        correct[name] = sum(t.strip() == label for t, label in zip(texts, labels, strict=True))
    print(f"\n{len(reviews)} reviews, correct labels: {correct}")
    assert correct["completion, choice"] >= correct["completion, grammar"]
    assert correct["chat, choice"] >= correct["completion, choice"]
