"""Parquet in: file / folder / glob, ids, prompts and messages, keep columns, windows, errors."""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchgen.dataset import InputDataset, InputRow, resolve_input_files
from batchgen.errors import InputError
from batchgen.job import InputConfig


def write(path: Path, columns: dict, schema: pa.Schema | None = None, **kw) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns, schema=schema), path, **kw)
    return path


def prompts(tmp_path: Path, n: int = 5, start: int = 0, name: str = "p.parquet", **extra) -> Path:
    cols = {
        "id": pa.array(range(start, start + n), pa.int64()),
        "prompt": [f"prompt {i}" for i in range(start, start + n)],
        **extra,
    }
    return write(tmp_path / name, cols)


def all_rows(ds: InputDataset, window_rows: int = 1000, skip_ids=()) -> list[InputRow]:
    return [row for window in ds.iter_windows(window_rows, skip_ids) for row in window]


# --------------------------------------------------------------------------- files


def test_single_file(tmp_path: Path) -> None:
    ds = InputDataset(InputConfig(path=str(prompts(tmp_path))))
    assert ds.num_rows == 5
    assert ds.id_type == pa.int64()
    assert ds.keep_fields == []
    rows = all_rows(ds)
    assert [r.id for r in rows] == [0, 1, 2, 3, 4]
    assert rows[2] == InputRow(id=2, prompt="prompt 2", messages=None, keep={})


def test_folder_reads_sorted_parquet_files_only(tmp_path: Path) -> None:
    prompts(tmp_path / "d", 2, start=10, name="b.parquet")
    prompts(tmp_path / "d", 2, start=0, name="a.parquet")
    prompts(tmp_path / "d", 2, start=50, name="_hidden.parquet")
    (tmp_path / "d" / "notes.txt").write_text("not parquet")
    ds = InputDataset(InputConfig(path=str(tmp_path / "d")))
    assert [f.name for f in ds.files] == ["a.parquet", "b.parquet"]
    assert [r.id for r in all_rows(ds)] == [0, 1, 10, 11]


def test_glob_in_sorted_order(tmp_path: Path) -> None:
    prompts(tmp_path, 1, start=2, name="x-2.parquet")
    prompts(tmp_path, 1, start=1, name="x-1.parquet")
    prompts(tmp_path, 1, start=9, name="y.parquet")
    ds = InputDataset(InputConfig(path=str(tmp_path / "x-*.parquet")))
    assert [r.id for r in all_rows(ds)] == [1, 2]
    assert resolve_input_files(str(tmp_path / "**" / "*.parquet")) == sorted(
        tmp_path / n for n in ("x-1.parquet", "x-2.parquet", "y.parquet")
    )


def test_positions_as_ids_count_over_all_files(tmp_path: Path) -> None:
    write(tmp_path / "d" / "a.parquet", {"prompt": ["a0", "a1", "a2"]})
    write(tmp_path / "d" / "b.parquet", {"prompt": ["b0", "b1"]})
    ds = InputDataset(InputConfig(path=str(tmp_path / "d"), id_column=None))
    assert ds.id_type == pa.int64()
    rows = all_rows(ds, window_rows=2)
    assert [(r.id, r.prompt) for r in rows] == [
        (0, "a0"),
        (1, "a1"),
        (2, "a2"),
        (3, "b0"),
        (4, "b1"),
    ]
    # Skipping does not shift positions.
    assert [r.id for r in all_rows(ds, skip_ids={0, 3})] == [1, 2, 4]


def test_string_ids(tmp_path: Path) -> None:
    path = write(tmp_path / "s.parquet", {"uid": ["x", "y"], "prompt": ["p", None]})
    ds = InputDataset(InputConfig(path=str(path), id_column="uid"))
    assert ds.id_type == pa.string()
    rows = all_rows(ds)
    assert [(r.id, r.prompt) for r in rows] == [("x", "p"), ("y", None)]


def test_large_string_and_int32_ids_normalize(tmp_path: Path) -> None:
    schema = pa.schema([("id", pa.int32()), ("prompt", pa.large_string())])
    path = write(tmp_path / "a.parquet", {"id": [1, 2], "prompt": ["a", "b"]}, schema)
    ds = InputDataset(InputConfig(path=str(path)))
    assert ds.id_type == pa.int64()
    assert [r.prompt for r in all_rows(ds)] == ["a", "b"]
    schema = pa.schema([("id", pa.large_string()), ("prompt", pa.string())])
    path = write(tmp_path / "b.parquet", {"id": ["u", "v"], "prompt": ["a", "b"]}, schema)
    assert InputDataset(InputConfig(path=str(path))).id_type == pa.string()


