"""The job file's schema: every key, its type, its default and the rules between keys.

The schema mirrors the job-file reference (docs/job-file.md) key for key. Every model forbids
unknown keys and is frozen: a job, once loaded, is never written back (numbers derived at run time
are returned by whoever derives them). Types are strict, because YAML already gives every value a
type: ``n: "2"`` or ``temperature: true`` is a mistake to report, not a value to coerce.

Reading a file, ``--set`` overrides and the one-line error messages are :mod:`batchgen.jobfile`'s.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainValidator,
    field_validator,
    model_validator,
)

# --------------------------------------------------------------------------- value types


def _yaml_float(value: Any) -> Any:
    """Accept ``1e-3`` for a float: PyYAML (YAML 1.1) reads an exponent without a dot as a string."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


# A finite float; ints are accepted (strict mode allows int -> float), bools are not.
Float = Annotated[float, BeforeValidator(_yaml_float), Field(allow_inf_nan=False)]

_MEMORY_RE = re.compile(
    r"^\s*(?P<num>\d+(?:\.\d*)?(?:e[+-]?\d+)?)\s*(?P<unit>[kmgt]?i?b?)\s*$", re.IGNORECASE
)
_MEMORY_POWERS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}


def parse_memory(value: Any) -> int | Literal["auto"]:
    """Parse a memory size: an int of bytes, ``"auto"``, or a string such as ``"4GiB"``.

    ``KiB/MiB/GiB/TiB`` (and the bare letters ``K/M/G/T``) are powers of 1024; ``KB/MB/GB/TB``
    are powers of 1000; ``B`` or no unit means bytes. The result is a positive int or ``"auto"``.
    """
    if value == "auto":
        return "auto"
    if isinstance(value, bool):
        raise ValueError('must be a number of bytes, a size like "4GiB", or "auto"')
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, int):
        if value < 1:
            raise ValueError("must be at least 1 byte")
        return value
    if isinstance(value, str) and (m := _MEMORY_RE.match(value)):
        unit = m["unit"].lower()
        letter = unit[:1] if unit[:1] in "kmgt" else ""
        # "KB" is decimal; "KiB" and a bare "K" are binary.
        base = 1000 if (letter and unit.endswith("b") and "i" not in unit) else 1024
        if unit in ("i", "ib") or (not letter and unit not in ("", "b")):
            raise ValueError(f"unknown unit in memory size {value!r}")
        size = int(float(m["num"]) * base ** _MEMORY_POWERS[letter])
        if size < 1:
            raise ValueError("must be at least 1 byte")
        return size
    raise ValueError('must be a number of bytes, a size like "4GiB" or "512MB", or "auto"')


MemorySize = Annotated[int | Literal["auto"], PlainValidator(parse_memory)]


def _none_as_empty(value: Any) -> Any:
    """``stop:`` with nothing after it is an empty list, not a type error."""
    return () if value is None else value


def _str_as_list(value: Any) -> Any:
    """``stop: "###"`` means one stop string (as in vLLM); null means none."""
    if isinstance(value, str):
        return (value,)
    return _none_as_empty(value)


StrList = Annotated[
    tuple[Annotated[str, Field(min_length=1)], ...],
    BeforeValidator(_str_as_list),
    Field(strict=False),  # accept a YAML list for the tuple; the items stay strict
]
IntList = Annotated[
    tuple[Annotated[int, Field(ge=0)], ...],
    BeforeValidator(_none_as_empty),
    Field(strict=False),
]


def _path(value: Any) -> Any:
    """A YAML string becomes a Path; anything else is an error."""
    if isinstance(value, str):
        if not value.strip():
            raise ValueError("must not be empty")
        return Path(value)
    if isinstance(value, Path):
        return value
    raise ValueError("must be a path (a string)")


PathValue = Annotated[Path, BeforeValidator(_path)]


