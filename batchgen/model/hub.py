"""Models by hub id: ``model: org/name`` (with an optional ``revision``) resolved to a folder of
the local Hugging Face cache, downloaded only where the network allows.

Order: the cache first (``snapshot_download(local_files_only=True)``; ``HF_HUB_CACHE``, else
``HF_HOME``/hub, else ``~/.cache/huggingface/hub``); a download only when that fails and
``HF_HUB_OFFLINE`` is not set; otherwise a :class:`~batchgen.errors.ModelError` (exit 2) saying
what is missing. The job then runs on the snapshot folder as on any local folder, so the
fingerprint identifies the model by its files, as for a local folder.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from batchgen.errors import JobError, ModelError

# The files a model folder needs (docs/job-file.md: config, safetensors weights, tokenizer files).
DOWNLOAD_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "tokenizer*"]
# <cache>/models--org--name/snapshots/<commit>: the layout huggingface_hub writes.
_SNAPSHOT_RE = re.compile(r"models--(?P<org>[^/]+?)--(?P<name>[^/]+)/snapshots/(?P<commit>[^/]+)$")


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache, as huggingface_hub finds it from the environment (read at
    each call, not at import, so a changed environment counts)."""
    env = os.environ
    for key in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if env.get(key):
            return Path(env[key]).expanduser()
    if env.get("HF_HOME"):
        return Path(env["HF_HOME"]).expanduser() / "hub"
    xdg = env.get("XDG_CACHE_HOME") or os.path.join("~", ".cache")
    return Path(xdg).expanduser() / "huggingface" / "hub"


def hub_offline() -> bool:
    """Whether ``HF_HUB_OFFLINE`` forbids downloads."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")


def snapshot_folder(repo_id: str, revision: str | None) -> Path:
    """The local folder of ``repo_id`` at ``revision`` (a branch, tag or commit; None: main):
    from the cache, else downloaded (only where allowed). Raises ModelError, one line."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    rev = revision or "main"
    cache = hub_cache_dir()
    try:
        return Path(
            snapshot_download(repo_id, revision=rev, cache_dir=cache, local_files_only=True)
        )
    except (LocalEntryNotFoundError, FileNotFoundError, OSError):
        pass
    where = (
        f"model {repo_id} (revision {rev}) is not a local folder and not in the Hugging Face "
        f"cache {cache}"
    )
    if hub_offline():
        raise ModelError(
            f"{where}, and HF_HUB_OFFLINE is set: download it where the network allows "
            f"(hf download {repo_id} --revision {rev}) or give a local folder"
        )
    try:
        return Path(
            snapshot_download(
                repo_id, revision=rev, cache_dir=cache, allow_patterns=DOWNLOAD_PATTERNS
            )
        )
    except RevisionNotFoundError:
        raise ModelError(f"model {repo_id}: the hub has no revision {rev}") from None
    except RepositoryNotFoundError:
        raise ModelError(
            f"{where}, and the hub has no such model (a private one needs HF_TOKEN)"
        ) from None
    except Exception as err:  # noqa: BLE001 - network errors come in many types
        detail = " ".join(str(err).split())[:200]
        raise ModelError(f"{where}, and downloading it failed: {detail}") from None


def resolve_model(job: Any) -> Any:
    """The job with ``model`` a local folder: a hub id is resolved (:func:`snapshot_folder`) to
    its snapshot folder and ``revision`` cleared (the folder names the commit). A job whose
    model is a local folder is returned as it is (``revision`` must then be unset)."""
    hub_id = job.hub_id
    if hub_id is None:
        if job.revision is not None:
            raise JobError(
                f"revision: applies to a hub id (org/name) only; model is the local folder "
                f"{job.model}"
            )
        return job
    folder = snapshot_folder(hub_id, job.revision)
    return job.model_copy(update={"model": folder, "revision": None})


def localize(model: Path) -> Path:
    """A model folder as this machine has it: ``model`` itself if it exists here; else, when
    it is a snapshot folder of a hub cache (another node's), the same commit from this node's
    cache (downloaded where allowed). Ray workers use it: no shared filesystem needed."""
    if model.exists():
        return model
    m = _SNAPSHOT_RE.search(model.as_posix())
    if m is None:
        return model  # not a hub snapshot: the model checks report the missing folder
    return snapshot_folder(f"{m['org']}/{m['name']}", m["commit"])


__all__ = ["hub_cache_dir", "hub_offline", "localize", "resolve_model", "snapshot_folder"]
