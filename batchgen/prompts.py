"""Input rows -> prompt token ids: plain prompts tokenized as they are, or chat messages
rendered with the tokenizer's chat template. A row that cannot become a prompt (null or empty,
malformed messages, a template or tokenizer that rejects it) gets the reason as its problem; it
becomes ``n`` error rows and the job goes on. A row's sampling overrides
(``input.sampling_columns``, an OpenAI batch line's body) are checked here too: a bad value is the
row's problem, named by its column.

Prompt length against ``max_model_len`` is checked later, by the executor that knows its KV cache.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from pydantic import ValidationError

from batchgen.dataset import InputRow
from batchgen.engine.request import SamplingParams
from batchgen.errors import JobError, ModelError
from batchgen.job import ROW_SAMPLING_KEYS, Job, SamplingConfig
from batchgen.jobfile import pydantic_message
from batchgen.model.config import ModelInfo
from batchgen.structured import RowSchemaError, StructuredOutputs


@dataclass(frozen=True)
class EncodedRow:
    """An input row with its prompt's token ids, or (``tokens`` None) why it cannot be generated.

    ``tokens`` is any sequence of ints (the Ray executor ships them as a compact array).
    ``schema`` is the canonical text of the row's own JSON schema (``input.schema_column``),
    checked to compile; None: the row follows the job-level constraint, if any."""

    row: InputRow
    tokens: Sequence[int] | None
    problem: str | None = None
    schema: str | None = None


class RowProblem(Exception):
    """Why one input row cannot be generated; it becomes an error row (``str`` is the
    ``error`` column: one line)."""

    MAX_CHARS = 500

    @classmethod
    def of(cls, what: str, err: BaseException) -> RowProblem:
        """``what: <err as one line>``, cut to a readable length."""
        detail = " ".join(str(err).split()) or type(err).__name__
        text = f"{what}: {detail}"
        if len(text) > cls.MAX_CHARS:
            text = text[: cls.MAX_CHARS - 3] + "..."
        return cls(text)


class PromptEncoder:
    """Input rows -> token ids (plain prompts, or chat messages through the chat template), or
    the reason a row cannot be generated. Prompt length against max_model_len is checked later,
    by the :class:`RowGenerator` that knows its KV cache. With ``input.schema_column``, each
    row's schema is compiled here (``structured``'s cache): an unusable one is the row's
    problem."""

    def __init__(
        self, job: Job, tokenizer: Any, structured: StructuredOutputs | None = None
    ) -> None:
        self.job = job
        self.tokenizer = tokenizer
        self.structured = structured
        # OpenAI batch lines: chat (messages) or completions (prompt), line by line
        self.batch_file = job.input.format == "openai_batch"
        self.sampling_labels = {
            key: f"body.{key}" if self.batch_file else f"input column {column!r} (sampling.{key})"
            for key, column in (
                {k: k for k in ROW_SAMPLING_KEYS} if self.batch_file else job.input.sampling_columns
            ).items()
        }

    def _checked_sampling(self, row: InputRow) -> InputRow:
        """The row with its sampling overrides checked (as ``sampling:`` checks the job's) and
        normalized; a bad value makes the row's problem (unless it has one) and drops them, but
        for a good ``n``."""
        if not row.sampling:
            return row
        try:
            normalized = row_sampling(row.sampling, self.sampling_labels)
        except RowProblem as problem:
            # Its error rows follow the row's n when that value is good, else the job's.
            try:
                n = row_sampling({"n": row.sampling["n"]}, {}) if "n" in row.sampling else None
            except RowProblem:
                n = None
            return replace(row, sampling=n, problem=row.problem or str(problem))
        return replace(row, sampling=normalized)

    def encode(self, rows: list[InputRow]) -> list[EncodedRow]:
        """Each row with its tokens, or with the problem that keeps it from running. The rows
        handed back carry their sampling overrides checked and normalized (when a value was
        bad, only a good ``n`` is kept: the row's error rows follow it, else the job's)."""
        rows = [self._checked_sampling(r) for r in rows]
        out: list[EncodedRow] = []
        plain = [r for r in rows if r.messages is None and r.prompt]
        encoded: dict[int, list[int]] = {}
        if plain:
            try:
                ids = self.tokenizer([r.prompt for r in plain], add_special_tokens=True)[
                    "input_ids"
                ]
                encoded = {id(r): list(t) for r, t in zip(plain, ids, strict=True)}
            except Exception:  # noqa: BLE001 - fall back to rows one by one to name the culprit
                encoded = {}
        column = self.job.input.messages_column or self.job.input.prompt_column
        for r in rows:
            try:
                if r.problem is not None:
                    raise RowProblem(r.problem)
                if self.job.input.messages_column is not None:
                    tokens = self._render_messages(r, column)
                elif self.batch_file and r.messages is not None:
                    tokens = self._render_messages(r, "body.messages")
                elif r.prompt is None:
                    raise RowProblem(f"{column} is null")
                elif r.prompt == "":
                    raise RowProblem(f"{column} is empty")
                elif id(r) in encoded:
                    tokens = encoded[id(r)]
                else:
                    tokens = list(self.tokenizer(r.prompt, add_special_tokens=True)["input_ids"])
                if not tokens:
                    raise RowProblem("the prompt encodes to zero tokens")
                out.append(EncodedRow(r, tokens, schema=self._schema(r)))
            except RowProblem as e:
                out.append(EncodedRow(r, None, str(e)))
            except Exception as e:  # noqa: BLE001 - a tokenizer failure is the row's problem
                problem = RowProblem.of("the tokenizer cannot encode the prompt", e)
                out.append(EncodedRow(r, None, str(problem)))
        return out

    def _schema(self, row: InputRow) -> str | None:
        if row.schema is None or self.structured is None:
            return None
        try:
            return self.structured.row_schema(row.schema)
        except RowSchemaError as err:
            column = self.job.input.schema_column
            raise RowProblem.of(f"{column}", err) from None

    def _render_messages(self, row: InputRow, column: str) -> list[int]:
        messages = row.messages
        if messages is None:
            raise RowProblem(f"{column} is null")
        if not messages:
            raise RowProblem(f"{column} is empty")
        for i, m in enumerate(messages):
            if m is None:
                raise RowProblem(f"{column}[{i}] is null")
            if not isinstance(m, dict):
                raise RowProblem(f"{column}[{i}] is not a {{role, content}} message")
            for key in ("role", "content"):
                if m.get(key) is None:
                    raise RowProblem(f"{column}[{i}].{key} is null")
                if not isinstance(m[key], str):
                    raise RowProblem(f"{column}[{i}].{key} is not a string")
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
        except Exception as e:  # noqa: BLE001 - a template that rejects the row (raise_exception)
            raise RowProblem.of(f"the chat template cannot render {column}", e) from e
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])


_INT_KEYS = ("n", "max_tokens", "top_k", "seed")


def row_sampling(overrides: Mapping[str, Any], labels: Mapping[str, str]) -> dict[str, Any]:
    """A row's sampling overrides checked with the rules of the job file's ``sampling:`` and
    normalized (lists become tuples); raises RowProblem naming the value's source
    (``labels[key]``). Integral floats are accepted for integer keys (a JSON or CSV column of
    mixed numbers reads as float)."""
    values = dict(overrides)
    for key in _INT_KEYS:
        value = values.get(key)
        if isinstance(value, float) and value.is_integer():
            values[key] = int(value)
    try:
        checked = SamplingConfig.model_validate(values)
    except ValidationError as err:
        first = err.errors()[0]
        key = str(first["loc"][0]) if first["loc"] else next(iter(values))
        label = labels.get(key, key)
        msg = pydantic_message(first)
        raise RowProblem(f"{label}: {msg} (got {values.get(key)!r})") from None
    return {key: getattr(checked, key) for key in values}


def row_params(base: SamplingParams, row: InputRow) -> SamplingParams:
    """The sampling parameters of a row: ``base`` (the job's) with the row's checked
    overrides."""
    if not row.sampling:
        return base
    return replace(base, **row.sampling)


def check_job_against_model(job: Job, info: ModelInfo, tokenizer: Any) -> None:
    """Raise for what would make every row an error row (or silently do nothing): problems of
    the job with this model, found before the output folder is touched."""
    if job.input.messages_column is not None:
        problem = None
        if not getattr(tokenizer, "chat_template", None):
            problem = "has no chat_template (its tokenizer files set none)"
        else:
            try:
                tokenizer.get_chat_template()
            except Exception as err:  # noqa: BLE001 - e.g. named templates and no "default"
                problem = f"has no usable chat_template ({' '.join(str(err).split())[:200]})"
        if problem is not None:
            raise ModelError(
                f"model {job.model} {problem}, which input.messages_column needs: add a "
                "chat_template.jinja to the model folder, or use input.prompt_column"
            )
    outside = [t for t in job.sampling.stop_token_ids if t >= info.vocab_size]
    if outside:
        raise JobError(
            f"sampling.stop_token_ids: {', '.join(map(str, outside))} outside the vocabulary of "
            f"model {job.model} (vocab_size {info.vocab_size})"
        )