def _path_or_uri(value: Any) -> Any:
    """An ``s3://`` URI stays a string; any other string becomes a Path."""
    if isinstance(value, str) and value.startswith("s3://"):
        return value
    return _path(value)


# A local folder (a Path) or an object-store prefix (an ``s3://`` string).
PathOrUri = Annotated[Path | str, PlainValidator(_path_or_uri)]
# A hub id: org/name, each part letters, digits, '-', '_', '.' (not starting with '.').
HUB_ID_RE = re.compile(r"^[A-Za-z0-9_-][\w.-]*/[A-Za-z0-9_-][\w.-]*$")


class _Section(BaseModel):
    """Base of every job-file model: unknown keys are errors, values are strict, frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


# --------------------------------------------------------------------------- the schema


# Input keys an OpenAI batch file decides itself.
OPENAI_BATCH_FIXED = (
    "prompt_column",
    "messages_column",
    "id_column",
    "keep_columns",
    "schema_column",
    "sampling_columns",
)


class InputConfig(_Section):
    """``input:``: where the rows come from.

    Exactly one of ``prompt_column`` and ``messages_column`` is set. ``prompt_column`` defaults
    to ``"prompt"`` unless ``messages_column`` is given. ``path`` is a string, not a Path,
    because it may be a glob; after :func:`~batchgen.jobfile.load_job` it is absolute.

    ``format``: ``auto`` reads the format from the file extensions (or a folder's files);
    ``openai_batch`` reads OpenAI Batch API request lines and fixes the column keys itself (giving
    one is an error). ``sampling_columns`` maps a key of :data:`ROW_SAMPLING_KEYS` to the input
    column whose non-null values override it for their row.

    Extension (docs/job-file.md): ``window_rows``, the number of rows read, tokenized and ordered by
    shared prefix together. Larger windows find more shared prefixes and hold more rows in
    memory. It does not change results, so it is not in the fingerprint.
    """

    path: str = Field(min_length=1)
    prompt_column: str | None = Field(default="prompt", min_length=1)
    messages_column: str | None = Field(default=None, min_length=1)
    id_column: str | None = Field(default="id", min_length=1)
    keep_columns: StrList = ()
    # a JSON schema per row (a JSON string, or a struct read as a mapping): structured output
    schema_column: str | None = Field(default=None, min_length=1)
    # auto: from the extension (a folder: from its files); openai_batch: OpenAI Batch API lines
    format: Literal["auto", "parquet", "jsonl", "csv", "arrow", "openai_batch"] = "auto"
    # sampling key -> input column whose non-null values override it per row
    sampling_columns: dict[str, Annotated[str, Field(min_length=1)]] = Field(default_factory=dict)
    window_rows: int = Field(default=10000, ge=1)

    @model_validator(mode="before")
    @classmethod
    def _prompt_default_yields_to_messages(cls, data: Any) -> Any:
        # The "prompt" default applies only while messages_column is null.
        if isinstance(data, Mapping) and data.get("messages_column") is not None:
            data = {"prompt_column": None, **data}
        return data

    @model_validator(mode="before")
    @classmethod
    def _openai_batch_columns(cls, data: Any) -> Any:
        # An OpenAI batch file fixes its columns: custom_id is the id, the body the prompt,
        # the sampling settings and the schema (batchgen.openai_batch).
        if isinstance(data, Mapping) and data.get("format") == "openai_batch":
            given = [k for k in OPENAI_BATCH_FIXED if k in data]
            if given:
                raise ValueError(
                    f"input.{given[0]} does not apply to format openai_batch (custom_id is the "
                    "id; each line's body holds the prompt and its sampling settings)"
                )
            data = {**data, "id_column": "custom_id", "schema_column": "response_format"}
        return data

    @model_validator(mode="after")
    def _exactly_one_prompt_source(self) -> InputConfig:
        if self.prompt_column is not None and self.messages_column is not None:
            raise ValueError("set only one of prompt_column and messages_column")
        if self.prompt_column is None and self.messages_column is None:
            raise ValueError("set one of prompt_column and messages_column")
        if len(set(self.keep_columns)) != len(self.keep_columns):
            raise ValueError("keep_columns lists a column twice")
        unknown = [k for k in self.sampling_columns if k not in ROW_SAMPLING_KEYS]
        if unknown:
            raise ValueError(
                f"sampling_columns: {unknown[0]!r} cannot be set per row (per-row keys: "
                f"{', '.join(ROW_SAMPLING_KEYS)})"
            )
        return self


class OutputConfig(_Section):
    """``output:``: the results folder.

    Extensions (docs/job-file.md): finished rows are committed to disk (a new part file and the
    manifest) once ``commit_rows`` output rows are buffered or ``commit_seconds`` have passed
    since the last commit, whichever comes first. They bound the work lost to a crash; they do
    not change results and are not in the fingerprint.
    """

    path: PathOrUri
    commit_rows: int = Field(default=1000, ge=1)
    commit_seconds: Float = Field(default=5.0, gt=0)


# The structured-output keys whose outputs are JSON (``json`` is ``json: true``).
JSON_KEYS = ("json_schema", "json_schema_file", "json")


class StructuredConfig(_Section):
    """``sampling.structured:``: the form every output must take; exactly one constraint key is
    set (or ``json_layout`` alone, see below).

    ``json_schema`` (a mapping) or ``json_schema_file`` (a path, relative to the job file): a
    JSON value valid against the schema; ``json: true``: any JSON object; ``regex``: text the
    expression matches as a whole; ``choice``: exactly one of the strings; ``grammar``: a Lark
    grammar (llguidance's dialect, start rule ``start``). Whether the library accepts the schema,
    expression or grammar is checked when the job starts (:mod:`batchgen.structured`).

    ``json_layout`` applies to every JSON output (the keys above and the rows' schemas of
    ``input.schema_column``): ``auto`` allows the whitespace models write between JSON tokens,
    bounded per gap; ``compact`` allows none. It may be given alone only with
    ``input.schema_column`` (checked by :class:`Job`); with regex, choice or grammar it is an error.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, populate_by_name=True)

    json_schema: dict[str, Any] | None = None
    json_schema_file: PathValue | None = None
    json_object: bool = Field(default=False, alias="json")
    regex: str | None = Field(default=None, min_length=1)
    choice: tuple[Annotated[str, Field(min_length=1)], ...] | None = Field(
        default=None, min_length=1, strict=False
    )
    grammar: str | None = Field(default=None, min_length=1)
    json_layout: Literal["auto", "compact"] = "auto"

    def _constraint_keys(self) -> list[str]:
        """The constraint keys that are set (``json`` for ``json: true``)."""
        values = (
            ("json_schema", self.json_schema),
            ("json_schema_file", self.json_schema_file),
            ("json", self.json_object or None),
            ("regex", self.regex),
            ("choice", self.choice),
            ("grammar", self.grammar),
        )
        return [name for name, value in values if value is not None]

    @property
    def constraint_key(self) -> str | None:
        """The constraint key that is set; None when only ``json_layout`` is."""
        given = self._constraint_keys()
        return given[0] if given else None

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredConfig:
        given = self._constraint_keys()
        keys = "json_schema, json_schema_file, json: true, regex, choice, grammar"
        if len(given) > 1:
            raise ValueError(f"set only one of {keys} (got {', '.join(given)})")
        layout_given = "json_layout" in self.model_fields_set
        if not given and not layout_given:
            raise ValueError(f"set one of {keys}")
        if given and given[0] not in JSON_KEYS and layout_given:
            raise ValueError(
                f"json_layout applies to JSON outputs (json_schema, json_schema_file, json: true "
                f"or input.schema_column), not to {given[0]}"
            )
        if self.choice is not None and len(set(self.choice)) != len(self.choice):
            raise ValueError("choice lists a string twice")
        return self


class SamplingConfig(_Section):
    """``sampling:``: how tokens are drawn (all of it is in the fingerprint)."""

    n: int = Field(default=1, ge=1)
    max_tokens: int = Field(default=256, ge=1)
    temperature: Float = Field(default=1.0, ge=0)  # 0 means greedy
    top_p: Float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=0)  # 0 means off
    min_p: Float = Field(default=0.0, ge=0, le=1)
    repetition_penalty: Float = Field(default=1.0, gt=0)
    presence_penalty: Float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: Float = Field(default=0.0, ge=-2, le=2)
    stop: StrList = ()
    stop_token_ids: IntList = ()
    ignore_eos: bool = False
    seed: int = Field(default=0, ge=0)
    logprobs: bool = False
    structured: StructuredConfig | None = None


