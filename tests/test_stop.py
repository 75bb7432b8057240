"""The incremental stop-string matcher against a whole-text reference, on token streams whose
tokens cut characters anywhere (byte-level BPE, byte fallback)."""

from __future__ import annotations

import random

import pytest

from batchgen.engine.stop import DecodedText, StopStrings


class ByteVocab:
    """Token ids for byte strings, decoded like a byte-level BPE (invalid bytes -> U+FFFD)."""

    def __init__(self) -> None:
        self.ids: dict[bytes, int] = {}
        self.pieces: list[bytes] = []
        self.decoded_lengths: list[int] = []  # tokens per detokenize call

    def token(self, piece: bytes) -> int:
        if piece not in self.ids:
            self.ids[piece] = len(self.pieces)
            self.pieces.append(piece)
        return self.ids[piece]

    def decode(self, ids: list[int]) -> str:
        self.decoded_lengths.append(len(ids))
        return b"".join(self.pieces[i] for i in ids).decode("utf-8", errors="replace")

    def tokenize(self, text: str, rng: random.Random) -> list[int]:
        """Cut the UTF-8 bytes of ``text`` at random places (1 to 5 bytes a token)."""
        data, out, i = text.encode(), [], 0
        while i < len(data):
            n = rng.randint(1, 5)
            out.append(self.token(data[i : i + n]))
            i += n
        return out


def run(matcher: StopStrings, prompt: list[int], output: list[int], stops: tuple[str, ...]):
    """Feed ``output`` one token at a time, as the scheduler does: (tokens taken, text) at the
    first match, or None."""
    state = DecodedText()
    tokens = list(prompt)
    for t in output:
        tokens.append(t)
        text = matcher.match(state, tokens, len(prompt), stops)
        if text is not None:
            return len(tokens) - len(prompt), text
    return None


def reference(decode, output: list[int], stops: tuple[str, ...]):
    for n in range(1, len(output) + 1):
        text = decode(output[:n])
        hits = [i for i in (text.find(s) for s in stops) if i >= 0]
        if hits:
            return n, text[: min(hits)]
    return None


@pytest.mark.parametrize("seed", range(40))
def test_matches_a_decode_of_the_whole_output_after_every_token(seed: int) -> None:
    rng = random.Random(seed)
    vocab = ByteVocab()
    text = "".join(rng.choice(["a", "b", " ", "é", "ü", "€", "😀", "𝄞"]) for _ in range(60))
    output = vocab.tokenize(text, rng)
    stops = tuple(
        text[i : i + rng.randint(1, 4)] if rng.random() < 0.8 else "zz"
        for i in (rng.randrange(len(text)) for _ in range(rng.randint(1, 3)))
    )
    got = run(StopStrings(vocab.decode), [vocab.token(b"p")] * 3, output, stops)
    assert got == reference(vocab.decode, output, stops)
    assert got is not None or "zz" in stops


def test_stop_completed_inside_a_token_that_also_starts_the_next_character() -> None:
    """``b"\\xa9\\xc3"`` ends the second "é" and starts a third: the decode ends incomplete, yet
    "éé" is complete and found in that very step."""
    vocab = ByteVocab()
    output = [vocab.token(b"x\xc3"), vocab.token(b"\xa9\xc3"), vocab.token(b"\xa9\xc3")]
    assert run(StopStrings(vocab.decode), [], output, ("éé",)) == (3, "x")


def test_leading_space_of_the_first_token_is_decoded_like_the_whole_output() -> None:
    """SentencePiece drops the space of the text's first token only: the new text of a step is
    the difference of two decodes from the same start, never a decode of the new token alone."""
    pieces = {1: " Hello", 2: " world", 3: "!"}

    def decode(ids: list[int]) -> str:
        return "".join(pieces[i] for i in ids).removeprefix(" ")

    assert run(StopStrings(decode), [3], [1, 2, 3], ("lo wor",)) == (2, "Hel")
    assert run(StopStrings(decode), [3], [1, 2, 3], ("Hello",)) == (1, "")
    assert run(StopStrings(decode), [3], [1, 2, 3], ("!!",)) is None


@pytest.mark.parametrize("piece", [b"a", b"\xc3\xa9", b"\xa9\xc3", b"\x80"])
def test_each_step_decodes_a_bounded_window(piece: bytes) -> None:
    """Per-step work does not grow with the output: 2,000 tokens of plain text, of whole
    2-byte characters, of tokens that each end inside a character, or of invalid bytes."""
    vocab = ByteVocab()
    output = [vocab.token(piece)] * 2000
    assert run(StopStrings(vocab.decode), [], output, ("zz",)) is None
    # the tokens of the last final text plus those since, each at most 16 (or 1 and 1)
    assert max(vocab.decoded_lengths) <= (32 if piece in (b"\xa9\xc3", b"\x80") else 2)
