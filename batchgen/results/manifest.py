"""The manifest of an output folder, and the read-only inspection of a folder that ``validate``
and :meth:`~batchgen.results.local.OutputFolder.open` share.

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
"""

from __future__ import annotations

import copy
import functools
import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from batchgen.errors import JobError
from batchgen.fingerprint import describe_fingerprint_mismatch, upgrade_numerics
from batchgen.layout import (
    LEGACY_MANIFEST_NAME,
    LEGACY_REPORT_NAME,
    MANIFEST_NAME,
    PART_RE,
    REPORT_NAME,
)
from batchgen.schema import Totals
from batchgen.storage import (
    ObjectFolder,
    StorageSettings,
    is_uri,
    now_iso,
)

MANIFEST_FORMAT = "batchgen-output"
MANIFEST_VERSION = 1


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


def new_manifest(fingerprint: Mapping[str, str]) -> dict[str, Any]:
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
        return inspect_object_folder(ObjectFolder(str(path), storage), fingerprint, fresh, adopt)
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
    manifest = manifest_for_job(str(path), _reader(path, None), fresh)
    return _judge(path, manifest, os.listdir(path), fingerprint, fresh, adopt)


def manifest_for_job(
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


def inspect_object_folder(
    store: ObjectFolder, fingerprint: Mapping[str, str], fresh: bool, adopt: Sequence[str]
) -> FolderState:
    store.check_bucket()
    manifest = manifest_for_job(store.uri, store.read_bytes, fresh)
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