# Sampling keys a row may override (input.sampling_columns): every key of ``sampling:`` but these.
# Not logprobs (it decides the output columns) nor structured (input.schema_column is the per-row
# constraint).
JOB_ONLY_SAMPLING_KEYS = ("logprobs", "structured")
ROW_SAMPLING_KEYS: tuple[str, ...] = tuple(
    key for key in SamplingConfig.model_fields if key not in JOB_ONLY_SAMPLING_KEYS
)


_DEVICE_RE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


class EngineConfig(_Section):
    """``engine:``: how the work is done. Not in the fingerprint, a job may resume with others,
    except the numerics it resolves to (``dtype`` and ``kv_cache_dtype``, see
    :func:`batchgen.fingerprint.numerics`).

    ``kv_cache_memory`` is a positive int of bytes or ``"auto"`` after validation.
    """

    device: str = "auto"
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    # auto: the resolved dtype; int8 / fp8_e4m3: one fp32 scale per token and KV head
    kv_cache_dtype: Literal["auto", "float32", "bfloat16", "float16", "int8", "fp8_e4m3"] = "auto"
    block_size: int = Field(default=16, ge=1)
    kv_cache_memory: MemorySize = "auto"
    kv_cache_blocks: int | None = Field(default=None, ge=1)
    max_num_seqs: int = Field(default=256, ge=1)
    max_num_batched_tokens: int = Field(default=8192, ge=1)
    max_model_len: int | None = Field(default=None, ge=1)
    attention_backend: Literal["auto", "torch", "triton"] = "auto"
    prefix_caching: bool = True
    cuda_graphs: Literal["auto", "on", "off"] = "off"
    # launch each step before reading the previous step's tokens back; auto: on CUDA devices
    overlap: Literal["auto", "on", "off"] = "auto"

    @field_validator("cuda_graphs", "overlap", mode="before")
    @classmethod
    def _yaml_booleans(cls, value: Any) -> Any:
        """YAML 1.1 reads a bare ``on`` / ``off`` as a boolean."""
        if isinstance(value, bool):
            return "on" if value else "off"
        return value

    @field_validator("device")
    @classmethod
    def _known_device(cls, value: str) -> str:
        if not _DEVICE_RE.match(value):
            raise ValueError("must be auto, cpu, cuda or cuda:N")
        return value

    @field_validator("block_size")
    @classmethod
    def _power_of_two(cls, value: int) -> int:
        if value & (value - 1):
            raise ValueError("must be a power of two")
        return value


