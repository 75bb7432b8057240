"""The names in an output folder (README "The output folder"): the part files, and the hidden
``.batchgen/`` folder that holds everything else, on local disks and object stores alike.

    part-00000.parquet            the results: the only visible files of the folder
    .batchgen/manifest.json       which parts are committed (batchgen/results/)
    .batchgen/report.json         written when a job ends
    .batchgen/staging/            parts being written, not yet under their final name
    .batchgen/lock                locked (flock) while a job writes a local folder
    .batchgen/lease/              object stores: the writers' leases (batchgen/storage.py)
    .batchgen/logs/               tracebacks of internal errors
    .batchgen/batch_output.jsonl  an OpenAI batch job's output, unless run-batch names one

Invariant: every name that is not a part file lies under ``.batchgen/``. Readers that skip
hidden paths (pyarrow.dataset, pandas, DuckDB and polars with ``*.parquet``, Hugging Face
datasets) therefore read exactly the part files.

Folders written before this layout kept the bookkeeping beside the parts under the ``LEGACY_``
names; :mod:`batchgen.legacy_layout` moves them in. Names here are relative to the output
folder, with ``/`` (object names on a store, relative paths on a disk).
"""

from __future__ import annotations

import re

# The hidden folder, and the names in it (``*_FILE``: relative to it).
HIDDEN_DIR = ".batchgen"
MANIFEST_FILE = "manifest.json"
REPORT_FILE = "report.json"
LOCK_FILE = "lock"
STAGING_DIR = "staging"
LOGS_DIR = "logs"
BATCH_OUTPUT_FILE = "batch_output.jsonl"

# The same names, relative to the output folder.
MANIFEST_NAME = f"{HIDDEN_DIR}/{MANIFEST_FILE}"
REPORT_NAME = f"{HIDDEN_DIR}/{REPORT_FILE}"
LOCK_NAME = f"{HIDDEN_DIR}/{LOCK_FILE}"
STAGING_PREFIX = f"{HIDDEN_DIR}/{STAGING_DIR}/"
LEASE_PREFIX = f"{HIDDEN_DIR}/lease/"
LOGS_PREFIX = f"{HIDDEN_DIR}/{LOGS_DIR}/"
BATCH_OUTPUT_NAME = f"{HIDDEN_DIR}/{BATCH_OUTPUT_FILE}"

# The earlier layout (bookkeeping beside the parts), read and migrated, never written.
LEGACY_MANIFEST_NAME = "_manifest.json"
LEGACY_REPORT_NAME = "_report.json"
LEGACY_BATCH_OUTPUT_NAME = "_batch_output.jsonl"
LEGACY_LOCK_NAME = ".batchgen.lock"
LEGACY_STAGING_PREFIX = "_staging/"
LEGACY_LEASE_PREFIX = "_lease/"

PART_RE = re.compile(r"^part-(\d{5,})\.parquet$")


def part_name(number: int) -> str:
    """The file name of part ``number``: ``part-00007.parquet``."""
    return f"part-{number:05d}.parquet"


__all__ = [
    "BATCH_OUTPUT_FILE",
    "BATCH_OUTPUT_NAME",
    "HIDDEN_DIR",
    "LEASE_PREFIX",
    "LEGACY_BATCH_OUTPUT_NAME",
    "LEGACY_LEASE_PREFIX",
    "LEGACY_LOCK_NAME",
    "LEGACY_MANIFEST_NAME",
    "LEGACY_REPORT_NAME",
    "LEGACY_STAGING_PREFIX",
    "LOCK_FILE",
    "LOCK_NAME",
    "LOGS_DIR",
    "LOGS_PREFIX",
    "MANIFEST_FILE",
    "MANIFEST_NAME",
    "PART_RE",
    "REPORT_FILE",
    "REPORT_NAME",
    "STAGING_DIR",
    "STAGING_PREFIX",
    "part_name",
]
