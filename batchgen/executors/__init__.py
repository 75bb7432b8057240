"""Where a job's engines run. Every executor has the same small interface (:class:`Executor`);
:class:`batchgen.runner.JobRun` owns the only refill / poll / commit loop over it.

- ``local`` (:mod:`batchgen.executors.local`): one engine in this process.
- ``ray`` (:mod:`batchgen.executors.ray`): engines as Ray actors, rows grouped by prefix.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from batchgen.prompts import EncodedRow
from batchgen.schema import RowGroup


class Executor(Protocol):
    """Runs prompts to completion; hands back finished input rows (all ``n`` samples of a row
    at once). Usage: while :meth:`wants_work`, :meth:`submit` windows of rows; then
    :meth:`poll` while :meth:`has_work`; :meth:`close` at the end (also after an error)."""

    window_rows: int  # rows to read, tokenize and submit at a time

    def wants_work(self) -> bool:
        """Whether another window of rows should be submitted now (to keep the engines busy)."""
        ...

    def submit(self, rows: Sequence[EncodedRow]) -> None:
        """Queue rows that have prompt tokens. A row that cannot run on this executor (a prompt
        longer than its max_model_len) comes back from :meth:`poll` as error rows."""
        ...

    def has_work(self) -> bool:
        """Whether submitted rows are still to be handed back."""
        ...

    def poll(self) -> list[RowGroup]:
        """Advance (one engine step, or a short wait for workers); the rows finished since."""
        ...

    def numerics(self) -> str:
        """The numerics the engines resolved, as the fingerprint records them
        (:func:`batchgen.fingerprint.numerics`); a JobError where engines disagree."""
        ...

    def sampled_tokens(self) -> int:
        """Tokens drawn so far (the progress bar's tokens/s)."""
        ...

    def report(self) -> dict[str, Any]:
        """The executor's part of ``.batchgen/report.json``."""
        ...

    def close(self) -> None:
        """Release the engines (idempotent)."""
        ...