class ExecutorConfig(_Section):
    """``executor:``: where the engines run. Not in the fingerprint: a job may be resumed with
    another executor (the results do not depend on it).

    ``kind: local`` (the default) runs one engine in this process. ``kind: ray`` runs
    ``num_workers`` engines as Ray actors (needs ``pip install 'batchgen[ray]'``); this process
    plans the shards (rows sharing a prefix go to one worker) and alone writes the output folder.
    The other keys apply to ``kind: ray`` only:

    - ``address``: null starts a local Ray cluster for the job; ``auto`` joins the cluster
      started with ``ray start`` on this machine; ``ray://host:10001`` joins a remote one.
    - ``num_workers``: null means as many as the cluster holds (its GPUs / ``num_gpus`` when
      workers use GPUs, else its CPUs / ``num_cpus``).
    - ``num_cpus``, ``num_gpus``: Ray resources per worker; ``num_gpus`` null means 1 when the
      cluster has GPUs, else 0.
    - ``max_restarts``: how often Ray restarts a worker that died (its unfinished rows are run
      again by the restarted worker) before the job fails.
    """

    kind: Literal["local", "ray"] = "local"
    address: str | None = Field(default=None, min_length=1)
    num_workers: int | None = Field(default=None, ge=1)
    num_cpus: Float = Field(default=1.0, ge=0)
    num_gpus: Float | None = Field(default=None, ge=0)
    max_restarts: int = Field(default=3, ge=0)