def test_messages(tmp_path: Path) -> None:
    message = pa.struct([("role", pa.string()), ("content", pa.string()), ("name", pa.string())])
    schema = pa.schema([("id", pa.int64()), ("messages", pa.list_(message))])
    data = {
        "id": [0, 1],
        "messages": [
            [
                {"role": "system", "content": "be brief", "name": None},
                {"role": "user", "content": "hi", "name": "bob"},
            ],
            None,
        ],
    }
    path = write(tmp_path / "m.parquet", data, schema)
    ds = InputDataset(InputConfig(path=str(path), messages_column="messages"))
    rows = all_rows(ds)
    assert rows[0].prompt is None
    assert rows[0].messages == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
    ]
    assert rows[1].messages is None


def test_keep_columns(tmp_path: Path) -> None:
    path = prompts(
        tmp_path,
        3,
        topic=["a", "b", None],
        score=pa.array([1.5, 2.5, 3.5], pa.float32()),
        tags=[["x"], [], ["y", "z"]],
    )
    ds = InputDataset(
        InputConfig(path=str(path), keep_columns=("topic", "score", "tags", "prompt"))
    )
    assert [f.name for f in ds.keep_fields] == ["topic", "score", "tags", "prompt"]
    assert ds.keep_fields[1].type == pa.float32()
    rows = all_rows(ds)
    assert rows[2].keep == {"topic": None, "score": 3.5, "tags": ["y", "z"], "prompt": "prompt 2"}


def test_windows_and_skip_ids(tmp_path: Path) -> None:
    prompts(tmp_path / "d", 7, start=0, name="a.parquet")
    prompts(tmp_path / "d", 6, start=7, name="b.parquet")
    ds = InputDataset(InputConfig(path=str(tmp_path / "d")))
    windows = list(ds.iter_windows(5))
    assert [len(w) for w in windows] == [5, 5, 3]  # windows span files
    assert [r.id for w in windows for r in w] == list(range(13))
    windows = list(ds.iter_windows(4, skip_ids=set(range(0, 13, 2))))
    assert [len(w) for w in windows] == [4, 2]
    assert [r.id for w in windows for r in w] == [1, 3, 5, 7, 9, 11]
    assert list(ds.iter_windows(4, skip_ids=set(range(13)))) == []
    with pytest.raises(ValueError):
        next(ds.iter_windows(0))


def test_windows_stream_a_file_many_windows_long(tmp_path: Path, monkeypatch) -> None:
    """A file of 2500 rows in row groups of 300, read in windows of 1000: nothing is read before
    a window is asked for, a window reads about its own rows (not the file), and columns the job
    does not use are never read."""
    n = 2500
    path = write(
        tmp_path / "big.parquet",
        {"id": list(range(n)), "prompt": [str(i) for i in range(n)], "unused": [b"x" * 10] * n},
        row_group_size=300,
    )
    ds = InputDataset(InputConfig(path=str(path)))
    read: list[pa.RecordBatch] = []  # every record batch the windows read from the file

    class CountingParquetFile(pq.ParquetFile):
        def iter_batches(self, *args, **kwargs):
            for batch in super().iter_batches(*args, **kwargs):
                read.append(batch)
                yield batch

    monkeypatch.setattr(pq, "ParquetFile", CountingParquetFile)
    windows = ds.iter_windows(1000)
    rows_read = []  # rows read from the file when each window came out
    sizes = []
    for window in windows:
        rows_read.append(sum(b.num_rows for b in read))
        sizes.append(len(window))
    assert sizes == [1000, 1000, 500]
    assert rows_read[0] < 2 * 1000 and rows_read[1] < 3 * 1000  # a window ahead at most
    assert rows_read[0] < n
    assert sum(b.num_rows for b in read) == n  # then every row once
    assert all(b.schema.names == ["id", "prompt"] for b in read)


def test_empty_input_is_valid(tmp_path: Path) -> None:
    schema = pa.schema([("id", pa.int64()), ("prompt", pa.string())])
    path = write(tmp_path / "e.parquet", {"id": [], "prompt": []}, schema)
    ds = InputDataset(InputConfig(path=str(path)))
    assert ds.num_rows == 0
    assert list(ds.iter_windows(10)) == []


def test_identity_changes_with_the_files(tmp_path: Path) -> None:
    path = prompts(tmp_path, 3)
    cfg = InputConfig(path=str(path))
    first = InputDataset(cfg).identity
    assert InputDataset(cfg).identity == first
    prompts(tmp_path, 4)
    assert InputDataset(cfg).identity != first
    stat = path.stat()
    second = InputDataset(cfg).identity
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert InputDataset(cfg).identity != second


# --------------------------------------------------------------------------- errors


