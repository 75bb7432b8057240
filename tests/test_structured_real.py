"""Structured outputs on the real model (SmolLM2-135M-Instruct, tests/real_model.py): a JSON
schema must cut off invalid outputs without costing the model accuracy.

The labelled extraction set (tests/extraction.py) is run twice through the CLI, greedy, in
float32: unconstrained, and with the schema in the default layout. Figures are printed (``-s``)
and quoted in the README ("Structured outputs").
"""

from __future__ import annotations

import json

import jsonschema
import pyarrow as pa

from tests import extraction, real_model
from tests.jobkit import run_job, write_job

ROWS = 60
MAX_TOKENS = 48


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
