"""The output rows: the columns of docs/job-file.md, their Arrow schema, the typed row builders,
and the totals.

One input row yields one :data:`RowGroup`: its ``n`` output rows (dicts keyed by column name),
built here and nowhere else, committed whole by :mod:`batchgen.results`; a score job's input row
yields one output row (:func:`score_row`). :class:`Totals` counts row groups for the progress
bar, the report, each Ray worker and the manifest alike. Which optional columns a job writes is
an :class:`OutputColumns`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

# Output columns, in the documented order (keep_columns follow). Input keep_columns may not reuse
# these.
RESULT_COLUMNS: tuple[str, ...] = (
    "id",
    "sample_index",
    "text",
    "token_ids",
    "finish_reason",
    "error",
    "num_prompt_tokens",
    "num_cached_tokens",
    "num_output_tokens",
    "cumulative_logprob",
    "token_logprobs",
    "top_logprobs",
    "prompt_logprobs",
    "reasoning",
    "choice_logprobs",
    "choice_num_tokens",
    "best_choice",
)

ERROR = "error"  # the finish_reason of a row that could not be generated

# The n output rows of one input row: what a commit writes whole and a Ray worker hands back.
RowGroup = list[dict[str, Any]]

# {token_id, logprob}: one alternative of top_logprobs and prompt_logprobs
TOP_ENTRY = pa.struct([pa.field("token_id", pa.int32()), pa.field("logprob", pa.float32())])
PROMPT_ENTRY = pa.struct(
    [
        pa.field("token_id", pa.int32()),
        pa.field("logprob", pa.float32()),
        pa.field("top", pa.list_(TOP_ENTRY)),
    ]
)


@dataclass(frozen=True)
class OutputColumns:
    """The optional columns of a job's output (docs/job-file.md, docs/scoring.md).

    ``score``: a score job's columns instead of the generation ones; ``logprobs``:
    ``cumulative_logprob`` and ``token_logprobs``; ``top_logprobs`` (``logprobs: K``, K > 0);
    ``prompt_logprobs``; ``reasoning`` (``output.reasoning`` in effect)."""

    logprobs: bool = False
    top_logprobs: bool = False
    prompt_logprobs: bool = False
    reasoning: bool = False
    score: bool = False

    @classmethod
    def of(cls, value: bool | OutputColumns) -> OutputColumns:
        """``value`` itself, or (a bool) just the logprobs columns on or off."""
        return value if isinstance(value, OutputColumns) else cls(logprobs=value)


def _score_schema(id_type: pa.DataType) -> list[pa.Field]:
    return [
        pa.field("id", id_type, nullable=False),
        pa.field("choice_logprobs", pa.list_(pa.float64())),
        pa.field("choice_num_tokens", pa.list_(pa.int32())),
        pa.field("best_choice", pa.int32()),
        pa.field("error", pa.string()),
        pa.field("num_prompt_tokens", pa.int32()),
        pa.field("num_cached_tokens", pa.int32()),
    ]


def output_schema(
    id_type: pa.DataType, keep_fields: Sequence[pa.Field], logprobs: bool | OutputColumns
) -> pa.Schema:
    """The schema of every part file: the documented columns in order, then the keep columns.
    ``logprobs``: the optional columns (a bool: the logprobs columns alone)."""
    cols = OutputColumns.of(logprobs)
    for field in keep_fields:
        if field.name in RESULT_COLUMNS:
            raise ValueError(f"keep column {field.name!r} collides with an output column")
    if cols.score:
        return pa.schema(_score_schema(id_type) + list(keep_fields))
    columns = [
        pa.field("id", id_type, nullable=False),
        pa.field("sample_index", pa.int32(), nullable=False),
        pa.field("text", pa.string()),
        pa.field("token_ids", pa.list_(pa.int32())),
        pa.field("finish_reason", pa.string(), nullable=False),
        pa.field("error", pa.string()),
        pa.field("num_prompt_tokens", pa.int32()),
        pa.field("num_cached_tokens", pa.int32()),
        pa.field("num_output_tokens", pa.int32()),
    ]
    if cols.logprobs:
        columns += [
            pa.field("cumulative_logprob", pa.float64()),
            pa.field("token_logprobs", pa.list_(pa.float32())),
        ]
    if cols.top_logprobs:
        columns.append(pa.field("top_logprobs", pa.list_(pa.list_(TOP_ENTRY))))
    if cols.prompt_logprobs:
        columns.append(pa.field("prompt_logprobs", pa.list_(PROMPT_ENTRY)))
    if cols.reasoning:
        columns.append(pa.field("reasoning", pa.string()))
    return pa.schema(columns + list(keep_fields))


def _tops(entries: Sequence[tuple[int, float]]) -> list[dict[str, Any]]:
    return [{"token_id": t, "logprob": lp} for t, lp in entries]


def prompt_logprob_entries(
    prompt: Sequence[int], scored: Sequence[tuple[float, Sequence[tuple[int, float]]]]
) -> list[dict[str, Any] | None]:
    """The ``prompt_logprobs`` value: None for the first prompt token, then each token's id,
    logprob and top alternatives (``scored``: one (logprob, top) per token after the first)."""
    out: list[dict[str, Any] | None] = [None]
    for token, (lp, top) in zip(prompt[1:], scored, strict=True):
        out.append({"token_id": token, "logprob": lp, "top": _tops(top)})
    return out


def sample_row(
    row_id: Any,
    sample_index: int,
    keep: Mapping[str, Any],
    *,
    text: str,
    token_ids: list[int],
    finish_reason: str,
    num_prompt_tokens: int,
    num_cached_tokens: int,
    token_logprobs: list[float] | None,
    logprobs: bool | OutputColumns,
    error: str | None = None,
    top_logprobs: Sequence[Sequence[tuple[int, float]]] | None = None,
    prompt_logprobs: list[dict[str, Any] | None] | None = None,
    reasoning: str | None = None,
) -> dict[str, Any]:
    """One generated output row. ``logprobs``: the optional columns (a bool: the logprobs
    columns alone); each is written only when it is one. ``error``: why a sample that was
    generated ended with ``finish_reason: error`` (its structured-output state failed)."""
    cols = OutputColumns.of(logprobs)
    out: dict[str, Any] = {
        "id": row_id,
        "sample_index": sample_index,
        "text": text,
        "token_ids": token_ids,
        "finish_reason": finish_reason,
        "error": error,
        "num_prompt_tokens": num_prompt_tokens,
        "num_cached_tokens": num_cached_tokens,
        "num_output_tokens": len(token_ids),
    }
    if cols.logprobs:
        lps = token_logprobs or []
        out.update(cumulative_logprob=float(math.fsum(lps)), token_logprobs=lps)
    if cols.top_logprobs:
        out["top_logprobs"] = [_tops(t) for t in top_logprobs or []]
    if cols.prompt_logprobs:
        out["prompt_logprobs"] = prompt_logprobs
    if cols.reasoning:
        out["reasoning"] = reasoning
    out.update(keep)
    return out


def score_row(
    row_id: Any,
    keep: Mapping[str, Any],
    *,
    choice_logprobs: Sequence[float],
    choice_num_tokens: Sequence[int],
    num_prompt_tokens: int,
    num_cached_tokens: int,
) -> RowGroup:
    """The one output row of a scored input row. ``best_choice``: the first index of the
    largest logprob."""
    best = max(range(len(choice_logprobs)), key=lambda i: (choice_logprobs[i], -i))
    out: dict[str, Any] = {
        "id": row_id,
        "choice_logprobs": [float(x) for x in choice_logprobs],
        "choice_num_tokens": list(choice_num_tokens),
        "best_choice": best,
        "error": None,
        "num_prompt_tokens": num_prompt_tokens,
        "num_cached_tokens": num_cached_tokens,
    }
    out.update(keep)
    return [out]


def error_rows(
    row_id: Any, keep: Mapping[str, Any], problem: str, n: int, logprobs: bool | OutputColumns
) -> RowGroup:
    """The ``n`` ``error`` output rows of an input row that cannot be generated (a score job:
    its one row, with null scores)."""
    cols = OutputColumns.of(logprobs)
    if cols.score:
        out: dict[str, Any] = {
            "id": row_id,
            "choice_logprobs": None,
            "choice_num_tokens": None,
            "best_choice": None,
            "error": problem,
            "num_prompt_tokens": 0,
            "num_cached_tokens": 0,
        }
        return [{**out, **keep}]
    rows = []
    for k in range(n):
        out = {
            "id": row_id,
            "sample_index": k,
            "text": "",
            "token_ids": [],
            "finish_reason": ERROR,
            "error": problem,
            "num_prompt_tokens": 0,
            "num_cached_tokens": 0,
            "num_output_tokens": 0,
        }
        if cols.logprobs:
            out.update(cumulative_logprob=None, token_logprobs=None)
        if cols.top_logprobs:
            out["top_logprobs"] = None
        if cols.prompt_logprobs:
            out["prompt_logprobs"] = None
        if cols.reasoning:
            out["reasoning"] = None
        out.update(keep)
        rows.append(out)
    return rows


@dataclass
class Totals:
    """Counts over finished input rows: ``rows`` input rows, ``samples`` output rows, token sums
    over output rows, ``errors`` output rows whose finish_reason is ``error`` (score rows,
    which have no finish_reason: whose ``error`` is set)."""

    rows: int = 0
    samples: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    output_tokens: int = 0
    errors: int = 0

    def add(self, group: RowGroup) -> None:
        """Count one finished input row (its n output rows)."""
        self.rows += 1
        self.samples += len(group)
        for r in group:
            self.prompt_tokens += r["num_prompt_tokens"]
            self.cached_prompt_tokens += r["num_cached_tokens"]
            self.output_tokens += r.get("num_output_tokens", 0)
            if "finish_reason" in r:
                self.errors += r["finish_reason"] == ERROR
            else:
                self.errors += r["error"] is not None

    def hit_rate(self) -> float:
        return self.cached_prompt_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def of_table(cls, table: pa.Table, rows: int) -> Totals:
        """The totals of a part: ``rows`` input rows whose output rows ``table`` holds."""

        def total(column: str) -> int:
            if column not in table.column_names:  # a score job's parts: no output tokens
                return 0
            return int(pc.sum(table.column(column)).as_py() or 0)

        if "finish_reason" in table.column_names:
            errors = pc.sum(pc.equal(table.column("finish_reason"), ERROR)).as_py()
        else:
            errors = table.num_rows - table.column("error").null_count
        return cls(
            rows=rows,
            samples=table.num_rows,
            prompt_tokens=total("num_prompt_tokens"),
            cached_prompt_tokens=total("num_cached_tokens"),
            output_tokens=total("num_output_tokens"),
            errors=int(errors or 0),
        )

    @classmethod
    def sum(cls, counts: Iterable[Mapping[str, Any]]) -> Totals:
        """The sum of mappings that hold (at least) every count, e.g. manifest part entries."""
        out = cls()
        for c in counts:
            for f in fields(cls):
                setattr(out, f.name, getattr(out, f.name) + int(c[f.name]))
        return out
