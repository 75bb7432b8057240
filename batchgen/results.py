"""Parquet out: part files, the manifest, the report. Durable and resumable.

One noun, the output folder: its inspection (shared by ``validate`` and ``open``), its commit
protocol and the writer that feeds it, kept together (about 900 lines) because each relies on the
others' invariants; the file primitives are in :mod:`batchgen.storage`, status in
:mod:`batchgen.status`.

Layout of an output folder (SPEC "The output folder"; the names are :mod:`batchgen.layout`'s)::

    part-00000.parquet              results; each holds whole input rows (all n samples of a row)
    part-00001.parquet
    .batchgen/manifest.json         a record of the committed parts (see below)
    .batchgen/report.json           written when a job ends
    .batchgen/lock                  held (flock) while a job writes here
    .batchgen/staging/part-00002.parquet   a part being written, not committed
    .batchgen/.manifest.json.tmp    the temp name while the manifest is replaced

The part files are the only visible files, so Parquet readers (pyarrow.dataset, pandas, DuckDB,
polars over ``*.parquet``, Hugging Face datasets) see exactly the committed parts. Folders in the
earlier layout (``_manifest.json`` beside the parts) are moved into it when a job opens them
(:mod:`batchgen.legacy_layout`).

Commit protocol, local (durability by rename): the buffered rows are written to
``.batchgen/staging/part-NNNNN.parquet`` and fsynced, then renamed to ``part-NNNNN.parquet`` and
the folder fsynced: **that rename is the commit** (the folder is locked, so no other writer
exists). Then the manifest is rewritten (temp, fsync, rename, fsync) to list the part.
Invariant: **the committed parts are the part files in the folder, and the manifest lists every
one of them but at most the newest** (numbered ``next_part``: the rename happened, the manifest
update did not). Opening the folder records that one (:meth:`OutputFolder._open_locked`), deletes
whatever is in staging (never committed) and drops listed parts whose file is missing (their rows
are generated again). A reader therefore sees exactly the committed rows at every moment, also
after a ``kill -9``: a part appears whole, under its final name, at the instant it is committed.

Manifest (JSON)::

    {"format": "batchgen-output", "version": 1,
     "fingerprint": {"model": ..., "input": ..., "sampling": ..., "numerics": "dtype=...,kv_cache_dtype=..."},
     "total_rows": int | null, "finished": bool,
     "created_at": iso, "last_commit_at": iso | null, "next_part": int,
     "parts": [{"name", "rows", "samples", "prompt_tokens", "cached_prompt_tokens",
                "output_tokens", "errors", "first_id", "last_id"}, ...],
     "totals": {"rows", "samples", "prompt_tokens", "cached_prompt_tokens", "output_tokens",
                "errors", "parts"}}

``rows`` counts input rows, ``samples`` output rows; the token sums are over output rows;
``errors`` counts output rows whose ``finish_reason`` is ``error``.

On object storage (``output.path: s3://bucket/prefix``, :class:`ObjectOutputFolder`) there is
no rename and no lock, so the commit point is the manifest instead:

    .batchgen/staging/part-00002-<writer token>.parquet   a part written, not yet published
    .batchgen/lease/<writer token>.json                   the writer's lease (storage.ObjectLease)

1. The part is written (one PUT) under a unique staging name: no writer, stale or not, ever
   overwrites another's staged part. Readers skip the hidden ``.batchgen/`` prefix.
2. The manifest is written (one PUT), listing the part by its final name and its staged name.
   **This is the commit point**: a part is committed iff the manifest lists it. (A writer that
   lost its lease may still PUT; its manifest is one whole view, so no row is listed twice,
   which publishing first could not promise: two writers' copies to one final name.)
3. The staged part is copied (server-side) to ``part-NNNNN.parquet``, then deleted.

Readers of the prefix (pyarrow.dataset, pandas, DuckDB over ``s3://``) therefore never see an
uncommitted row, also while a job runs and after a crash: a part appears under its final name
only after the manifest lists it. A crash between steps 2 and 3 hides the newest committed part
from them until the next open, which rolls it forward: a listed part whose final object is
missing is copied from its staged object (or, if that is gone too, dropped from the manifest: its
rows are generated again); staged objects and ``part-*`` objects the manifest does not list were
never committed and are deleted. Before each manifest write the writer checks its lease.
"""

from __future__ import annotations

