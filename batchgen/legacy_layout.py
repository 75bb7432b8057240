"""Output folders written before the ``.batchgen/`` layout: moved into it, once, when a job opens
them (:mod:`batchgen.layout` has both layouts' names).

The earlier layout kept its bookkeeping beside the parts: ``_manifest.json``, ``_report.json``,
``_batch_output.jsonl``, ``.batchgen.lock``, ``_staging/`` and ``_lease/`` on object stores. The
part files and the manifest's content are the same in both layouts, so migrating moves files and
changes no row.

Invariant, on both kinds of storage: **the folder is in the new layout iff
``.batchgen/manifest.json`` exists.** The manifest moves last, so a migration killed at any step
leaves either the old layout (with some of the other files moved already: the next open moves the
rest) or the new one (with some legacy leftovers that the next open deletes); readers of the
manifest (``status``, ``validate``) look for the new name first, then the old one. The earlier
layout's temp files are deleted here; staged parts and unlisted parts are the results module's to
clean, leases the lease's (:class:`~batchgen.storage.ObjectLease`), in either layout's names.

Both functions run under the folder's lock (local) or lease (object store).
"""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path

from batchgen.errors import JobError
from batchgen.layout import (
    BATCH_OUTPUT_NAME,
    HIDDEN_DIR,
    LEGACY_BATCH_OUTPUT_NAME,
    LEGACY_LOCK_NAME,
    LEGACY_MANIFEST_NAME,
    LEGACY_REPORT_NAME,
    MANIFEST_NAME,
    REPORT_NAME,
)
from batchgen.storage import ObjectFolder, fsync_dir, lock_folder

# The earlier layout's files that move, old name -> new name; the manifest last (the invariant).
MOVES = (
    (LEGACY_REPORT_NAME, REPORT_NAME),
    (LEGACY_BATCH_OUTPUT_NAME, BATCH_OUTPUT_NAME),
    (LEGACY_MANIFEST_NAME, MANIFEST_NAME),
)
# Temp names of the earlier layout's atomic writes, beside the parts: never committed.
LEGACY_TEMP_RE = re.compile(
    r"^\.(part-\d{5,}\.parquet|_manifest\.json|_report\.json|_batch_output\.jsonl)\.tmp$"
)


def _both_manifests(folder: object) -> JobError:
    return JobError(
        f"output folder {folder} holds two different manifests, {LEGACY_MANIFEST_NAME} (written "
        f"by an earlier batchgen) and {MANIFEST_NAME}; delete the one that is not this job's"
    )


def migrate_local(path: Path) -> None:
    """Move a local folder's earlier-layout files into ``.batchgen/`` (which exists), each by an
    atomic rename, the manifest last; delete the earlier layout's temp files and lock file.
    A no-op on a folder in the new layout. JobError if both layouts hold a manifest and they
    differ (an earlier batchgen wrote the folder after a migration)."""
    lock = path / LEGACY_LOCK_NAME
    # An earlier batchgen writing here holds this lock: then this job must not start (JobError).
    lock_fd = lock_folder(lock, path) if lock.exists() else None
    try:
        old, new = path / LEGACY_MANIFEST_NAME, path / MANIFEST_NAME
        if old.exists():
            if not new.exists():
                for legacy, name in MOVES:
                    with contextlib.suppress(FileNotFoundError):  # moved by a killed migration
                        os.replace(path / legacy, path / name)
                fsync_dir(path / HIDDEN_DIR)
            elif old.read_bytes() != new.read_bytes():
                raise _both_manifests(path)
            for legacy, _name in MOVES:  # the manifest last: until it goes, this runs again
                (path / legacy).unlink(missing_ok=True)
        for name in os.listdir(path):
            if LEGACY_TEMP_RE.match(name):
                (path / name).unlink(missing_ok=True)
        lock.unlink(missing_ok=True)
    finally:
        if lock_fd is not None:
            os.close(lock_fd)
    fsync_dir(path)


def migrate_objects(store: ObjectFolder) -> None:
    """Copy an object-store folder's earlier-layout objects to their ``.batchgen/`` names (no
    rename there: each copy appears whole), the manifest last, then delete the old ones. A no-op
    on a folder in the new layout. Staged parts under ``_staging/`` stay where the manifest names
    them until the results module's recovery has published or deleted them; ``_lease/`` objects
    are the lease's (:class:`~batchgen.storage.ObjectLease` reads both prefixes)."""
    old = store.read_bytes(LEGACY_MANIFEST_NAME)
    if old is None:
        return
    new = store.read_bytes(MANIFEST_NAME)
    if new is None:
        names = store.list()
        for legacy, name in MOVES:
            if legacy in names:
                store.copy(legacy, name)
    elif new != old:
        raise _both_manifests(store)
    for legacy, _name in MOVES:  # the manifest last: until it goes, this runs again
        store.delete(legacy)


__all__ = ["LEGACY_TEMP_RE", "MOVES", "migrate_local", "migrate_objects"]
