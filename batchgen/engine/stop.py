"""Stop strings: finding them in a sequence's output text (no torch; the scheduler calls it)."""

from __future__ import annotations

from collections.abc import Callable, Sequence


class StopStrings:
    """Finds the first stop string in a sample's output text, given a detokenize function.

    The scheduler asks after every new token; a new match must involve the newest token (older
    text was checked before), so only the last few tokens are decoded, and the whole output on a
    hit.
    """

    def __init__(self, detokenize: Callable[[list[int]], str]) -> None:
        self.detokenize = detokenize

    def match(self, output_ids: Sequence[int], stops: Sequence[str]) -> str | None:
        """The output text cut before its earliest stop string, or None when there is none."""
        if not stops or not output_ids:
            return None
        tail = self.detokenize(list(output_ids[-(max(map(len, stops)) + 2) :]))
        if not any(s in tail for s in stops):
            return None
        text = self.detokenize(list(output_ids))
        hits = [i for i in (text.find(s) for s in stops) if i >= 0]
        return text[: min(hits)] if hits else None