class StorageConfig(_Section):
    """``storage:``: how ``s3://`` paths are reached (optional; every key has a default).

    ``endpoint_url`` (e.g. ``http://minio:9000``) and ``region`` override the AWS variables
    (``AWS_ENDPOINT_URL``, ``AWS_REGION`` / ``AWS_DEFAULT_REGION``). Credentials are never
    keys here: they come from AWS's usual chain (``AWS_ACCESS_KEY_ID`` /
    ``AWS_SECRET_ACCESS_KEY``, a profile, an instance role), so they never reach the output
    folder or the fingerprint. Extension (docs/job-file.md): ``lease_seconds``, how long a writer's
    lease on an ``s3://`` output stays valid without renewal (see batchgen.storage.ObjectLease).
    None of it is in the fingerprint.
    """

    endpoint_url: str | None = Field(default=None, min_length=1)
    region: str | None = Field(default=None, min_length=1)
    lease_seconds: Float = Field(default=60.0, ge=1)


class Job(_Section):
    """A whole job file. ``model``, ``input.path`` and ``output.path`` are required.

    After :func:`~batchgen.jobfile.load_job`, ``input.path`` and ``output.path`` are absolute (or
    ``s3://`` URIs), and ``model`` is absolute, unless it is a hub id (``org/name`` that names no
    local path), which stays relative and is resolved by :func:`batchgen.model.hub.resolve_model`
    (with ``revision``: a branch, tag or commit).
    """

    model: PathValue
    revision: str | None = Field(default=None, min_length=1)
    input: InputConfig
    output: OutputConfig
    sampling: SamplingConfig = SamplingConfig()
    engine: EngineConfig = EngineConfig()
    executor: ExecutorConfig = ExecutorConfig()
    storage: StorageConfig = StorageConfig()

    @property
    def hub_id(self) -> str | None:
        """``model`` as a hub id (``org/name``), None when it is a local folder."""
        text = self.model.as_posix()
        return text if not self.model.is_absolute() and HUB_ID_RE.match(text) else None

    @model_validator(mode="after")
    def _json_layout_needs_json(self) -> Job:
        # json_layout alone lays out the rows' own schemas; without them it would do nothing.
        spec = self.sampling.structured
        if spec is not None and spec.constraint_key is None and self.input.schema_column is None:
            raise ValueError(
                "sampling.structured.json_layout: there is no JSON output to lay out; set "
                "json_schema, json_schema_file or json: true beside it, or input.schema_column"
            )
        return self

    @model_validator(mode="before")
    @classmethod
    def _empty_sections_are_defaults(cls, data: Any) -> Any:
        # "sampling:" with every child commented out parses as null: mean the defaults.
        if isinstance(data, Mapping):
            data = {
                k: ({} if v is None and k in ("sampling", "engine", "executor", "storage") else v)
                for k, v in data.items()
            }
        return data


__all__ = [
    "EngineConfig",
    "ExecutorConfig",
    "OPENAI_BATCH_FIXED",
    "ROW_SAMPLING_KEYS",
    "InputConfig",
    "JSON_KEYS",
    "Job",
    "OutputConfig",
    "SamplingConfig",
    "StorageConfig",
    "StructuredConfig",
    "parse_memory",
]