import contextlib
import copy
import errno
import functools
import json
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from batchgen.errors import JobError, OutputFullError
from batchgen.fingerprint import describe_fingerprint_mismatch, upgrade_numerics
from batchgen.layout import (
    HIDDEN_DIR,
    LEGACY_MANIFEST_NAME,
    LEGACY_REPORT_NAME,
    LEGACY_STAGING_PREFIX,
    LOCK_NAME,
    MANIFEST_FILE,
    MANIFEST_NAME,
    PART_RE,
    REPORT_FILE,
    REPORT_NAME,
    STAGING_DIR,
    STAGING_PREFIX,
    part_name,
)
from batchgen.legacy_layout import migrate_local, migrate_objects
from batchgen.schema import Totals
from batchgen.storage import (
    ObjectFolder,
    ObjectLease,
    StorageSettings,
    fsync_dir,
    is_uri,
    json_bytes,
    lock_folder,
    now_iso,
    write_durably,
)

MANIFEST_FORMAT = "batchgen-output"
MANIFEST_VERSION = 1

# Both layouts' manifest and report: what --fresh deletes besides the parts.
_RESULT_FILES = (MANIFEST_NAME, REPORT_NAME, LEGACY_MANIFEST_NAME, LEGACY_REPORT_NAME)
_STAGING_PREFIXES = (STAGING_PREFIX, LEGACY_STAGING_PREFIX)

# Called with a step name between the steps of a commit; tests raise in it to simulate a crash.
StepHook = Callable[[str], None]
COMMIT_STEPS = ("part_written", "part_renamed", "manifest_written")
# A write into the output folder failing with one of these is a full disk or quota, not a bug.
NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


def read_manifest(
    folder: Path | str, storage: StorageSettings | None = None
) -> dict[str, Any] | None:
    """The manifest, None if there is none. Raises JobError if it is unreadable or not ours.
    ``folder`` may be an ``s3://`` URI (``storage``: the job's ``storage:`` section). A folder in
    the earlier layout (not migrated yet) is read as well."""
    return _parse_manifest(str(folder), *_manifest_bytes(_reader(folder, storage)))


def _reader(folder: Path | str, storage: StorageSettings | None) -> Callable[[str], bytes | None]:
    """Reads a file of the folder by its name (None if missing): an object or a local file."""
    if is_uri(folder):
        return ObjectFolder(str(folder), storage).read_bytes
    return functools.partial(_read_local, Path(folder))


def _read_local(folder: Path, name: str) -> bytes | None:
    try:
        return (folder / name).read_bytes()
    except FileNotFoundError:
        return None
    except OSError as err:
        raise JobError(f"output folder {folder}: cannot read {name}: {err}") from None


def _manifest_bytes(read: Callable[[str], bytes | None]) -> tuple[str, bytes | None]:
    """Which manifest a folder has and its bytes: the new layout's if it has one (it has been
    migrated, batchgen/legacy_layout.py), else the earlier layout's; None when neither exists."""
    raw = read(MANIFEST_NAME)
    if raw is not None:
        return MANIFEST_NAME, raw
    return LEGACY_MANIFEST_NAME, read(LEGACY_MANIFEST_NAME)


def read_report(folder: Path | str, storage: StorageSettings | None = None) -> Any:
    """The report (parsed JSON) of the folder's last run, in either layout; None if there is
    none or it is unreadable (it is informational: a report never blocks anything)."""
    read = _reader(folder, storage)
    try:
        raw = read(REPORT_NAME) or read(LEGACY_REPORT_NAME)
        return json.loads(raw) if raw is not None else None
    except (JobError, ValueError):
        return None


def _parse_manifest(folder: str, name: str, raw: bytes | None) -> dict[str, Any] | None:
    if raw is None:
        return None
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise JobError(f"output folder {folder}: cannot read {name}: {err}") from None
    if not isinstance(data, dict) or data.get("format") != MANIFEST_FORMAT:
        raise JobError(
            f"output folder {folder} holds a {name} that batchgen did not write; "
            "choose another output.path"
        )
    if data.get("version") != MANIFEST_VERSION:
        raise JobError(
            f"output folder {folder} was written by another batchgen version "
            f"(manifest version {data.get('version')}); use --fresh or another output.path"
        )
    fp = data.get("fingerprint")
    if isinstance(fp, dict) and isinstance(fp.get("numerics"), str):  # older folders' form
        fp["numerics"] = upgrade_numerics(fp["numerics"])
    return data


