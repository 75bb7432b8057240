"""Rows in: resolve the input files (Parquet, JSON Lines, CSV, Arrow IPC, a ``datasets``
folder: :mod:`batchgen.formats`; OpenAI batch files: :mod:`batchgen.openai_batch`), check their
columns and ids, stream rows in windows.

The dataset is never held in memory whole: construction reads the files' metadata and the id
column only (to prove ids unique); :meth:`InputDataset.iter_windows` streams record batches of
just the needed columns. Every problem with the input is an :class:`~batchgen.errors.InputError`
with one line naming the file and column.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
from collections.abc import Callable, Container, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from batchgen.errors import InputError
from batchgen.formats import EXTENSIONS, TABULAR_FORMATS, InputFile, format_of, open_input_file
from batchgen.job import InputConfig
from batchgen.openai_batch import OpenAIBatchInput
from batchgen.schema import RESULT_COLUMNS
from batchgen.storage import S3_SCHEME, StorageSettings, is_uri, list_object_files

_GLOB_CHARS = frozenset("*?[")
_ID_SCAN_BATCH = 65536  # rows per batch while scanning the id column


@dataclass(frozen=True)
class InputRow:
    """One input row.

    ``id`` comes from ``id_column``, or is the 0-based position over all files when it is null.
    Exactly one of the prompt sources is configured; its value may still be null in the data
    (the runner turns that row into ``error`` samples). ``messages`` is a list of
    ``{"role", "content"}`` dicts (other struct fields are dropped; a null message stays None).
    ``problem`` says why the row cannot be used as read (a value that is not valid UTF-8; that
    value is None); the runner turns such a row into ``error`` samples. ``schema`` is the row's
    value of ``schema_column`` as read (a JSON string, a mapping from a struct, or None).
    ``sampling``: the row's sampling overrides, sampling key -> value (non-null values of
    ``sampling_columns``, or an OpenAI batch line's body fields), as read until
    :class:`~batchgen.prompts.PromptEncoder` checked them, then normalized (None: none).
    """

    id: int | str
    prompt: str | None
    messages: list[dict[str, Any] | None] | None
    keep: dict[str, Any]
    problem: str | None = None
    schema: Any = None
    sampling: Mapping[str, Any] | None = None
    # score jobs: the row's continuations as read (a list from choices_column, a string from
    # completion_column; None: null)
    choices: Any = None

    def num_samples(self, default: int) -> int:
        """The row's ``n``: its override once checked (see :mod:`batchgen.prompts`), else the
        job's ``default``."""
        n = (self.sampling or {}).get("n")
        return n if isinstance(n, int) and not isinstance(n, bool) and n >= 1 else default


def _datasets_folder_files(path: Path) -> list[Path] | None:
    """The arrow files of a ``datasets.Dataset.save_to_disk`` folder, in its order (None: the
    folder is not one)."""
    state = path / "state.json"
    if (path / "dataset_dict.json").is_file():
        splits = sorted(p.name for p in path.iterdir() if (p / "state.json").is_file())
        raise InputError(
            f"input folder {path} holds a DatasetDict (splits: {', '.join(splits) or 'none'}); "
            "set input.path to one split's folder"
        )
    if not (state.is_file() and (path / "dataset_info.json").is_file()):
        return None
    try:
        names = [
            f["filename"] for f in json.loads(state.read_text(encoding="utf-8"))["_data_files"]
        ]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise InputError(f"input folder {path}: cannot read state.json ({err})") from None
    files = [path / n for n in names]
    missing = [f for f in files if not f.is_file()]
    if missing or not files:
        raise InputError(
            f"input folder {path}: state.json lists {missing[0].name if missing else 'no files'}"
            f"{' which is missing' if missing else ''}"
        )
    return files


def _format_of(file: Path, given: str) -> str:
    if given != "auto":
        return given
    fmt = format_of(file)
    if fmt is None:
        raise InputError(
            f"cannot tell the format of input file {file} from its extension; set input.format "
            f"({', '.join(TABULAR_FORMATS)} or openai_batch)"
        )
    return fmt


