"""Parquet out: part files, the manifest, the report. Durable and resumable.

One noun, the output folder, in four modules along its seams:

- :mod:`~batchgen.results.manifest`: the manifest (read, new, a part added) and the read-only
  inspection of a folder that ``validate`` and ``open`` share;
- :mod:`~batchgen.results.local`: :class:`OutputFolder`, a local folder and its commit protocol
  (durability by rename, a lock);
- :mod:`~batchgen.results.objects`: :class:`ObjectOutputFolder`, an ``s3://`` prefix and its
  commit protocol (the manifest is the commit point, a lease);
- :mod:`~batchgen.results.writer`: :class:`PartWriter`, which buffers finished rows and commits
  them as part files.

The file primitives are in :mod:`batchgen.storage`, status in :mod:`batchgen.status`.

Layout of an output folder (docs/job-file.md, "The output folder"; the names are
:mod:`batchgen.layout`'s)::

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
"""

from batchgen.layout import LOCK_NAME, MANIFEST_NAME, REPORT_NAME
from batchgen.results.local import COMMIT_STEPS, OutputFolder
from batchgen.results.manifest import (
    FolderState,
    inspect_folder,
    read_manifest,
    read_report,
    totals_of,
)
from batchgen.results.objects import ObjectOutputFolder
from batchgen.results.writer import PartWriter

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