def _new_manifest(fingerprint: Mapping[str, str]) -> dict[str, Any]:
    return {
        "format": MANIFEST_FORMAT,
        "version": MANIFEST_VERSION,
        "fingerprint": dict(fingerprint),
        "total_rows": None,
        "finished": False,
        "created_at": now_iso(),
        "last_commit_at": None,
        "next_part": 0,
        "parts": [],
        "totals": totals_of([]),
    }


def totals_of(parts: Sequence[Mapping[str, Any]]) -> dict[str, int]:
    """The manifest's ``totals``: the counts summed over its parts, and the number of parts."""
    return {**Totals.sum(parts).as_dict(), "parts": len(parts)}


def manifest_with_part(
    manifest: dict[str, Any],
    number: int,
    name: str,
    table: pa.Table,
    rows: int,
    **extra: Any,
) -> dict[str, Any]:
    """A copy of ``manifest`` that lists part ``number`` (``name``, holding ``table``: ``rows``
    input rows; ``extra`` keys go into its entry) as committed, totals and counters updated."""
    ids = table.column("id")
    entry = {
        "name": name,
        **extra,
        **Totals.of_table(table, rows).as_dict(),
        "first_id": ids[0].as_py(),
        "last_id": ids[-1].as_py(),
    }
    updated = copy.deepcopy(manifest)
    updated["parts"].append(entry)
    updated["totals"] = totals_of(updated["parts"])
    updated["next_part"] = number + 1
    updated["last_commit_at"] = now_iso()
    updated["finished"] = False
    return updated


# --------------------------------------------------------------------------- inspection


@dataclass(frozen=True)
class FolderState:
    """What an output folder holds for a job, as read without changing anything.

    ``manifest``: the results to resume (None: the job starts afresh, also with ``fresh``)."""

    path: Path | str
    manifest: dict[str, Any] | None

    @property
    def rows_done(self) -> int:
        return int(self.manifest["totals"]["rows"]) if self.manifest else 0


def inspect_folder(
    path: Path | str,
    fingerprint: Mapping[str, str],
    fresh: bool,
    adopt: Sequence[str] = (),
    storage: StorageSettings | None = None,
) -> FolderState:
    """Read-only: raise the JobError that opening ``path`` for this job would raise (a file, not
    writable, a foreign folder, another job's results unless ``fresh``); else its state. Keys in
    ``adopt`` that the folder's fingerprint lacks do not differ (see :func:`same_job`).

    ``validate`` uses it as it is; :meth:`OutputFolder.open` before creating the folder and again
    under the folder's lock. ``path`` may be an ``s3://`` URI."""
    if is_uri(path):
        return _inspect_object_folder(ObjectFolder(str(path), storage), fingerprint, fresh, adopt)
    path = Path(path)
    if not path.exists():
        parent = path.parent
        while not parent.exists():
            parent = parent.parent
        if not parent.is_dir():
            raise JobError(f"cannot create output folder {path}: {parent} is a file")
        if not os.access(parent, os.W_OK | os.X_OK):
            raise JobError(f"cannot create output folder {path}: {parent} is not writable")
        return FolderState(path, None)
    if not path.is_dir():
        raise JobError(f"output path {path} is a file, not a folder")
    if not os.access(path, os.W_OK | os.X_OK):
        raise JobError(f"output folder {path} is not writable")
    manifest = _manifest_for_job(str(path), _reader(path, None), fresh)
    return _judge(path, manifest, os.listdir(path), fingerprint, fresh, adopt)


def _manifest_for_job(
    folder: str, read: Callable[[str], bytes | None], fresh: bool
) -> dict[str, Any] | None:
    """The manifest a job opening the folder resumes from (None: none, or ``fresh`` and one of
    ours that cannot be read)."""
    name, raw = _manifest_bytes(read)
    try:
        return _parse_manifest(folder, name, raw)
    except JobError:
        # An unreadable manifest of ours cannot be resumed; --fresh may start over. One that is
        # not ours is never deleted.
        if not fresh or MANIFEST_FORMAT.encode() not in (raw or b"")[:200]:
            raise
        return None


