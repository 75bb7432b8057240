"""An output folder on object storage (:class:`ObjectOutputFolder`).

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

import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.errors import JobError
from batchgen.layout import (
    MANIFEST_NAME,
    PART_RE,
    REPORT_NAME,
    STAGING_PREFIX,
    part_name,
)
from batchgen.legacy_layout import migrate_objects
from batchgen.results.local import RESULT_FILES, STAGING_PREFIXES, OutputFolder, StepHook
from batchgen.results.manifest import (
    inspect_object_folder,
    manifest_with_part,
    new_manifest,
    totals_of,
)
from batchgen.storage import (
    ObjectFolder,
    ObjectLease,
    StorageSettings,
    json_bytes,
)


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
        inspect_object_folder(store, fingerprint, fresh, adopt)
        lease = ObjectLease(store)
        lease.acquire()
        try:
            state = inspect_object_folder(store, fingerprint, fresh, adopt)
            migrate_objects(store)
            folder = cls(store, new_manifest(fingerprint), lease)
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
                ours = name.startswith(STAGING_PREFIXES) or name in RESULT_FILES
                if ours or PART_RE.match(name):
                    store.delete(name)
            names = store.list()
        if manifest is None:
            manifest = new_manifest(fingerprint)
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
            if name.startswith(STAGING_PREFIXES) or (PART_RE.match(name) and name not in keep):
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
