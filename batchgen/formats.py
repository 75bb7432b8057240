"""Tabular input files of every format as Arrow record batches: Parquet, JSON Lines, CSV, Arrow
IPC (file or stream format, also the arrow files of a ``datasets.Dataset.save_to_disk`` folder).

One class per format, one interface (:class:`InputFile`): :meth:`~InputFile.scan` gives the
file's schema and row count, :meth:`~InputFile.batches` streams chosen columns with exactly that
schema's types. Parsing is pyarrow's; what is ours is the unit of reading and the error lines:

- JSON Lines are read in chunks of whole lines, each by ``pyarrow.json``. The file's schema is
  the unification (int and float widen to float, null to anything) of its chunks' inferred
  schemas, and every chunk is read again with that schema, so types never change mid-file.
  pyarrow's parse errors count rows within a block, not lines in the file: on an error the chunk
  is checked line by line (``json.loads``, and each top-level field's JSON kind against the
  lines before it) to name the first bad line.
- CSV is read by ``pyarrow.csv``'s streaming reader (quoted values may span lines). Its types
  are decided over the whole file, not its first block: the scan reads every column as text and
  keeps, per column, the first of int64, float64, bool (true/false) and string that every value
  converts to; ``text_columns`` stay strings. A malformed row (wrong field count) is located with the
  standard ``csv`` module, which counts physical lines.

Every problem is an :class:`~batchgen.errors.InputError` of one line naming the file (and line).
"""

from __future__ import annotations

import csv
import io
import json
from abc import ABC, abstractmethod
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any, BinaryIO

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pcsv
import pyarrow.json as pjson
import pyarrow.parquet as pq

from batchgen.errors import InputError

# Extension -> format; "auto" detection of a file (a folder is decided by dataset.py).
EXTENSIONS: dict[str, str] = {
    ".parquet": "parquet",
    ".pq": "parquet",
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".json": "jsonl",
    ".csv": "csv",
    ".arrow": "arrow",
    ".feather": "arrow",
    ".ipc": "arrow",
}
TABULAR_FORMATS = ("parquet", "jsonl", "csv", "arrow")
_JSON_CHUNK_BYTES = 8 << 20  # bytes of whole lines parsed by pyarrow.json at a time
_CSV_BLOCK_BYTES = 8 << 20


def format_of(path: Path) -> str | None:
    """The format a file's extension names, or None."""
    return EXTENSIONS.get(path.suffix.lower())


class InputFile(ABC):
    """One input file. ``scan`` first (it decides the types), then ``batches`` any number of
    times."""

    def __init__(
        self, path: Path | str, text_columns: Collection[str] = (), source: Any = None
    ) -> None:
        """``path``: a local file, or (with ``source``) the name an object store file is shown
        by; ``source``: ``(pyarrow filesystem, path in it)`` for a file on an object store."""
        self.path = path
        self.source = source
        self.text_columns = frozenset(text_columns)  # read as strings whatever they look like
        self.schema: pa.Schema | None = None

    def _open(self) -> BinaryIO:
        """The file, binary, buffered and seekable (local, or through ``source``)."""
        if self.source is None:
            return open(self.path, "rb")
        fs, where = self.source
        return io.BufferedReader(fs.open_input_file(where))

    @abstractmethod
    def scan(self) -> tuple[pa.Schema, int]:
        """The file's schema and number of rows (reads the whole file where the format keeps
        no row count: JSON Lines, CSV, Arrow streams)."""

    @abstractmethod
    def batches(self, columns: list[str], batch_size: int) -> Iterator[pa.RecordBatch]:
        """Record batches of these columns (in this order), at most ``batch_size`` rows each,
        typed as :meth:`scan` said."""

    def _fail(self, err: BaseException) -> InputError:
        return InputError(f"cannot read input file {self.path}: {_one_line(err)}")


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split()) or type(err).__name__


