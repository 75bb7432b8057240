"""``batchgen status``: how far the job in an output folder has got, read from its manifest
(safe while the job runs: the manifest is replaced atomically)."""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

from batchgen.errors import JobError
from batchgen.results import MANIFEST_NAME, read_manifest, read_report, totals_of
from batchgen.storage import is_uri


def _age(iso: str | None) -> str:
    if not iso:
        return "never"
    try:
        then = datetime.strptime(iso, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=timezone.utc)
    except ValueError:
        return iso
    seconds = max(0.0, (datetime.now(timezone.utc) - then).total_seconds())
    if seconds < 120:
        ago = f"{seconds:.0f}s ago"
    elif seconds < 7200:
        ago = f"{seconds / 60:.0f} min ago"
    elif seconds < 172800:
        ago = f"{seconds / 3600:.0f} h ago"
    else:
        ago = f"{seconds / 86400:.0f} days ago"
    return f"{then.strftime('%Y-%m-%d %H:%M:%S')} UTC ({ago})"


def read_status(path: Path | str) -> str:
    """How far the job in this output folder has got, as a few lines of text.

    Safe while a job runs (the manifest is replaced atomically). JobError if ``path`` is not an
    output folder. ``path`` may be an ``s3://`` URI (endpoint and credentials from the AWS
    variables). Folders in the earlier layout (``_manifest.json``) are read as well.
    """
    if not is_uri(path):
        path = Path(path)
        if not path.is_dir():
            raise JobError(f"{path} is not a folder")
    manifest = read_manifest(path)
    if manifest is None:
        raise JobError(f"{path} is not a batchgen output folder (no {MANIFEST_NAME})")
    totals = {**totals_of([]), **manifest.get("totals", {})}
    total_rows = manifest.get("total_rows")
    rows = totals["rows"]
    if total_rows:
        progress = f"{rows:,} of {total_rows:,} rows ({100.0 * rows / total_rows:.1f}%)"
    elif total_rows == 0:
        progress = "0 of 0 rows"
    else:
        progress = f"{rows:,} rows (total not known yet)"
    state = "finished" if manifest.get("finished") else "not finished (running or interrupted)"
    lines = [
        f"output:        {path}",
        f"state:         {state}",
        f"progress:      {progress}",
        f"samples:       {totals['samples']:,} ({totals['errors']:,} errors)",
        f"prompt tokens: {totals['prompt_tokens']:,} "
        f"({totals['cached_prompt_tokens']:,} from the prefix cache)",
        f"output tokens: {totals['output_tokens']:,}",
        f"parts:         {totals['parts']:,}",
        f"last commit:   {_age(manifest.get('last_commit_at'))}",
    ]
    report = read_report(path)
    if isinstance(report, dict) and "elapsed_s" in report:
        speed = report.get("output_tokens_per_s")
        speed_text = f", {speed:,.1f} output tokens/s" if isinstance(speed, (int, float)) else ""
        lines.append(f"last run:      {float(report['elapsed_s']):,.1f} s{speed_text}")
    return "\n".join(lines)
