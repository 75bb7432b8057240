"""Where bytes live, durably: the primitives of the output folder's commit protocol, on local
disks and on object stores (``s3://``, through pyarrow's S3 filesystem).

Local:

- :func:`write_durably`: temp name, write, fsync, rename, fsync the folder. Readers see the old
  file or the new one, never a partial one; a failed write leaves no temp file behind.
- :func:`lock_folder`: an exclusive POSIX lock, so two jobs never write one folder at once.

Object storage (no rename, no lock):

- :class:`ObjectFolder`: a prefix as a folder of objects; each write is one PUT (whole or
  absent), copies are server-side.
- :class:`ObjectLease`: a lease object per writer keeps two writers apart (its docstring says
  exactly what that guarantees).
- :func:`s3_filesystem`: endpoint, region and credentials from the usual AWS variables and the
  job's ``storage:`` section.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import socket
import threading
import time
import uuid
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, Any, Protocol

from batchgen.errors import JobError
from batchgen.layout import LEASE_PREFIX, LEGACY_LEASE_PREFIX


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


# --------------------------------------------------------------------------- object storage

S3_SCHEME = "s3://"
# How long a lease object stays valid without being renewed; the holder renews it every
# LEASE_SECONDS / 4. Measured on the store's clock (see ObjectLease).
LEASE_SECONDS = 60.0


def is_uri(path: object) -> bool:
    """Whether ``path`` names an object-store location (``s3://bucket/prefix``)."""
    return isinstance(path, str) and path.startswith(S3_SCHEME)


class StorageSettings(Protocol):
    """The job file's ``storage:`` section, as this module reads it (all optional)."""

    endpoint_url: str | None
    region: str | None
    lease_seconds: float


def s3_filesystem(settings: StorageSettings | None = None) -> Any:
    """A pyarrow S3FileSystem. Endpoint and region come from ``settings`` (the job's
    ``storage:`` section), else from ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL`` and
    ``AWS_REGION`` / ``AWS_DEFAULT_REGION``; credentials from AWS's usual chain (the
    ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` variables, a profile, an instance role).
    Credentials are never read or stored by batchgen itself."""
    from pyarrow import fs as pafs

    env = os.environ
    endpoint = (settings.endpoint_url if settings else None) or env.get(
        "AWS_ENDPOINT_URL_S3", env.get("AWS_ENDPOINT_URL")
    )
    region = (settings.region if settings else None) or env.get(
        "AWS_REGION", env.get("AWS_DEFAULT_REGION")
    )
    kwargs: dict[str, Any] = {
        "retry_strategy": pafs.AwsStandardS3RetryStrategy(max_attempts=3),
        "connect_timeout": 10.0,
        "request_timeout": 60.0,
    }
    if endpoint:
        scheme, sep, host = endpoint.partition("://")
        kwargs["endpoint_override"] = host.rstrip("/") if sep else endpoint.rstrip("/")
        if sep:
            kwargs["scheme"] = scheme
    if region:
        kwargs["region"] = region
    try:
        return pafs.S3FileSystem(**kwargs)
    except Exception as err:  # noqa: BLE001 - pyarrow raises ArrowInvalid, OSError, ...
        raise JobError(f"cannot set up S3 access: {err}") from None


def split_uri(uri: str) -> str:
    """``s3://bucket/a/b/`` -> ``bucket/a/b`` (pyarrow's S3 path), checked to name a bucket."""
    path = uri[len(S3_SCHEME) :].strip("/")
    if not path or path.startswith("/"):
        raise JobError(f"{uri}: an s3:// path needs a bucket, e.g. s3://bucket/prefix")
    return path


def storage_error(what: str, err: BaseException) -> JobError:
    """One line for a failed request to the object store."""
    detail = " ".join(str(err).split())[:300]
    return JobError(f"{what}: {detail}")


class ObjectFolder:
    """A prefix in an object store, seen as a folder of named objects (names relative to it;
    ``.batchgen/staging/x`` is a name too). Every write is one PUT, so a reader sees a whole object or
    none; there is no rename (see :mod:`batchgen.results` for the commit protocol built on it).
    """

    def __init__(self, uri: str, settings: StorageSettings | None = None) -> None:
        self.uri = uri.rstrip("/")
        self.root = split_uri(uri)
        self.fs = s3_filesystem(settings)
        self.lease_seconds = float(settings.lease_seconds) if settings else LEASE_SECONDS

    def __str__(self) -> str:
        return self.uri

    def _full(self, name: str) -> str:
        return f"{self.root}/{name}"

    def check_bucket(self) -> None:
        """JobError unless the bucket exists (and is reachable with these credentials), or if
        the prefix itself is an object (a file, not a folder)."""
        from pyarrow import fs as pafs

        bucket = self.root.split("/", 1)[0]
        try:
            infos = self.fs.get_file_info([bucket, self.root])
        except OSError as err:
            raise storage_error(f"cannot reach {self.uri}", err) from None
        if infos[0].type == pafs.FileType.NotFound:
            raise JobError(f"{self.uri}: bucket {bucket} does not exist")
        if self.root != bucket and infos[1].type == pafs.FileType.File:
            raise JobError(f"output path {self.uri} is an object, not a folder (prefix)")

    def list(self) -> dict[str, Any]:
        """Every object under the prefix (recursively): name -> pyarrow FileInfo."""
        return self.list_prefix("")

    def exists(self, name: str) -> bool:
        from pyarrow import fs as pafs

        try:
            return bool(self.fs.get_file_info(self._full(name)).type == pafs.FileType.File)
        except OSError as err:
            raise storage_error(f"cannot read {self.uri}/{name}", err) from None

    def list_prefix(self, sub: str) -> dict[str, Any]:
        """The objects under ``sub`` (a name prefix ending in ``/``, or ``""``: all), as
        :meth:`list` gives them."""
        from pyarrow import fs as pafs

        base = f"{self.root}/{sub.rstrip('/')}" if sub else self.root
        selector = pafs.FileSelector(base, recursive=True, allow_not_found=True)
        try:
            infos = self.fs.get_file_info(selector)
        except OSError as err:
            raise storage_error(f"cannot list {self.uri}", err) from None
        start = len(self.root) + 1
        return {i.path[start:]: i for i in infos if i.type == pafs.FileType.File}

    def read_bytes(self, name: str) -> bytes | None:
        """The object's bytes; None if there is none."""
        try:
            with self.fs.open_input_stream(self._full(name)) as f:
                return f.read()
        except FileNotFoundError:
            return None
        except OSError as err:
            if "NoSuchKey" in str(err) or "not found" in str(err).lower():
                return None
            raise storage_error(f"cannot read {self.uri}/{name}", err) from None

    def open_input(self, name: str) -> Any:
        """A random-access pyarrow file for ``name`` (for Parquet readers)."""
        return self.fs.open_input_file(self._full(name))

    def put(self, name: str, write: Callable[[IO[bytes]], None]) -> None:
        """Write ``name`` in one upload: readers see the old object or the new one, whole."""
        buf = io.BytesIO()
        write(buf)
        data = buf.getvalue()
        try:
            with self.fs.open_output_stream(self._full(name)) as f:
                f.write(data)
        except OSError as err:
            raise storage_error(f"cannot write {self.uri}/{name}", err) from None

    def copy(self, src: str, dst: str) -> None:
        """Server-side copy (no bytes through this process); ``dst`` appears whole."""
        try:
            self.fs.copy_file(self._full(src), self._full(dst))
        except OSError as err:
            raise storage_error(f"cannot copy {self.uri}/{src} to {dst}", err) from None

    def delete(self, name: str) -> None:
        """Delete ``name``; a missing object is not an error."""
        try:
            self.fs.delete_file(self._full(name))
        except FileNotFoundError:
            pass
        except OSError as err:
            if "NoSuchKey" not in str(err) and "not found" not in str(err).lower():
                raise storage_error(f"cannot delete {self.uri}/{name}", err) from None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # e.g. EPERM: it exists, as another user's
        return True
    return True


class ObjectLease:
    """Keeps two writers out of one object-store folder: a lease object per writer,
    ``.batchgen/lease/<token>.json``, renewed every ``ttl / 4`` seconds by a thread while held.

    Acquire: PUT our own lease object (a unique name: no writer overwrites another's), then LIST
    the leases: under ``.batchgen/lease/``, and under ``_lease/``, where an earlier batchgen keeps
    its own (so a folder it is writing is not migrated under it). Another lease that is live
    makes us delete ours and refuse. Live means renewed
    less than ``ttl`` seconds before ours was written, both times being the store's own
    ``LastModified`` stamps (so the writers' clocks, skewed or not, play no part), and, when it
    names this host, its process still exists (so a writer killed here is taken over at once;
    one killed on another host only once its lease has expired).

    What it guarantees, on a store with strong read-after-write consistency for PUT and LIST
    (AWS S3 since 2020, MinIO, moto): two writers that acquire concurrently cannot both succeed.
    Each PUTs before it LISTs, so whichever LISTs last sees the other's lease; both may refuse,
    never both proceed. pyarrow's S3 filesystem offers no conditional put (If-None-Match), hence
    the list-based check.

    What it does not guarantee: mutual exclusion against a writer that stops renewing for longer
    than ``ttl`` and then carries on (a paused process or VM, a long network partition). Its
    lease expires and another writer may take the folder. The holder narrows that window: before
    each manifest write (:meth:`check`) it stops if it has not renewed for ``ttl`` (its own
    monotonic clock), if its lease object is gone, or if another live lease exists; its renewal
    thread never re-creates a lease another writer deleted; and a part is never copied over an
    existing one (results.py). A pause between the check and the write is not caught: the stale
    writer's manifest may then replace the other's, whose rows since drop out of the manifest
    (they are generated again, and their part objects deleted, on the next run); a row is never
    listed twice, since a manifest is only ever written whole by one writer.
    """

    def __init__(self, folder: ObjectFolder) -> None:
        self.folder = folder
        self.ttl = folder.lease_seconds
        self.token = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.name = f"{LEASE_PREFIX}{self.token}.json"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lost: str | None = None
        self._renewed = time.monotonic()  # when our lease was last written (this machine's clock)

    def _body(self) -> bytes:
        return json_bytes(
            {
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "token": self.token,
                "renewed_at": now_iso(),  # the writer's clock: for people, not for the check
                "ttl_s": self.ttl,
            }
        )

    def _write(self) -> None:
        data = self._body()
        started = time.monotonic()
        self.folder.put(self.name, lambda f: f.write(data))
        self._renewed = started

    def _others(self) -> tuple[Any, list[tuple[str, Any, dict[str, Any]]]]:
        """Our lease's FileInfo (None if gone) and the other leases with their bodies."""
        infos = {
            n: i
            for n, i in self.folder.list().items()
            if n.startswith((LEASE_PREFIX, LEGACY_LEASE_PREFIX))
        }
        mine = infos.pop(self.name, None)
        others = []
        for name, info in infos.items():
            try:
                body = json.loads(self.folder.read_bytes(name) or b"{}")
            except ValueError:
                body = {}
            others.append((name, info, body if isinstance(body, dict) else {}))
        return mine, others

    def _live(self, mine: Any, info: Any, body: dict[str, Any]) -> bool:
        age = (mine.mtime - info.mtime).total_seconds() if mine is not None else 0.0
        if age > self.ttl:
            return False
        pid = body.get("pid")
        if body.get("host") == socket.gethostname() and isinstance(pid, int):
            return _pid_alive(pid)
        return True

    def acquire(self) -> None:
        """Take the lease or raise JobError naming the writer that holds it."""
        self._write()
        mine, others = self._others()
        live = []
        for name, info, body in others:
            if self._live(mine, info, body):
                live.append(body)
            else:
                self.folder.delete(name)  # expired, or its process is gone
        if live:
            self.folder.delete(self.name)
            holder = live[0]
            raise JobError(
                f"output folder {self.folder} is in use by another batchgen process "
                f"(pid {holder.get('pid', '?')} on {holder.get('host', '?')}); its lease "
                f"expires {self.ttl:g} s after its last renewal"
            )
        self._thread = threading.Thread(target=self._renew_loop, daemon=True)
        self._thread.start()

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.ttl / 4):
            try:
                # A lease another writer deleted (it found ours expired) is not written again:
                # the folder is that writer's now, and the next check() says so.
                if self.name not in self.folder.list_prefix(LEASE_PREFIX):
                    self._lost = "another writer took over its expired lease (was it paused?)"
                    return
                self._write()
            except JobError:
                pass  # a failed renewal: check() stops the writer once the lease may be expired

    def check(self) -> None:
        """Before a commit: JobError if our lease is gone or another writer holds a live one."""
        age = time.monotonic() - self._renewed
        if age > self.ttl:
            self._lost = f"it was not renewed for {age:.0f} s (lease_seconds is {self.ttl:g})"
        if self._lost:
            raise JobError(f"output folder {self.folder}: lost the writer's lease: {self._lost}")
        mine, others = self._others()
        if mine is None:
            self._lost = "its lease object was removed (expired: was this process paused?)"
        elif any(self._live(mine, info, body) for _, info, body in others):
            self._lost = "another writer holds a lease on it"
        if self._lost:
            raise JobError(f"output folder {self.folder}: lost the writer's lease: {self._lost}")

    def release(self) -> None:
        """Stop renewing and delete the lease object. Idempotent."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout=5)
            with contextlib.suppress(JobError):
                self.folder.delete(self.name)


def list_object_files(
    spec: str, settings: StorageSettings | None = None, suffix: str = ".parquet"
) -> tuple[Any, list[str]]:
    """The input files an ``s3://`` ``input.path`` names, as the local rules read a path: one
    object; a prefix (its ``*<suffix>`` objects, not recursive, skipping names starting with
    ``_`` or ``.``); or a glob (``**`` recurses). Returns the filesystem and the files' pyarrow
    paths (``bucket/key``), sorted. Raises JobError when nothing matches."""
    from pyarrow import fs as pafs

    fs = s3_filesystem(settings)
    root = split_uri(spec)
    try:
        if not set("*?[") & set(root):
            info = fs.get_file_info(root)
            if info.type == pafs.FileType.File:
                return fs, [root]
            selector = pafs.FileSelector(root, recursive=False, allow_not_found=True)
            files = sorted(
                i.path
                for i in fs.get_file_info(selector)
                if i.type == pafs.FileType.File
                and i.base_name.endswith(suffix)
                and not i.base_name.startswith(("_", "."))
            )
            if not files:
                raise JobError(f"input.path {spec} names no object and no *{suffix} objects")
            return fs, files
        fixed = root[: min(root.index(c) for c in "*?[" if c in root)].rsplit("/", 1)[0]
        selector = pafs.FileSelector(fixed, recursive=True, allow_not_found=True)
        pattern = re.compile(_glob_regex(root))
        files = sorted(
            i.path
            for i in fs.get_file_info(selector)
            if i.type == pafs.FileType.File and pattern.match(i.path)
        )
    except OSError as err:
        raise storage_error(f"cannot list input.path {spec}", err) from None
    if not files:
        raise JobError(f"input.path {spec} matches no objects")
    return fs, files


def _glob_regex(pattern: str) -> str:
    """A glob as a regex over whole keys: ``*`` and ``?`` stay within one path segment,
    ``**/`` spans any number of them."""
    out = ""
    i = 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out += "(?:[^/]+/)*"
            i += 3
        elif pattern.startswith("**", i):
            out += ".*"
            i += 2
        elif pattern[i] == "*":
            out += "[^/]*"
            i += 1
        elif pattern[i] == "?":
            out += "[^/]"
            i += 1
        else:
            out += re.escape(pattern[i])
            i += 1
    return out + r"\Z"
