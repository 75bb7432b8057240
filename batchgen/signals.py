"""Ctrl-C and SIGTERM: one implementation for the command line and the job loop.

Two phases, each with its own handler for SIGINT and SIGTERM:

- **Start-up** (:func:`exit_at_once`): imports and model loading cannot be stopped gracefully,
  and until the job loop runs there is nothing finished to save, so a signal exits 130 at once.
- **Generating** (:class:`GracefulStop`): the first signal sets ``stop``; the job loop then stops
  admitting work, commits what has finished, writes the report and raises :class:`Interrupted`.
  A second signal exits 130 at once.

Exiting hard (``os._exit``) loses nothing a SIGKILL would not: every file of an output folder is
written to a temp name and renamed, and the next run removes a half-done commit. Raising
KeyboardInterrupt instead is not reliable: a library's broad ``except`` can swallow it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Iterator
from typing import Any, NoReturn

EXIT_INTERRUPTED = 130
SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(Exception):
    """Raised after a SIGINT/SIGTERM once everything finished so far has been saved.

    ``signum``: the signal that stopped the job (None when not stopped by a signal)."""

    def __init__(self, message: str, signum: int | None = None) -> None:
        super().__init__(message)
        self.signum = signum


def exit_now(message: str) -> NoReturn:
    """Write ``message`` to stderr and leave with exit code 130 at once."""
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    with contextlib.suppress(Exception):
        sys.stderr.flush()
    os.write(2, f"\n{message}\n".encode())
    os._exit(EXIT_INTERRUPTED)


def _install(handler: Any) -> dict[int, Any]:
    """Set ``handler`` for SIGINT and SIGTERM; the previous handlers (empty off the main
    thread, where signals cannot be set and stay as they are)."""
    previous: dict[int, Any] = {}
    try:
        for sig in SIGNALS:
            previous[sig] = signal.signal(sig, handler)
    except ValueError:  # not the main thread
        _restore(previous)
        return {}
    return previous


def _restore(previous: dict[int, Any]) -> None:
    for sig, handler in previous.items():
        # None: the handler was not set from Python; the default is the closest we have.
        signal.signal(sig, signal.SIG_DFL if handler is None else handler)
    previous.clear()


@contextlib.contextmanager
def exit_at_once() -> Iterator[None]:
    """While the block runs, SIGINT and SIGTERM exit 130 at once.

    When the block ends with an :class:`Interrupted` caused by a signal, the handlers stay: the
    process is on its way out with exit code 130, and a further Ctrl-C during interpreter
    teardown must end it with 130 too, not as a SIGTERM death or click's "Aborted!".
    """
    previous = _install(lambda signum, frame: exit_now("interrupted"))
    try:
        yield
    except Interrupted as exc:
        if exc.signum is not None:
            previous.clear()
        raise
    finally:
        _restore(previous)


class GracefulStop:
    """The job loop's handlers: the first signal sets :attr:`stop` (and :attr:`received`), the
    second exits 130 at once. Use as a context manager around the loop."""

    def __init__(self) -> None:
        self.stop = False
        self.received: int | None = None  # the number of the first signal
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> GracefulStop:
        self._previous = _install(self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        _restore(self._previous)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.stop:
            exit_now("interrupted again: stopped at once; rows committed so far are kept")
        self.stop = True
        self.received = signum