def _inspect_object_folder(
    store: ObjectFolder, fingerprint: Mapping[str, str], fresh: bool, adopt: Sequence[str]
) -> FolderState:
    store.check_bucket()
    manifest = _manifest_for_job(store.uri, store.read_bytes, fresh)
    names = [n.split("/", 1)[0] for n in store.list()] if manifest is None else []
    return _judge(store.uri, manifest, names, fingerprint, fresh, adopt)


def _judge(
    path: Path | str,
    manifest: dict[str, Any] | None,
    names: Sequence[str],
    fingerprint: Mapping[str, str],
    fresh: bool,
    adopt: Sequence[str],
) -> FolderState:
    """The state of a folder holding ``manifest`` and the (top-level) ``names``; JobError if
    this job may not write there."""
    if manifest is None:
        foreign = sorted(
            {n for n in names if not n.startswith((".", "_")) and not PART_RE.match(n)}
        )
        if foreign:
            raise JobError(
                f"output folder {path} is not empty and is not a batchgen output folder "
                f"(it holds {', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''}); "
                "choose a new or empty folder"
            )
        return FolderState(path, None)
    if fresh:
        return FolderState(path, None)
    if not same_job(manifest.get("fingerprint") or {}, fingerprint, adopt):
        old = manifest.get("fingerprint") or {}
        what = describe_fingerprint_mismatch(old, fingerprint)
        # numerics alone can follow from `auto` on another machine: the job can pin them
        pin = (
            "set engine.dtype and engine.kv_cache_dtype to the folder's to resume it, "
            if "numerics" in old and old.get("numerics") != fingerprint.get("numerics")
            else ""
        )
        raise JobError(
            f"output folder {path} holds a different job: {what}; {pin}use --fresh to delete "
            "its results, or choose another output.path"
        )
    return FolderState(path, manifest)


def same_job(old: Mapping[str, str], new: Mapping[str, str], adopt: Sequence[str] = ()) -> bool:
    """Whether a folder's fingerprint ``old`` is the job ``new``: equal, but for keys in
    ``adopt`` that ``old`` lacks."""
    return dict(old) == {k: v for k, v in new.items() if k in old or k not in adopt}


# --------------------------------------------------------------------------- the folder


