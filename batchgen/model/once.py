"""A value built at most once, on first use, by whichever thread asks first."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

__all__ = ["Once"]

T = TypeVar("T")


class Once(Generic[T]):
    """``get()`` returns ``build()``'s result, calling ``build`` only the first time.

    Callers that arrive while the first one builds wait for it and get the same result (never a
    placeholder). Once built, ``get`` takes no lock: the result is published before the flag,
    so an unlocked reader that sees the flag sees the result.
    """

    def __init__(self, build: Callable[[], T]) -> None:
        self._build = build
        self._lock = threading.Lock()
        self._value: T | None = None
        self._done = False

    def get(self) -> T:
        if self._done:
            return self._value  # type: ignore[return-value]
        with self._lock:
            if not self._done:
                self._value = self._build()
                self._done = True  # after _value: see the class docstring
            return self._value  # type: ignore[return-value]
