"""A labelled extraction set for structured-output accuracy: sentences about a person, each
with the name, age and city it states, made from small banks of names, ages, cities and
sentence forms (deterministic), and the scoring of a model's JSON answers against the labels.

Used by tests/test_structured_real.py and scripts/bench_structured.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

INSTRUCTION = "Extract the person's name, age and city as JSON."
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "city": {"type": "string"},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
FIELDS = ("name", "age", "city")

NAMES = (
    "Bob", "Alice", "Maria", "Tom", "Yuki", "Omar", "Lena", "Carlos", "Priya", "James",
    "Sofia", "Ahmed", "Emma", "Lucas", "Hannah", "Ivan", "Grace", "Mateo", "Chloe", "Daniel",
)  # fmt: skip
CITIES = (
    "Paris", "Berlin", "Tokyo", "Madrid", "Chicago", "Toronto", "Sydney", "Cairo", "Lisbon",
    "Dublin", "Oslo", "Seoul", "Boston", "Vienna", "Mumbai", "Denver", "Prague", "Lima",
)  # fmt: skip
# "{n}", "{a}", "{c}": name, age, city
FORMS = (
    "{n}, age {a}, moved to {c} recently.",
    "{n} is {a} years old and lives in {c}.",
    "In {c}, {a}-year-old {n} opened a small bakery.",
    "{n} ({a}) works as a nurse in {c}.",
    "Last year {n} turned {a} and left for {c}.",
    "Our new neighbour {n}, who is {a}, comes from {c}.",
)


@dataclass(frozen=True)
class Example:
    sentence: str
    name: str
    age: int
    city: str

    @property
    def prompt(self) -> str:
        return f"{INSTRUCTION}\n{self.sentence}"

    def messages(self) -> list[dict[str, str]]:
        return [{"role": "user", "content": self.prompt}]


def examples(count: int = 60) -> list[Example]:
    """``count`` examples: every sentence form in turn, names, ages (19..78) and cities drawn
    by fixed strides so that neighbours differ in every field."""
    out = []
    for i in range(count):
        name = NAMES[(7 * i) % len(NAMES)]
        city = CITIES[(5 * i + 3) % len(CITIES)]
        age = 19 + (37 * i + 11) % 60
        sentence = FORMS[i % len(FORMS)].format(n=name, a=age, c=city)
        out.append(Example(sentence, name, age, city))
    return out


def parse_object(text: str) -> dict[str, Any] | None:
    """The JSON object a free-form answer holds (the span from its first "{" to its last "}",
    so code fences and prose around it are ignored), or None when there is none."""
    start, end = text.find("{"), text.rfind("}")
    if start < 0 or end < start:
        return None
    try:
        value = json.loads(text[start : end + 1])
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


def field_correct(example: Example, answer: dict[str, Any], field: str) -> bool:
    """Whether ``answer`` states ``field`` as the sentence does: names and cities compared
    without case or surrounding space; an age as an integer (or, in free-form answers, a string
    of its digits)."""
    value = answer.get(field)
    expected = getattr(example, field)
    if field == "age":
        if isinstance(value, str) and value.strip().isdigit():
            value = int(value.strip())
        return isinstance(value, int) and not isinstance(value, bool) and value == expected
    return isinstance(value, str) and value.strip().casefold() == expected.casefold()


def score(examples_: list[Example], texts: list[str]) -> dict[str, int]:
    """Per field, the number of answers that parse and state it correctly; ``parsed``: the
    number of answers holding a JSON object."""
    counts = {"parsed": 0, **{f: 0 for f in FIELDS}}
    for example, text in zip(examples_, texts, strict=True):
        answer = parse_object(text)
        if answer is None:
            continue
        counts["parsed"] += 1
        for f in FIELDS:
            counts[f] += field_correct(example, answer, f)
    return counts
