"""The part writer: finished rows in, part files committed to an output folder."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import pyarrow as pa

if TYPE_CHECKING:
    from batchgen.results.local import OutputFolder, StepHook


class PartWriter:
    """Buffers finished rows and commits them as new part files.

    Invariant: the buffer holds whole input rows (all n samples added by one
    :meth:`add_row_group`), so a commit never splits an input row across parts or crashes.
    """

    def __init__(
        self,
        folder: OutputFolder,
        schema: pa.Schema,
        commit_rows: int,
        commit_seconds: float,
        *,
        on_step: StepHook | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.folder = folder
        self.schema = schema
        self.commit_rows = commit_rows
        self.commit_seconds = commit_seconds
        self._on_step = on_step
        self._clock = clock
        self._rows: list[dict[str, Any]] = []  # output rows (samples), whole input rows only
        self._groups = 0  # input rows in the buffer
        self._last_commit = clock()

    def add_row_group(self, rows: Sequence[Mapping[str, Any]]) -> None:
        """Buffer all sample rows of ONE input row (dicts keyed by schema column names)."""
        if not rows:
            raise ValueError("a row group holds at least one sample")
        first_id = rows[0].get("id")
        if any(r.get("id") != first_id for r in rows):
            raise ValueError("a row group holds the samples of one input row only")
        self._rows.extend(dict(r) for r in rows)
        self._groups += 1

    def maybe_commit(self) -> bool:
        """Commit if ``commit_rows`` output rows are buffered or ``commit_seconds`` have passed
        since the last commit. Returns whether it committed."""
        if not self._rows:
            return False
        due = self._clock() - self._last_commit >= self.commit_seconds
        if len(self._rows) >= self.commit_rows or due:
            self.commit()
            return True
        return False

    def commit(self) -> None:
        """Write the buffered rows as a new part, then the manifest. A no-op when empty.

        On an exception the buffer is kept (nothing was committed: the manifest is unchanged).
        """
        if not self._rows:
            self._last_commit = self._clock()
            return
        table = pa.Table.from_pylist(self._rows, schema=self.schema)
        self.folder._commit_part(table, self._groups, self._on_step)
        self._rows = []
        self._groups = 0
        self._last_commit = self._clock()