def open_input_file(
    path: Path | str, fmt: str, text_columns: Collection[str] = (), source: Any = None
) -> InputFile:
    """The reader of ``path`` in format ``fmt`` (one of :data:`TABULAR_FORMATS`); ``source``
    as for :class:`InputFile`."""
    cls = {"parquet": ParquetFile, "jsonl": JsonLinesFile, "csv": CsvFile, "arrow": ArrowFile}
    return cls[fmt](path, text_columns, source)


# --------------------------------------------------------------------------- Parquet


class ParquetFile(InputFile):
    def scan(self) -> tuple[pa.Schema, int]:
        try:
            with self._open() as fh:
                meta = pq.read_metadata(fh)
            self.schema = meta.schema.to_arrow_schema()
        except (OSError, pa.ArrowException) as err:
            raise InputError(f"input file {self.path} is not a Parquet file ({err})") from None
        return self.schema, meta.num_rows

    def batches(self, columns: list[str], batch_size: int) -> Iterator[pa.RecordBatch]:
        try:
            with self._open() as fh:
                yield from pq.ParquetFile(fh).iter_batches(batch_size=batch_size, columns=columns)
        except (OSError, pa.ArrowException) as err:
            raise self._fail(err) from None


# --------------------------------------------------------------------------- Arrow IPC


class ArrowFile(InputFile):
    """Arrow IPC, file format (``.arrow``, Feather v2) or stream format (what ``datasets``
    writes); memory-mapped when local, so batches are not copied."""

    def _reader(self) -> Any:
        source = pa.memory_map(str(self.path)) if self.source is None else self._open()
        try:
            return pa.ipc.open_file(source)
        except pa.ArrowInvalid:
            source.seek(0)
            return pa.ipc.open_stream(source)

    def _all_batches(self) -> Iterator[pa.RecordBatch]:
        reader = self._reader()
        if isinstance(reader, pa.ipc.RecordBatchFileReader):
            for i in range(reader.num_record_batches):
                yield reader.get_batch(i)
        else:
            yield from reader

    def scan(self) -> tuple[pa.Schema, int]:
        try:
            self.schema = self._reader().schema
            rows = sum(b.num_rows for b in self._all_batches())
        except (OSError, pa.ArrowException) as err:
            raise InputError(
                f"input file {self.path} is not an Arrow IPC file ({_one_line(err)})"
            ) from None
        return self.schema, rows

    def batches(self, columns: list[str], batch_size: int) -> Iterator[pa.RecordBatch]:
        try:
            for batch in self._all_batches():
                batch = batch.select(columns)
                for start in range(0, batch.num_rows, batch_size):
                    yield batch.slice(start, batch_size)
        except (OSError, pa.ArrowException) as err:
            raise self._fail(err) from None


# --------------------------------------------------------------------------- JSON Lines


def _value_kinds(value: Any, path: str) -> Iterator[tuple[str, str]]:
    """(path, kind) of a JSON value and of everything inside it, kinds as pyarrow's inference
    sees them (numbers are one kind: ints widen to floats; null fits anything). Paths: ``a``,
    ``a.b``, ``a[]`` for the items of a list."""
    if value is None:
        return
    if isinstance(value, bool):
        yield path, "boolean"
    elif isinstance(value, (int, float)):
        yield path, "number"
    elif isinstance(value, str):
        yield path, "string"
    elif isinstance(value, list):
        yield path, "array"
        for item in value:
            yield from _value_kinds(item, path + "[]")
    else:
        yield path, "object"
        for key, item in value.items():
            yield from _value_kinds(item, f"{path}.{key}")


def _type_kinds(t: pa.DataType, path: str) -> Iterator[tuple[str, str]]:
    """(path, kind) of an Arrow type as :func:`_value_kinds` names JSON values."""
    if pa.types.is_null(t):
        return
    if pa.types.is_boolean(t):
        yield path, "boolean"
    elif pa.types.is_integer(t) or pa.types.is_floating(t):
        yield path, "number"
    elif pa.types.is_struct(t):
        yield path, "object"
        for i in range(t.num_fields):
            yield from _type_kinds(t.field(i).type, f"{path}.{t.field(i).name}")
    elif pa.types.is_list(t) or pa.types.is_large_list(t):
        yield path, "array"
        yield from _type_kinds(t.value_type, path + "[]")
    else:
        yield path, "string"