def resolve_input_files(spec: str, fmt: str = "auto") -> list[Path]:
    """The input files of :func:`resolve_inputs`, without their formats."""
    return [path for path, _ in resolve_inputs(spec, fmt)]


def resolve_object_inputs(
    spec: str, fmt: str, storage: StorageSettings | None
) -> tuple[Any, list[tuple[str, str, str]]]:
    """The input files of an ``s3://`` ``input.path`` (an object, a prefix's objects of the
    format's extension, ``.parquet`` with ``auto``, or a glob): the pyarrow filesystem and, per
    file, ``(s3:// URI, format, path in the filesystem)``."""
    want = "jsonl" if fmt == "openai_batch" else fmt
    suffix = next(e for e, f in EXTENSIONS.items() if f == ("parquet" if want == "auto" else want))
    fs, keys = list_object_files(spec, storage, suffix)
    return fs, [(f"{S3_SCHEME}{k}", _format_of(Path(k), fmt), k) for k in keys]


def resolve_inputs(spec: str, fmt: str = "auto") -> list[tuple[Path, str]]:
    """The input files and the format of each: a file; a folder (a ``save_to_disk`` folder's
    arrow files, or its files of the format, not recursive, skipping names starting with ``_``
    or ``.``; with ``auto`` the files of a known extension, all of one format); or a glob
    (``**`` recurses). In sorted order, but a ``save_to_disk`` folder's in its own."""
    path = Path(spec)
    if path.is_file():
        return [(path, _format_of(path, fmt))]
    if path.is_dir():
        arrow = _datasets_folder_files(path) if fmt in ("auto", "arrow") else None
        if arrow is not None:
            return [(f, "arrow") for f in arrow]
        named = sorted(
            p
            for p in path.iterdir()
            if p.is_file() and not p.name.startswith(("_", ".")) and format_of(p) is not None
        )
        want = "jsonl" if fmt == "openai_batch" else fmt
        if want != "auto":
            files = [(p, fmt) for p in named if format_of(p) == want]
        else:
            files = [(p, _format_of(p, "auto")) for p in named]
            kinds = sorted({f for _, f in files})
            if len(kinds) > 1:
                raise InputError(
                    f"input folder {path} holds files of several formats ({', '.join(kinds)}); "
                    "set input.format or use a glob"
                )
        if not files:
            first = "parquet" if want == "auto" else want
            exts = [e for e, f in EXTENSIONS.items() if f == first][: 1 if want == "auto" else None]
            others = [e for e in EXTENSIONS if want == "auto" and e not in exts]
            nor = f" nor {', '.join('*' + e for e in others)} files" if others else ""
            raise InputError(
                f"input folder {path} holds no {', '.join('*' + e for e in exts)} files{nor}"
            )
        return files
    if _GLOB_CHARS & set(spec):
        matched = sorted(Path(m) for m in glob.glob(spec, recursive=True) if os.path.isfile(m))
        if not matched:
            raise InputError(f"input.path {spec} matches no files")
        return [(m, _format_of(m, fmt)) for m in matched]
    raise InputError(f"input.path {spec} does not exist")


def _is_view(t: pa.DataType, kind: str) -> bool:
    """``is_string_view`` / ``is_list_view``, which older pyarrow versions lack."""
    check = getattr(pa.types, f"is_{kind}_view", None)
    return bool(check and check(t))


def _is_string(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t) or _is_view(t, "string")


def _is_messages_type(t: pa.DataType) -> bool:
    """list<struct<role: string, content: string, ...>> (list, large_list or list_view)."""
    if not (pa.types.is_list(t) or pa.types.is_large_list(t) or _is_view(t, "list")):
        return False
    item = t.value_type
    if not pa.types.is_struct(item):
        return False
    names = {item.field(i).name: item.field(i).type for i in range(item.num_fields)}
    return all(
        key in names and (_is_string(names[key]) or pa.types.is_null(names[key]))
        for key in ("role", "content")
    )


