"""The output rows: the columns of docs/job-file.md, their Arrow schema, the typed row builders,
and the totals.

One input row yields one :data:`RowGroup`: its ``n`` output rows (dicts keyed by column name),
built here and nowhere else, committed whole by :mod:`batchgen.results`. :class:`Totals` counts
row groups for the progress bar, the report, each Ray worker and the manifest alike.
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
)

ERROR = "error"  # the finish_reason of a row that could not be generated

# The n output rows of one input row: what a commit writes whole and a Ray worker hands back.
RowGroup = list[dict[str, Any]]


def output_schema(
    id_type: pa.DataType, keep_fields: Sequence[pa.Field], logprobs: bool
) -> pa.Schema:
    """The schema of every part file: the documented columns in order, then the keep columns."""
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
    if logprobs:
        columns += [
            pa.field("cumulative_logprob", pa.float64()),
            pa.field("token_logprobs", pa.list_(pa.float32())),
        ]
    for field in keep_fields:
        if field.name in RESULT_COLUMNS:
            raise ValueError(f"keep column {field.name!r} collides with an output column")
    return pa.schema(columns + list(keep_fields))


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
    logprobs: bool,
    error: str | None = None,
) -> dict[str, Any]:
    """One generated output row. ``token_logprobs`` is written only when ``logprobs``;
    ``error``: why a sample that was generated ended with ``finish_reason: error`` (its
    structured-output state failed)."""
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
    if logprobs:
        lps = token_logprobs or []
        out.update(cumulative_logprob=float(math.fsum(lps)), token_logprobs=lps)
    out.update(keep)
    return out


def error_rows(
    row_id: Any, keep: Mapping[str, Any], problem: str, n: int, logprobs: bool
) -> RowGroup:
    """The ``n`` ``error`` output rows of an input row that cannot be generated."""
    rows = []
    for k in range(n):
        out: dict[str, Any] = {
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
        if logprobs:
            out.update(cumulative_logprob=None, token_logprobs=None)
        out.update(keep)
        rows.append(out)
    return rows


@dataclass
class Totals:
    """Counts over finished input rows: ``rows`` input rows, ``samples`` output rows, token sums
    over output rows, ``errors`` output rows whose finish_reason is ``error``."""

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
            self.output_tokens += r["num_output_tokens"]
            self.errors += r["finish_reason"] == ERROR

    def hit_rate(self) -> float:
        return self.cached_prompt_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def of_table(cls, table: pa.Table, rows: int) -> Totals:
        """The totals of a part: ``rows`` input rows whose output rows ``table`` holds."""

        def total(column: str) -> int:
            return int(pc.sum(table.column(column)).as_py() or 0)

        return cls(
            rows=rows,
            samples=table.num_rows,
            prompt_tokens=total("num_prompt_tokens"),
            cached_prompt_tokens=total("num_cached_tokens"),
            output_tokens=total("num_output_tokens"),
            errors=int(pc.sum(pc.equal(table.column("finish_reason"), ERROR)).as_py() or 0),
        )

    @classmethod
    def sum(cls, counts: Iterable[Mapping[str, Any]]) -> Totals:
        """The sum of mappings that hold (at least) every count, e.g. manifest part entries."""
        out = cls()
        for c in counts:
            for f in fields(cls):
                setattr(out, f.name, getattr(out, f.name) + int(c[f.name]))
        return out