def input_error(cfg: InputConfig) -> str:
    with pytest.raises(InputError) as info:
        InputDataset(cfg)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_path_matches_nothing(tmp_path: Path) -> None:
    assert "does not exist" in input_error(InputConfig(path=str(tmp_path / "nope.parquet")))
    assert "matches no files" in input_error(InputConfig(path=str(tmp_path / "*.parquet")))
    (tmp_path / "empty").mkdir()
    assert "holds no *.parquet files" in input_error(InputConfig(path=str(tmp_path / "empty")))


def test_not_parquet_names_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "d" / "b.parquet"
    prompts(tmp_path / "d", 2, name="a.parquet")
    bad.write_text("id,prompt\n1,hello\n")
    message = input_error(InputConfig(path=str(tmp_path / "d")))
    assert f"input file {bad} is not a Parquet file" in message


def test_missing_columns_are_named(tmp_path: Path) -> None:
    path = write(tmp_path / "a.parquet", {"id": [1], "text": ["x"]})
    message = input_error(InputConfig(path=str(path)))
    assert "has no column 'prompt' (input.prompt_column)" in message and str(path) in message
    assert "its columns: id, text" in message
    path = write(tmp_path / "b.parquet", {"prompt": ["x"]})
    message = input_error(InputConfig(path=str(path)))
    assert "no column 'id' (input.id_column)" in message and "id_column: null" in message
    message = input_error(InputConfig(path=str(path), messages_column="chat", id_column=None))
    assert "no column 'chat' (input.messages_column)" in message
    message = input_error(InputConfig(path=str(path), id_column=None, keep_columns=("topic",)))
    assert "no column 'topic' (input.keep_columns)" in message


def test_missing_column_in_second_file(tmp_path: Path) -> None:
    prompts(tmp_path / "d", 2, name="a.parquet")
    write(tmp_path / "d" / "b.parquet", {"id": [5], "text": ["x"]})
    assert "b.parquet has no column 'prompt'" in input_error(InputConfig(path=str(tmp_path / "d")))


def test_bad_column_types(tmp_path: Path) -> None:
    path = write(tmp_path / "a.parquet", {"id": [1.5], "prompt": ["x"]})
    assert "id column 'id' has type double" in input_error(InputConfig(path=str(path)))
    path = write(tmp_path / "b.parquet", {"id": [1], "prompt": [3]})
    assert "'prompt' (input.prompt_column) has type int64" in input_error(
        InputConfig(path=str(path))
    )
    path = write(tmp_path / "c.parquet", {"id": [1], "chat": [["just text"]]})
    message = input_error(InputConfig(path=str(path), messages_column="chat"))
    assert "expected list<struct<role: string, content: string>>" in message


def test_id_kinds_must_agree_across_files(tmp_path: Path) -> None:
    prompts(tmp_path / "d", 2, name="a.parquet")
    write(tmp_path / "d" / "b.parquet", {"id": ["x"], "prompt": ["p"]})
    assert "has int64 ids" in input_error(InputConfig(path=str(tmp_path / "d")))


def test_keep_column_types_must_agree_across_files(tmp_path: Path) -> None:
    prompts(tmp_path / "d", 1, start=0, name="a.parquet", topic=["a"])
    prompts(tmp_path / "d", 1, start=1, name="b.parquet", topic=[1])
    message = input_error(InputConfig(path=str(tmp_path / "d"), keep_columns=("topic",)))
    assert "keep column 'topic' has type int64" in message


def test_duplicate_ids_named(tmp_path: Path) -> None:
    prompts(tmp_path / "d", 5, start=0, name="a.parquet")
    prompts(tmp_path / "d", 3, start=3, name="b.parquet")  # 3 and 4 again
    message = input_error(InputConfig(path=str(tmp_path / "d")))
    assert "duplicate ids: 3, 4" in message


def test_many_duplicate_ids_shows_a_few(tmp_path: Path) -> None:
    path = write(
        tmp_path / "a.parquet", {"id": ["a", "b"] * 10 + list("cdefg") * 2, "prompt": ["p"] * 30}
    )
    message = input_error(InputConfig(path=str(path)))
    assert message.endswith("duplicate ids: 'a', 'b', 'c', 'd', 'e' and 2 more")


def test_null_ids(tmp_path: Path) -> None:
    path = write(tmp_path / "a.parquet", {"id": [1, None], "prompt": ["x", "y"]})
    assert "has 1 null value(s)" in input_error(InputConfig(path=str(path)))


def test_keep_columns_colliding_with_output(tmp_path: Path) -> None:
    path = prompts(tmp_path, 1, text=["t"])
    message = input_error(InputConfig(path=str(path), keep_columns=("text", "id")))
    assert "'text', 'id' would collide with an output column" in message