def _id_kind(t: pa.DataType) -> pa.DataType | None:
    """The output id type for an input id column type: int64, string, or None if unsupported."""
    if pa.types.is_integer(t):
        return pa.int64()
    if _is_string(t):
        return pa.string()
    return None


def _is_string_list(t: pa.DataType) -> bool:
    return (pa.types.is_list(t) or pa.types.is_large_list(t)) and _is_string(t.value_type)


# Input keys naming a column of a required type (null columns pass too): key, check, expected.
_TYPED_COLUMNS: tuple[tuple[str, Callable[[pa.DataType], bool], str], ...] = (
    ("prompt_column", _is_string, "string"),
    ("messages_column", _is_messages_type, "list<struct<role: string, content: string>>"),
    (
        "schema_column",
        lambda t: _is_string(t) or pa.types.is_struct(t),
        "a string (JSON) or a struct",
    ),
    ("choices_column", _is_string_list, "list<string>"),
    ("completion_column", _is_string, "string"),
)


class InputDataset:
    """The input of a job: files, checked columns, unique ids; rows streamed in windows.

    Attributes: ``files`` (sorted), ``num_rows``, ``id_type`` (int64 or string), ``keep_fields``
    (the keep columns' fields, as in the first file), ``identity`` (a hash of the files' paths,
    sizes, mtimes, row counts and schemas: cheap, no data read).
    """

    def __init__(self, cfg: InputConfig, storage: StorageSettings | None = None) -> None:
        """``storage``: the job's ``storage:`` section, for an ``s3://`` ``input.path``."""
        self.cfg = cfg
        self._fs: Any = None  # the pyarrow filesystem of s3:// input; None: local files
        inputs: list[tuple[Any, str]]
        if is_uri(cfg.path):
            if cfg.format == "openai_batch":
                raise InputError(
                    "input.format openai_batch reads local files only; copy the batch file "
                    "from object storage first"
                )
            self._fs, objects = resolve_object_inputs(cfg.path, cfg.format, storage)
            inputs = [(uri, fmt) for uri, fmt, _ in objects]
            sources = [(self._fs, where) for _, _, where in objects]
        else:
            inputs = list(resolve_inputs(cfg.path, cfg.format))
            sources = [None] * len(inputs)
        self.files: list[Any] = [path for path, _ in inputs]
        clash = [c for c in cfg.keep_columns if c in RESULT_COLUMNS]
        if clash:
            raise InputError(
                f"input.keep_columns: {', '.join(repr(c) for c in clash)} would collide with "
                "an output column of the same name"
            )
        if cfg.format == "openai_batch":
            self.batch = OpenAIBatchInput(self.files)
            self.num_rows = self.batch.num_rows
            self.identity = self.batch.identity
            self.id_type = pa.string()
            self.keep_fields: list[pa.Field] = []
            return
        self.batch = None
        text = [
            c
            for c in (cfg.prompt_column, cfg.schema_column, cfg.completion_column)
            if c is not None
        ]
        self.readers: list[InputFile] = [
            open_input_file(p, f, text, src) for (p, f), src in zip(inputs, sources, strict=True)
        ]
        schemas: list[pa.Schema] = []
        identity: list[Any] = []
        self.num_rows = 0
        for reader, (file, fmt) in zip(self.readers, inputs, strict=True):
            schema, rows = reader.scan()
            size, mtime_ns, where = self._stat(file)
            schemas.append(schema)
            self.num_rows += rows
            entry = [where, size, mtime_ns, rows, schema.remove_metadata().to_string()]
            identity.append(entry if fmt == "parquet" else [*entry, fmt])
        self.identity = hashlib.sha256(json.dumps(identity).encode()).hexdigest()[:32]
        self.id_type = self._check_columns(schemas)
        self.keep_fields = [schemas[0].field(c) for c in cfg.keep_columns]
        if cfg.id_column is not None:
            self._check_ids()

    def _stat(self, file: Any) -> tuple[int, int, str]:
        """Size, modification time (ns) and full name of an input file (its identity)."""
        if self._fs is None:
            stat = file.stat()
            return stat.st_size, stat.st_mtime_ns, str(file.resolve())
        info = self._fs.get_file_info(str(file)[len(S3_SCHEME) :])
        return int(info.size or 0), int(info.mtime_ns or 0), str(file)

    # -- checks

    def _column_type(self, file: Path, schema: pa.Schema, column: str, key: str) -> pa.DataType:
        index = schema.get_field_index(column)
        if index < 0:
            hint = (
                "; set input.id_column: null to number rows by position"
                if key == "id_column"
                else ""
            )
            names = ", ".join(schema.names[:10]) + (", ..." if len(schema.names) > 10 else "")
            raise InputError(
                f"input file {file} has no column {column!r} (input.{key}); "
                f"its columns: {names}{hint}"
            )
        return schema.field(index).type

    def _check_columns(self, schemas: list[pa.Schema]) -> pa.DataType:
        """Check every file's columns; return the id type."""
        cfg = self.cfg
        id_type: pa.DataType = pa.int64()
        for n, (file, schema) in enumerate(zip(self.files, schemas, strict=True)):
            for key, accepts, expected in _TYPED_COLUMNS:
                column = getattr(cfg, key)
                if column is None:
                    continue
                t = self._column_type(file, schema, column, key)
                if not (accepts(t) or pa.types.is_null(t)):
                    raise InputError(
                        f"input file {file}: column {column!r} (input.{key}) has type {t}, "
                        f"expected {expected}"
                    )
            if cfg.id_column is not None:
                t = self._column_type(file, schema, cfg.id_column, "id_column")
                kind = _id_kind(t)
                if kind is None:
                    raise InputError(
                        f"input file {file}: id column {cfg.id_column!r} has type {t}, "
                        "expected an integer or a string"
                    )
                if n > 0 and kind != id_type:
                    raise InputError(
                        f"input file {file}: id column {cfg.id_column!r} has type {t}, but "
                        f"{self.files[0]} has {id_type} ids"
                    )
                id_type = kind
            for key, column in cfg.sampling_columns.items():
                self._column_type(file, schema, column, f"sampling_columns.{key}")
            for column in cfg.keep_columns:
                t = self._column_type(file, schema, column, "keep_columns")
                first = schemas[0].field(column).type
                if not t.equals(first):
                    raise InputError(
                        f"input file {file}: keep column {column!r} has type {t}, but "
                        f"{self.files[0]} has {first}"
                    )
        return id_type

    def _check_ids(self) -> None:
        """No null and no duplicate ids, over all files. Reads the id column only."""
        column = self.cfg.id_column
        assert column is not None
        chunks: list[pa.Array] = []
        for reader in self.readers:
            file = reader.path
            for batch in reader.batches([column], _ID_SCAN_BATCH):
                ids = batch.column(0)
                if ids.null_count:
                    raise InputError(
                        f"input file {file}: id column {column!r} has "
                        f"{ids.null_count} null value(s)"
                    )
                if _is_string(ids.type):
                    try:
                        ids.validate(full=True)
                    except pa.ArrowInvalid:
                        raise InputError(
                            f"input file {file}: id column {column!r} holds a value "
                            "that is not valid UTF-8"
                        ) from None
                chunks.append(ids.cast(self.id_type))
        ids = pa.chunked_array(chunks, type=self.id_type)
        if pc.count_distinct(ids).as_py() == len(ids):
            return
        counts = pc.value_counts(ids)
        repeated = counts.filter(pc.greater(counts.field("counts"), 1)).field("values")
        shown = ", ".join(repr(v) for v in repeated[:5].to_pylist())
        more = f" and {len(repeated) - 5} more" if len(repeated) > 5 else ""
        raise InputError(f"id column {column!r} has duplicate ids: {shown}{more}")

    # -- reading

    def _columns(self) -> list[str]:
        """The columns to read, each once, in a fixed order."""
        cfg = self.cfg
        wanted = [
            cfg.id_column,
            cfg.prompt_column,
            cfg.messages_column,
            cfg.schema_column,
            cfg.choices_column,
            cfg.completion_column,
            *cfg.sampling_columns.values(),
            *cfg.keep_columns,
        ]
        return list(dict.fromkeys(c for c in wanted if c is not None))

    def iter_windows(
        self, window_rows: int, skip_ids: Container[Any] = ()
    ) -> Iterator[list[InputRow]]:
        """Yield the rows in input order, in lists of at most ``window_rows`` rows (only the last
        may be shorter; none is empty), omitting rows whose id is in ``skip_ids``.

        Positions (the ids when ``id_column`` is null) count over all files, skipped rows
        included, so they do not depend on what was skipped.
        """
        if window_rows < 1:
            raise ValueError("window_rows must be at least 1")
        window: list[InputRow] = []
        for row in self._rows(window_rows, skip_ids):
            window.append(row)
            if len(window) == window_rows:
                yield window
                window = []
        if window:
            yield window

    def _rows(self, window_rows: int, skip_ids: Container[Any]) -> Iterator[InputRow]:
        if self.batch is not None:
            for req in self.batch.rows(skip_ids):
                yield InputRow(
                    id=req.custom_id,
                    prompt=req.prompt,
                    messages=req.messages,  # type: ignore[arg-type]
                    keep={},
                    problem=req.problem,
                    schema=req.schema,
                    sampling=req.sampling or None,
                )
            return
        columns = self._columns()
        position = 0
        for reader in self.readers:
            for batch in reader.batches(columns, min(window_rows, _ID_SCAN_BATCH)):
                yield from self._rows_of(batch, position, skip_ids)
                position += batch.num_rows

    def _rows_of(
        self, batch: pa.RecordBatch, start: int, skip_ids: Container[Any]
    ) -> Iterator[InputRow]:
        cfg = self.cfg
        n = batch.num_rows
        # Row index -> why it cannot be used (the first column that failed to decode).
        problems: dict[int, str] = {}

        def values(name: str | None) -> list[Any]:
            if name is None:
                return [None] * n
            column = batch.column(batch.schema.get_field_index(name))
            try:
                return column.to_pylist()
            except UnicodeDecodeError:
                # Parquet writers need not validate UTF-8; one bad value must not cost the
                # other rows. Decode value by value; a bad one becomes None and its row an error.
                out: list[Any] = []
                for i in range(n):
                    try:
                        out.append(column[i].as_py())
                    except UnicodeDecodeError:
                        out.append(None)
                        problems.setdefault(i, f"input column {name!r} is not valid UTF-8")
                return out

        ids = values(cfg.id_column) if cfg.id_column is not None else range(start, start + n)
        prompts = values(cfg.prompt_column)
        messages = values(cfg.messages_column)
        schemas = values(cfg.schema_column)
        choices = values(cfg.choices_column or cfg.completion_column)
        keep = {c: values(c) for c in cfg.keep_columns}
        sampling = {k: values(c) for k, c in cfg.sampling_columns.items()}
        for i in range(n):
            row_id = ids[i]
            if row_id in skip_ids:
                continue
            overrides = {k: vals[i] for k, vals in sampling.items() if vals[i] is not None}
            yield InputRow(
                id=row_id,
                prompt=prompts[i],
                messages=_messages(messages[i]),
                keep={c: vals[i] for c, vals in keep.items()},
                problem=problems.get(i),
                schema=schemas[i],
                sampling=overrides or None,
                choices=choices[i],
            )


def _messages(value: list[Any] | None) -> list[dict[str, Any] | None] | None:
    if value is None:
        return None
    return [
        None if m is None else {"role": m.get("role"), "content": m.get("content")} for m in value
    ]


__all__ = ["InputDataset", "InputRow", "resolve_input_files", "resolve_inputs"]
