"""Where bytes live, durably: the local-file primitives of the output folder's commit protocol.

- :func:`write_durably`: temp name, write, fsync, rename, fsync the folder. Readers see the old
  file or the new one, never a partial one; a failed write leaves no temp file behind.
- :func:`lock_folder`: an exclusive POSIX lock, so two jobs never write one folder at once.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, Any

from batchgen.errors import JobError


def now_iso() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def fsync_dir(folder: Path) -> None:
    """Make a rename in ``folder`` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_durably(
    folder: Path,
    name: str,
    write: Callable[[IO[bytes]], None],
    before_rename: Callable[[], None] | None = None,
) -> None:
    """Write ``folder/name`` by temp file, fsync, rename, fsync folder.

    Readers see the old file or the new one, never a partial one.
    """
    tmp = folder / f".{name}.tmp"
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
    except OSError:
        with contextlib.suppress(OSError):  # e.g. a full disk: give its space back now
            tmp.unlink(missing_ok=True)
        raise
    if before_rename is not None:
        before_rename()
    os.replace(tmp, folder / name)
    fsync_dir(folder)


def json_bytes(obj: Any) -> bytes:
    return (json.dumps(obj, indent=1, default=str) + "\n").encode("utf-8")


def lock_folder(lock_file: Path, folder: Path) -> int | None:
    """Hold an exclusive lock on the folder (POSIX flock) so two jobs never write it at once.

    ``lock_file`` (created if missing) is the file locked. Returns its file descriptor (None where flock does not exist); it is released when
    closed or when the process ends, also by a crash.
    """
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock, documented limitation
        return None
    fd = os.open(lock_file, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise JobError(f"output folder {folder} is in use by another batchgen process") from None
    return fd