class JsonLinesFile(InputFile):
    """JSON Lines: one object per line; blank lines are skipped."""

    def _chunks(self, fh: BinaryIO) -> Iterator[tuple[int, bytes]]:
        """(1-based number of the chunk's first line, whole lines of about _JSON_CHUNK_BYTES)."""
        first, line_no, size = 1, 1, 0
        lines: list[bytes] = []
        for line in fh:
            lines.append(line)
            size += len(line)
            line_no += 1
            if size >= _JSON_CHUNK_BYTES:
                yield first, b"".join(lines)
                first, size, lines = line_no, 0, []
        if lines:
            yield first, b"".join(lines)

    def _read(self, data: bytes, schema: pa.Schema | None) -> pa.Table:
        parse = (
            pjson.ParseOptions(explicit_schema=schema, unexpected_field_behavior="ignore")
            if schema is not None
            else pjson.ParseOptions()
        )
        # One block per chunk: a block boundary never splits what the chunk's line numbers cover.
        read = pjson.ReadOptions(block_size=max(len(data) + 1, 1 << 20), use_threads=False)
        return pjson.read_json(pa.BufferReader(data), read_options=read, parse_options=parse)

    def _locate(
        self, first: int, data: bytes, known: pa.Schema | None, err: BaseException
    ) -> InputError:
        """The error line of a chunk pyarrow could not read: its first line that is not a JSON
        object, or where a field (also one nested in objects and lists) has another kind than
        before in this file."""
        kinds: dict[str, tuple[str, str]] = {}  # path -> (kind, where it was seen first)
        if known is not None:
            for f in known:
                for path, kind in _type_kinds(f.type, f.name):
                    kinds[path] = (kind, "earlier lines")
        for offset, raw in enumerate(data.split(b"\n")):
            line = first + offset
            if not raw.strip():
                continue
            where = f"input file {self.path} line {line}"
            try:
                value = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as jerr:
                return InputError(f"{where} is not valid JSON: {_one_line(jerr)}")
            if not isinstance(value, dict):
                return InputError(f"{where} is not a JSON object (JSON Lines: one object per line)")
            for key, item in value.items():
                for path, kind in _value_kinds(item, key):
                    seen = kinds.setdefault(path, (kind, f"line {line}"))
                    if seen[0] != kind:
                        return InputError(
                            f"{where}: field {path!r} is a JSON {kind}, but a {seen[0]} on "
                            f"{seen[1]}"
                        )
        last = first + data.count(b"\n")
        return InputError(f"input file {self.path} lines {first}-{last}: {_one_line(err)}")

    def scan(self) -> tuple[pa.Schema, int]:
        schema: pa.Schema | None = None
        rows = 0
        try:
            with self._open() as fh:
                for first, data in self._chunks(fh):
                    if not data.strip():
                        continue
                    try:
                        table = self._read(data, None)
                        chunk_schema = table.schema
                        if schema is not None:
                            chunk_schema = pa.unify_schemas(
                                [schema, chunk_schema], promote_options="permissive"
                            )
                    except (pa.ArrowInvalid, pa.ArrowTypeError) as err:
                        raise self._locate(first, data, schema, err) from None
                    schema = chunk_schema
                    rows += table.num_rows
        except OSError as err:
            raise self._fail(err) from None
        self.schema = schema if schema is not None else pa.schema([])
        return self.schema, rows

    def batches(self, columns: list[str], batch_size: int) -> Iterator[pa.RecordBatch]:
        assert self.schema is not None, "scan first"
        wanted = pa.schema([self.schema.field(c) for c in columns])
        try:
            with self._open() as fh:
                for first, data in self._chunks(fh):
                    if not data.strip():
                        continue
                    try:
                        table = self._read(data, wanted)
                    except (pa.ArrowInvalid, pa.ArrowTypeError) as err:
                        raise self._locate(first, data, self.schema, err) from None
                    yield from table.select(columns).to_batches(max_chunksize=batch_size)
        except OSError as err:
            raise self._fail(err) from None


