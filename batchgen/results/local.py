"""A local output folder (:class:`OutputFolder`): its commit protocol, durability by rename.

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
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from batchgen.errors import JobError, OutputFullError
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
from batchgen.legacy_layout import migrate_local
from batchgen.results.manifest import (
    inspect_folder,
    manifest_with_part,
    new_manifest,
    totals_of,
)
from batchgen.results.writer import PartWriter
from batchgen.storage import (
    StorageSettings,
    fsync_dir,
    is_uri,
    json_bytes,
    lock_folder,
    write_durably,
)

# Both layouts' manifest and report: what --fresh deletes besides the parts.
RESULT_FILES = (MANIFEST_NAME, REPORT_NAME, LEGACY_MANIFEST_NAME, LEGACY_REPORT_NAME)
STAGING_PREFIXES = (STAGING_PREFIX, LEGACY_STAGING_PREFIX)

# Called with a step name between the steps of a commit; tests raise in it to simulate a crash.
StepHook = Callable[[str], None]
COMMIT_STEPS = ("part_written", "part_renamed", "manifest_written")
# A write into the output folder failing with one of these is a full disk or quota, not a bug.
NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


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
            # imported here: objects.py builds on this module (ObjectOutputFolder subclasses it)
            from batchgen.results.objects import ObjectOutputFolder

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
            for name in RESULT_FILES:
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

        folder = cls(path, manifest or new_manifest(fingerprint), lock_fd)
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
