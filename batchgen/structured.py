"""A job's structured outputs, compiled: the job-level constraint (``sampling.structured``) and
the per-row JSON schemas of ``input.schema_column``, each compiled once per distinct text.

Compiling happens when a job starts (the job-level constraint: a JobError, exit 2, before the
output folder is touched) and when rows are encoded (a row's schema: a problem of that row only),
never inside an engine step. A row whose schema is null follows the job-level constraint (or
none).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any

from batchgen.engine.grammar import CompiledGrammar, GrammarCompiler, GrammarError, GrammarLimits
from batchgen.errors import JobError
from batchgen.job import Job, StructuredConfig
from batchgen.model.config import ModelInfo

# Distinct row schemas kept compiled (least recently used ones are dropped; a dropped schema that
# comes back is compiled again). Rows in flight hold their own reference.
_ROW_CACHE_SIZE = 4096
_ANY_JSON_OBJECT = '{"type":"object"}'


class RowSchemaError(ValueError):
    """A row's schema that cannot be used; ``str`` is the row's one-line ``error``."""


def canonical_schema(value: Any) -> str:
    """A row's schema value (JSON text, or a mapping read from a struct column) as canonical JSON
    text: the cache key. Key order is kept (properties are generated in the schema's order).
    Null struct fields are dropped (a struct column has every field in every
    row). Raises RowSchemaError."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise RowSchemaError(f"schema is not valid JSON: {err}") from None
    else:
        value = _drop_nulls(value)
    if not isinstance(value, dict):
        raise RowSchemaError(f"schema must be a JSON object, got {type(value).__name__}")
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _drop_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _drop_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_nulls(v) for v in value]
    return value


class StructuredOutputs:
    """The compiled constraints of one job for one tokenizer.

    :attr:`job_grammar` is the job-level constraint (None without one); :meth:`row_schema` checks
    a row's schema and :meth:`grammar_for` gives the grammar a row follows. :attr:`seconds` is
    the time spent compiling. Nothing is compiled (nor the library's tokenizer built) for a job
    without structured outputs.
    """

    def __init__(
        self,
        job: Job,
        info: ModelInfo,
        tokenizer: Any,
        limits: GrammarLimits | None = None,
    ) -> None:
        self.enabled = job.sampling.structured is not None or job.input.schema_column is not None
        self._compiler: GrammarCompiler | None = None
        self._rows: OrderedDict[str, CompiledGrammar | GrammarError] = OrderedDict()
        self.job_grammar: CompiledGrammar | None = None
        spec = job.sampling.structured
        # the layout of every JSON output: the job-level one and the rows' own schemas
        self.json_layout = spec.json_layout if spec is not None else "auto"
        if self.enabled:
            self._compiler = GrammarCompiler(
                tokenizer, info.vocab_size, info.eos_token_ids, limits or GrammarLimits()
            )
        if spec is not None and spec.constraint_key is not None:
            assert self._compiler is not None
            key, compile_ = _job_constraint(spec, self._compiler)
            try:
                self.job_grammar = compile_()
            except GrammarError as err:
                raise JobError(f"sampling.structured.{key}: {err}") from None

    @property
    def seconds(self) -> float:
        return self._compiler.seconds if self._compiler is not None else 0.0

    def row_schema(self, value: Any) -> str | None:
        """The canonical text of a row's schema (None for a null value), compiled and cached;
        raises RowSchemaError when it is not a schema the library accepts."""
        if value is None:
            return None
        text = canonical_schema(value)
        compiled = self._compile_row(text)
        if isinstance(compiled, GrammarError):
            raise RowSchemaError(f"schema is not usable: {compiled}")
        return text

    def grammar_for(self, schema: str | None) -> CompiledGrammar | None:
        """The grammar of a row whose canonical schema text is ``schema`` (from
        :meth:`row_schema`; None: the job-level one)."""
        if schema is None:
            return self.job_grammar
        compiled = self._compile_row(schema)
        if isinstance(compiled, GrammarError):
            raise RowSchemaError(f"schema is not usable: {compiled}")
        return compiled

    def _compile_row(self, text: str) -> CompiledGrammar | GrammarError:
        if self._compiler is None:
            raise RowSchemaError("input.schema_column is not set")
        hit = self._rows.get(text)
        if hit is not None:
            self._rows.move_to_end(text)
            return hit
        try:
            compiled: CompiledGrammar | GrammarError = self._compiler.json_schema(
                text, self.json_layout
            )
        except GrammarError as err:
            compiled = err
        self._rows[text] = compiled
        if len(self._rows) > _ROW_CACHE_SIZE:
            self._rows.popitem(last=False)
        return compiled


def _job_constraint(spec: StructuredConfig, compiler: GrammarCompiler) -> tuple[str, Any]:
    """(the key set, a function compiling it) for the job-level constraint."""
    layout = spec.json_layout
    if spec.json_schema is not None:
        text = json.dumps(spec.json_schema)
        return "json_schema", lambda: compiler.json_schema(text, layout)
    if spec.json_schema_file is not None:
        path = spec.json_schema_file

        def from_file() -> CompiledGrammar:
            try:
                raw = path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as err:
                raise GrammarError(f"cannot read {path}: {err}") from None
            try:
                schema = json.loads(raw)
            except json.JSONDecodeError as err:
                raise GrammarError(f"{path} is not valid JSON: {err}") from None
            if not isinstance(schema, dict):
                raise GrammarError(f"{path} holds no JSON object")
            return compiler.json_schema(json.dumps(schema), layout)

        return "json_schema_file", from_file
    if spec.json_object:
        return "json", lambda: compiler.json_schema(_ANY_JSON_OBJECT, layout)
    if spec.regex is not None:
        regex = spec.regex
        return "regex", lambda: compiler.regex(regex)
    if spec.choice is not None:
        choices = spec.choice
        return "choice", lambda: compiler.choice(choices)
    assert spec.grammar is not None
    grammar = spec.grammar
    return "grammar", lambda: compiler.lark(grammar)