class OutputFolder:
    """An open output folder: the committed parts, the manifest, the lock. Use :meth:`open`."""

    def __init__(self, path: Path, manifest: dict[str, Any], lock_fd: int | None) -> None:
        self.path = path
        self._manifest = manifest  # invariant: what .batchgen/manifest.json holds on disk
        self._lock_fd = lock_fd

    @classmethod
    def open(
        cls,
        path: Path,
        fingerprint: Mapping[str, str],
        fresh: bool = False,
        adopt: Sequence[str] = (),
        storage: StorageSettings | None = None,
    ) -> OutputFolder:
        """Open (creating if missing) the output folder of a job with this fingerprint.

        ``path`` may be an ``s3://`` URI: then an :class:`ObjectOutputFolder` is returned
        (``storage``: the job's ``storage:`` section).

        Refused (JobError) as :func:`inspect_folder` says; keys in ``adopt`` that the folder's
        fingerprint lacks (written before they were fingerprinted) are recorded in it. ``fresh``:
        delete earlier results first (only batchgen's own files). A folder in the earlier layout
        is migrated (batchgen/legacy_layout.py). Leftovers of a crash are cleaned: staged parts
        and temp files; the part a crash left committed but unrecorded is recorded (module
        docstring). A listed part that is missing is dropped from the manifest, so its rows are
        generated again.
        """
        if is_uri(path):
            return ObjectOutputFolder.open_uri(str(path), fingerprint, fresh, adopt, storage)
        path = Path(path)
        inspect_folder(path, fingerprint, fresh, adopt)  # refuse before creating anything
        hidden = path / HIDDEN_DIR
        hidden_existed = hidden.is_dir()
        try:
            hidden.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise JobError(f"cannot create output folder {path}: {err.strerror or err}") from None
        lock_existed = (path / LOCK_NAME).exists()
        lock_fd = lock_folder(path / LOCK_NAME, path)
        try:
            # Again under the lock: another process may have written here meanwhile.
            state = inspect_folder(path, fingerprint, fresh, adopt)
            migrate_local(path)
            folder = cls._open_locked(path, state.manifest, fingerprint, fresh, lock_fd)
        except BaseException:
            if lock_fd is not None:
                if not lock_existed:  # leave a refused folder as it was
                    (path / LOCK_NAME).unlink(missing_ok=True)
                    if not hidden_existed:
                        with contextlib.suppress(OSError):
                            hidden.rmdir()
                os.close(lock_fd)
            raise
        return folder

    @classmethod
    def _open_locked(
        cls,
        path: Path,
        manifest: dict[str, Any] | None,
        fingerprint: Mapping[str, str],
        fresh: bool,
        lock_fd: int | None,
    ) -> OutputFolder:
        hidden = path / HIDDEN_DIR
        staging = hidden / STAGING_DIR
        if fresh:
            for name in os.listdir(path):
                if PART_RE.match(name):
                    (path / name).unlink(missing_ok=True)
            for name in _RESULT_FILES:
                (path / name).unlink(missing_ok=True)
        # Nothing staged was committed (a part is committed by its rename out of staging); temp
        # files of the manifest and the report were never renamed into place.
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(exist_ok=True)
        for name in os.listdir(hidden):
            if name.startswith(".") and name.endswith(".tmp"):
                (hidden / name).unlink(missing_ok=True)

        # Unlisted parts: the newest one (numbered next_part) was committed by its rename while
        # the manifest was not yet updated: it is recorded below. Any other was never committed
        # by this protocol (e.g. left beside a folder without a manifest): deleted.
        listed = {p["name"] for p in manifest["parts"]} if manifest else set()
        unrecorded = part_name(int(manifest["next_part"])) if manifest else None
        removed = False
        for name in sorted(os.listdir(path)):
            if PART_RE.match(name) and name not in listed and name != unrecorded:
                (path / name).unlink(missing_ok=True)
                removed = True
        if removed:
            fsync_dir(path)

        folder = cls(path, manifest or _new_manifest(fingerprint), lock_fd)
        try:
            folder._settle(manifest, fingerprint)
        except BaseException:
            folder._lock_fd = None  # open() closes it: a forgotten folder must not close it again
            raise
        return folder

    def _settle(self, manifest: dict[str, Any] | None, fingerprint: Mapping[str, str]) -> None:
        """Bring the manifest in line with the part files (the last step of opening): write a
        new one, record adopted fingerprint keys, drop missing parts, list the unrecorded one."""
        if manifest is None:
            self._write_manifest(self._manifest)
            return
        if manifest["fingerprint"] != dict(fingerprint):  # adopted keys
            self._write_manifest({**manifest, "fingerprint": dict(fingerprint)})
            manifest = self._manifest
        missing = [p for p in manifest["parts"] if not (self.path / p["name"]).is_file()]
        if missing:
            parts = [p for p in manifest["parts"] if p not in missing]
            self._write_manifest(
                {**manifest, "parts": parts, "totals": totals_of(parts), "finished": False}
            )
        unrecorded = part_name(int(manifest["next_part"]))
        if (self.path / unrecorded).is_file():
            self._record_part(int(manifest["next_part"]), unrecorded)

    def _record_part(self, number: int, name: str) -> None:
        """List a committed part the manifest does not list yet (a crash between its rename and
        the manifest update). Its input rows are its distinct ids: a part holds whole rows."""
        try:
            table = pq.read_table(self.path / name)
        except (OSError, pa.ArrowException) as err:
            raise JobError(
                f"output folder {self.path}: committed part {name} is unreadable ({err}); use "
                "--fresh to start over"
            ) from None
        rows = int(pc.count_distinct(table.column("id")).as_py())
        self._write_manifest(manifest_with_part(self._manifest, number, name, table, rows))

    # -- reading

    @property
    def fingerprint(self) -> dict[str, str]:
        return dict(self._manifest["fingerprint"])

    @property
    def finished(self) -> bool:
        return bool(self._manifest["finished"])

    def part_paths(self) -> list[Path]:
        """The committed part files, in commit order."""
        return [self.path / p["name"] for p in self._manifest["parts"]]

    def completed_ids(self) -> set[Any]:
        """Ids of the input rows already committed (rows are committed whole, all samples).

        Reads only the id column of the committed parts.
        """
        ids: set[Any] = set()
        for part in self._manifest["parts"]:
            try:
                column = self._read_part(part["name"], ["id"]).column("id")
            except (OSError, pa.ArrowException) as err:
                raise JobError(
                    f"output folder {self.path}: committed part {part['name']} is unreadable "
                    f"({err}); use --fresh to start over"
                ) from None
            ids.update(column.to_pylist())
        return ids

    def _read_part(self, name: str, columns: list[str]) -> pa.Table:
        return pq.read_table(self.path / name, columns=columns)

    def _read_part_schema(self, name: str) -> pa.Schema:
        return pq.read_schema(self.path / name)

    def counts(self) -> dict[str, int]:
        """Totals over committed parts: rows (input), samples (output rows), prompt_tokens,
        cached_prompt_tokens, output_tokens, errors (samples), parts."""
        return dict(self._manifest["totals"])

    def check_schema(self, schema: pa.Schema) -> None:
        """JobError if committed parts have another schema (they could not be read together)."""
        parts = [p["name"] for p in self._manifest["parts"]]
        if not parts:
            return
        try:
            existing = self._read_part_schema(parts[0])
        except (OSError, pa.ArrowException) as err:
            raise JobError(
                f"output folder {self.path}: committed part {parts[0]} is unreadable "
                f"({err}); use --fresh to start over"
            ) from None
        if not existing.remove_metadata().equals(schema.remove_metadata()):
            raise JobError(
                f"output folder {self.path} holds results with other columns; use --fresh to "
                "start over, or choose another output.path"
            )

    # -- writing

    def writer(
        self,
        schema: pa.Schema,
        commit_rows: int,
        commit_seconds: float,
        *,
        on_step: StepHook | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> PartWriter:
        """A writer of new parts with this schema (checked against committed parts).

        ``on_step`` is a test hook called with each name in COMMIT_STEPS during a commit.
        """
        self.check_schema(schema)
        return PartWriter(self, schema, commit_rows, commit_seconds, on_step=on_step, clock=clock)

    def set_fingerprint(self, fingerprint: Mapping[str, str]) -> None:
        """Record another fingerprint; only while no row is committed (e.g. once Ray workers
        reported the numerics they resolved)."""
        if self._manifest["parts"]:
            raise ValueError("the fingerprint of a folder with committed rows cannot change")
        self._write_manifest({**self._manifest, "fingerprint": dict(fingerprint)})

    def set_total_rows(self, total_rows: int) -> None:
        """Record the number of input rows, so ``status`` can show progress."""
        if self._manifest.get("total_rows") != total_rows:
            self._write_manifest({**self._manifest, "total_rows": int(total_rows)})

    def mark_finished(self) -> None:
        """Record that the job ran to its end (a later commit clears it again)."""
        self._write_manifest({**self._manifest, "finished": True})

    def write_report(self, report: Mapping[str, Any]) -> None:
        """Write ``.batchgen/report.json`` atomically."""
        data = json_bytes(dict(report))
        with self._space_checked():
            write_durably(self.path / HIDDEN_DIR, REPORT_FILE, lambda f: f.write(data))

    def close(self) -> None:
        """Release the folder's lock. Idempotent."""
        fd = getattr(self, "_lock_fd", None)
        if fd is not None:
            self._lock_fd = None
            os.close(fd)

    def __del__(self) -> None:
        # flock is per open file: an unclosed, forgotten folder must not keep a later open of
        # the same folder in this process out (e.g. a resume in the same test process).
        self.close()

    def __enter__(self) -> OutputFolder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _write_manifest(
        self, manifest: dict[str, Any], before_rename: Callable[[], None] | None = None
    ) -> None:
        data = json_bytes(manifest)
        with self._space_checked():
            write_durably(
                self.path / HIDDEN_DIR, MANIFEST_FILE, lambda f: f.write(data), before_rename
            )
        self._manifest = manifest

    @contextlib.contextmanager
    def _space_checked(self, saved_rows: int | None = None) -> Iterator[None]:
        """A full disk or quota while writing becomes an OutputFullError naming the folder and
        the rows committed: ``saved_rows``, else the manifest's (the one on disk is the one held
        here)."""
        try:
            yield
        except OSError as err:
            if err.errno not in NO_SPACE_ERRNOS:
                raise
            rows = self.counts()["rows"] if saved_rows is None else saved_rows
            raise OutputFullError(
                f"output folder {self.path}: {os.strerror(err.errno)} while saving results; "
                f"{rows} rows are saved there; free space (or raise the quota) and run the same "
                "command again to resume"
            ) from None

    def _commit_part(self, table: pa.Table, rows: int, on_step: StepHook | None) -> None:
        """Stage one part, commit it by its rename, then record it in the manifest (the
        protocol in the module docstring)."""
        number = int(self._manifest["next_part"])
        name = part_name(number)
        step = on_step or (lambda _name: None)
        staging = self.path / HIDDEN_DIR / STAGING_DIR
        with self._space_checked():
            write_durably(staging, name, lambda f: pq.write_table(table, f))
        step("part_written")
        os.replace(staging / name, self.path / name)  # the commit: whole, under its final name
        fsync_dir(self.path)
        step("part_renamed")
        # A failure from here on (a full disk) leaves the part committed but not listed: the next
        # open records it. A retry in this process replaces it, under the same number, with the
        # buffered rows: they include the part's (the buffer is kept on failure).
        manifest = manifest_with_part(self._manifest, number, name, table, rows)
        data = json_bytes(manifest)
        with self._space_checked(saved_rows=int(manifest["totals"]["rows"])):
            write_durably(
                self.path / HIDDEN_DIR,
                MANIFEST_FILE,
                lambda f: f.write(data),
                before_rename=lambda: step("manifest_written"),
            )
        self._manifest = manifest


# --------------------------------------------------------------------------- object storage


class ObjectOutputFolder(OutputFolder):
    """An output folder on object storage (``s3://bucket/prefix``): the protocol in the module
    docstring, a lease (:class:`~batchgen.storage.ObjectLease`) instead of a lock."""

    def __init__(
        self, store: ObjectFolder, manifest: dict[str, Any], lease: ObjectLease | None
    ) -> None:
        self.store = store
        self._lease = lease
        super().__init__(Path(), manifest, None)
        self.path = store.uri  # type: ignore[assignment]  # a URI: messages name it

    @classmethod
    def open_uri(
        cls,
        uri: str,
        fingerprint: Mapping[str, str],
        fresh: bool,
        adopt: Sequence[str],
        storage: StorageSettings | None,
    ) -> ObjectOutputFolder:
        """:meth:`OutputFolder.open` for a URI: refuse as :func:`inspect_folder` says, take the
        lease, inspect again under it, migrate an earlier layout, roll a crashed commit forward,
        delete what was never committed."""
        store = ObjectFolder(uri, storage)
        _inspect_object_folder(store, fingerprint, fresh, adopt)
        lease = ObjectLease(store)
        lease.acquire()
        try:
            state = _inspect_object_folder(store, fingerprint, fresh, adopt)
            migrate_objects(store)
            folder = cls(store, _new_manifest(fingerprint), lease)
            folder._recover(state.manifest, fingerprint, fresh)
        except BaseException:
            lease.release()
            raise
        return folder

    def _recover(
        self, manifest: dict[str, Any] | None, fingerprint: Mapping[str, str], fresh: bool
    ) -> None:
        store = self.store
        names = store.list()
        if fresh:
            for name in names:
                ours = name.startswith(_STAGING_PREFIXES) or name in _RESULT_FILES
                if ours or PART_RE.match(name):
                    store.delete(name)
            names = store.list()
        if manifest is None:
            manifest = _new_manifest(fingerprint)
        parts = []
        for part in manifest["parts"]:
            staged = part.get("staged")
            if part["name"] not in names and staged in names:
                store.copy(staged, part["name"])  # committed, not yet published: roll forward
            elif part["name"] not in names:
                continue  # lost: its rows are generated again
            parts.append(part)
        keep = {p["name"] for p in parts}
        for name in names:
            # Staged objects are done with (published, or never committed); unlisted parts were
            # never committed.
            if name.startswith(_STAGING_PREFIXES) or (PART_RE.match(name) and name not in keep):
                store.delete(name)
        recovered = {
            **manifest,
            "fingerprint": dict(fingerprint),
            "parts": parts,
            "totals": totals_of(parts),
            "finished": manifest["finished"] and parts == manifest["parts"],
        }
        if recovered != manifest or MANIFEST_NAME not in names:
            self._write_manifest(recovered)
        else:
            self._manifest = manifest

    def part_paths(self) -> list[Path]:
        raise NotImplementedError("parts on object storage have no local path; see part_names")

    def part_names(self) -> list[str]:
        """The committed parts' object names, in commit order."""
        return [p["name"] for p in self._manifest["parts"]]

    def _read_part(self, name: str, columns: list[str]) -> pa.Table:
        with self.store.open_input(name) as f:
            return pq.read_table(f, columns=columns)

    def _read_part_schema(self, name: str) -> pa.Schema:
        with self.store.open_input(name) as f:
            return pq.read_schema(f)

    def write_report(self, report: Mapping[str, Any]) -> None:
        data = json_bytes(dict(report))
        self.store.put(REPORT_NAME, lambda f: f.write(data))

    def close(self) -> None:
        lease = getattr(self, "_lease", None)
        if lease is not None:
            self._lease = None
            lease.release()

    def _write_manifest(
        self, manifest: dict[str, Any], before_rename: Callable[[], None] | None = None
    ) -> None:
        data = json_bytes(manifest)
        if self._lease is not None:
            self._lease.check()  # fencing: a writer that lost its lease must not commit
        if before_rename is not None:
            before_rename()
        self.store.put(MANIFEST_NAME, lambda f: f.write(data))
        self._manifest = manifest

    def _commit_part(self, table: pa.Table, rows: int, on_step: StepHook | None) -> None:
        """Stage the part, commit the manifest that lists it, publish the part (module
        docstring). Steps: part_written (staged), manifest_written (before its PUT),
        part_renamed (published)."""
        number = int(self._manifest["next_part"])
        name = part_name(number)
        token = self._lease.token if self._lease is not None else uuid.uuid4().hex
        staged = f"{STAGING_PREFIX}part-{number:05d}-{token}.parquet"
        step = on_step or (lambda _name: None)
        self.store.put(staged, lambda f: pq.write_table(table, f))
        step("part_written")
        manifest = manifest_with_part(self._manifest, number, name, table, rows, staged=staged)
        if self.store.exists(name):  # only a writer that lost its lease gets here
            raise JobError(
                f"output folder {self.path}: {name} exists already: another writer has taken "
                "the folder over"
            )
        self._write_manifest(manifest, before_rename=lambda: step("manifest_written"))
        self.store.copy(staged, name)
        step("part_renamed")
        self.store.delete(staged)


# --------------------------------------------------------------------------- the writer


class PartWriter:
    """Buffers finished rows and commits them as new part files.

    Invariant: the buffer holds whole input rows (all n samples added by one
    :meth:`add_row_group`), so a commit never splits an input row across parts or crashes.
    """

    def __init__(
        self,
        folder: OutputFolder,
        schema: pa.Schema,
        commit_rows: int,
        commit_seconds: float,
        *,
        on_step: StepHook | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.folder = folder
        self.schema = schema
        self.commit_rows = commit_rows
        self.commit_seconds = commit_seconds
        self._on_step = on_step
        self._clock = clock
        self._rows: list[dict[str, Any]] = []  # output rows (samples), whole input rows only
        self._groups = 0  # input rows in the buffer
        self._last_commit = clock()

    def add_row_group(self, rows: Sequence[Mapping[str, Any]]) -> None:
        """Buffer all sample rows of ONE input row (dicts keyed by schema column names)."""
        if not rows:
            raise ValueError("a row group holds at least one sample")
        first_id = rows[0].get("id")
        if any(r.get("id") != first_id for r in rows):
            raise ValueError("a row group holds the samples of one input row only")
        self._rows.extend(dict(r) for r in rows)
        self._groups += 1

    def maybe_commit(self) -> bool:
        """Commit if ``commit_rows`` output rows are buffered or ``commit_seconds`` have passed
        since the last commit. Returns whether it committed."""
        if not self._rows:
            return False
        due = self._clock() - self._last_commit >= self.commit_seconds
        if len(self._rows) >= self.commit_rows or due:
            self.commit()
            return True
        return False

    def commit(self) -> None:
        """Write the buffered rows as a new part, then the manifest. A no-op when empty.

        On an exception the buffer is kept (nothing was committed: the manifest is unchanged).
        """
        if not self._rows:
            self._last_commit = self._clock()
            return
        table = pa.Table.from_pylist(self._rows, schema=self.schema)
        self.folder._commit_part(table, self._groups, self._on_step)
        self._rows = []
        self._groups = 0
        self._last_commit = self._clock()


__all__ = [
    "COMMIT_STEPS",
    "LOCK_NAME",
    "MANIFEST_NAME",
    "REPORT_NAME",
    "FolderState",
    "ObjectOutputFolder",
    "OutputFolder",
    "PartWriter",
    "inspect_folder",
    "read_manifest",
    "read_report",
    "totals_of",
]