# --------------------------------------------------------------------------- CSV


class CsvFile(InputFile):
    """CSV with a header line; empty fields are nulls; quoted values may span lines."""

    _PARSE = pcsv.ParseOptions(newlines_in_values=True)

    def _stream(self, column_types: dict[str, pa.DataType], include: list[str] | None) -> Any:
        return pcsv.open_csv(
            self._open(),
            read_options=pcsv.ReadOptions(block_size=_CSV_BLOCK_BYTES, use_threads=False),
            parse_options=self._PARSE,
            convert_options=pcsv.ConvertOptions(
                column_types=column_types,
                include_columns=include,
                strings_can_be_null=True,
                quoted_strings_can_be_null=False,
            ),
        )

    def _header(self) -> list[str]:
        reader = pcsv.open_csv(
            self._open(),
            read_options=pcsv.ReadOptions(block_size=1 << 16, use_threads=False),
            parse_options=self._PARSE,
        )
        return list(reader.schema.names)

    def _locate(self, err: BaseException) -> InputError:
        """The first row whose number of fields differs from the header's, by physical line."""
        try:
            with io.TextIOWrapper(
                self._open(), newline="", encoding="utf-8", errors="replace"
            ) as fh:
                reader = csv.reader(fh)
                header = next(reader, [])
                start = reader.line_num + 1
                for record in reader:
                    if record and len(record) != len(header):
                        return InputError(
                            f"input file {self.path} line {start}: {len(record)} fields, "
                            f"the header has {len(header)}"
                        )
                    start = reader.line_num + 1
        except csv.Error as cerr:
            return InputError(f"input file {self.path} line {start}: {_one_line(cerr)}")
        return self._fail(err)

    def scan(self) -> tuple[pa.Schema, int]:
        try:
            names = self._header()
            candidates: dict[str, list[pa.DataType]] = {
                n: [] if n in self.text_columns else [pa.int64(), pa.float64(), pa.bool_()]
                for n in names
            }
            rows = 0
            for batch in self._stream(dict.fromkeys(names, pa.string()), None):
                rows += batch.num_rows
                for name, column in zip(batch.schema.names, batch.columns, strict=True):
                    candidates[name] = [t for t in candidates[name] if _casts(column, t)]
        except pa.ArrowInvalid as err:
            raise self._locate(err) from None
        except (OSError, pa.ArrowException) as err:
            raise self._fail(err) from None
        fields = [pa.field(n, (candidates[n] or [pa.string()])[0]) for n in names]
        self.schema = pa.schema(fields)
        return self.schema, rows

    def batches(self, columns: list[str], batch_size: int) -> Iterator[pa.RecordBatch]:
        assert self.schema is not None, "scan first"
        types = {c: self.schema.field(c).type for c in columns}
        try:
            for batch in self._stream(types, columns):
                batch = batch.select(columns)
                for start in range(0, batch.num_rows, batch_size):
                    yield batch.slice(start, batch_size)
        except pa.ArrowInvalid as err:
            raise self._locate(err) from None
        except (OSError, pa.ArrowException) as err:
            raise self._fail(err) from None


def _casts(column: pa.Array, t: pa.DataType) -> bool:
    """Whether every non-null text value of ``column`` converts to ``t``."""
    if pa.types.is_boolean(t):  # the spellings pyarrow.csv converts
        words = pa.array(["true", "True", "TRUE", "false", "False", "FALSE"])
        return pc.all(pc.is_in(column.drop_null(), words)).as_py() is not False
    try:
        pc.cast(column, t, safe=True)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        return False
    return True


__all__ = [
    "EXTENSIONS",
    "TABULAR_FORMATS",
    "ArrowFile",
    "CsvFile",
    "InputFile",
    "JsonLinesFile",
    "ParquetFile",
    "format_of",
    "open_input_file",
]
