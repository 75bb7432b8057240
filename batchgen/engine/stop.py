"""Stop strings: found in a sample's output text, decoded incrementally (no torch here).

Decoding a sample's whole output after every token costs O(output length) per step, and decoding
only its last few tokens misses stop strings that span more tokens than that (byte-level tokens of
multi-byte characters, byte fallback). So each sequence keeps a ``DecodedText``: the output text
that is final so far, and two offsets into its output tokens (the scheme of vLLM's incremental
detokenizer). Each step decodes only ``tokens[prefix_offset:]`` and ``tokens[prefix_offset:
read_offset]``; the new text is the difference. Decoding a window that starts at
``prefix_offset`` rather than at the new tokens keeps tokenizers that render a token differently
at the start of a text (SentencePiece's leading space) consistent with a decode of the whole
output. A decode that ends in U+FFFD ends in an incomplete UTF-8 character: its text is not final
yet and the offsets stay, but the text before the incomplete character is already searched.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

_REPLACEMENT = "\ufffd"
# Output tokens whose text may stay incomplete (decodes ending in U+FFFD) before it is taken as
# final anyway: a bound on the decode window when a sample emits invalid bytes. (A character is
# at most 4 bytes; a run of tokens that each end inside a character is much shorter in practice.)
_MAX_PENDING_TOKENS = 16


@dataclass
class DecodedText:
    """One sample's output text, decoded so far; see the module docstring.

    Invariants: ``prefix_offset <= read_offset <= number of output tokens``; ``pieces`` joined is
    the final text of ``output[:read_offset]``, ``length`` characters long, and ``recent`` is its
    last characters (at most the longest stop string minus one).
    """

    pieces: list[str] = field(default_factory=list)
    length: int = 0
    recent: str = ""
    prefix_offset: int = 0
    read_offset: int = 0


class StopStrings:
    """Finds the earliest stop string in a sample's output text, given ``detokenize``
    (token ids -> text, the same function the output text is made with)."""

    def __init__(self, detokenize: Callable[[list[int]], str]) -> None:
        self.detokenize = detokenize

    def match(
        self, state: DecodedText, token_ids: list[int], start: int, stops: Sequence[str]
    ) -> str | None:
        """Decode the output tokens ``token_ids[start:]`` added since the last call into
        ``state``; return the output text cut before the earliest stop string, or None while
        there is none.

        Cost: two decodes of the tokens since the last final text, a search of the new text plus
        the last ``max(len(stop)) - 1`` characters before it; the whole text is joined only on a
        match.
        """
        if not stops:
            return None
        num_output = len(token_ids) - start
        window = token_ids[start + state.prefix_offset :]
        read = state.read_offset - state.prefix_offset
        prefix_text = self.detokenize(window[:read]) if read else ""
        new = self.detokenize(window)[len(prefix_text) :]
        keep = max(map(len, stops)) - 1  # characters before the new text a match can start in
        searched_from = state.length - len(state.recent)
        final = bool(new) and (
            not new.endswith(_REPLACEMENT) or num_output - state.read_offset >= _MAX_PENDING_TOKENS
        )
        if final:
            haystack = state.recent + new
            state.pieces.append(new)
            state.length += len(new)
            state.recent = haystack[max(0, len(haystack) - keep) :]
            state.prefix_offset = state.read_offset
            state.read_offset = num_output
            pending = ""
        else:
            # the text before an incomplete character is final already
            pending = new.rstrip(_REPLACEMENT)
            haystack = state.recent + pending
        hits = [i for i in (haystack.find(s) for s in stops) if i >= 0]
        if not hits:
            return None
        return ("".join(state.pieces) + pending)[: searched_from + min(hits)]
