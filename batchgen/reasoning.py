"""``output.reasoning``: the thinking of reasoning models apart from their answer.

With ``auto`` and a tokenizer that has both ``<think>`` and ``</think>`` as tokens, each sample's
output tokens are split at the first ``</think>``: the tokens before it (after an opening
``<think>``, which the model or the chat template writes) are the ``reasoning`` column, the tokens
after it the ``text``. A sample that has no ``</think>`` but is thinking (its output opens
``<think>``, or the prompt ends inside an open one) ended inside its thinking: its ``text`` is
empty and ``reasoning`` holds the unfinished thinking. A sample that never thinks has a null
``reasoning``. With stop strings (the engine cuts the text, not the tokens), the same split is
made on the cut text.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

START = "<think>"
END = "</think>"


@dataclass(frozen=True)
class ReasoningSplit:
    """Splits outputs at the tokenizer's ``</think>`` token (see the module docstring)."""

    start_id: int
    end_id: int
    decode: Callable[[list[int]], str]

    @classmethod
    def of(
        cls, mode: str, tokenizer: Any, decode: Callable[[list[int]], str]
    ) -> ReasoningSplit | None:
        """The split for ``output.reasoning`` ``mode``; None when it is off or the tokenizer
        lacks either tag."""
        if mode == "off":
            return None
        vocab = tokenizer.get_vocab()
        if START not in vocab or END not in vocab:
            return None
        return cls(vocab[START], vocab[END], decode)

    def split(
        self, prompt: Sequence[int], output: Sequence[int], text: str | None
    ) -> tuple[str, str | None]:
        """(text, reasoning) of one sample. ``text``: the engine's cut text when a stop string
        ended the sample (else None: decoded from the tokens)."""
        opened = _last(prompt, self.start_id) > _last(prompt, self.end_id)
        out = list(output)
        if out and out[0] == self.start_id:
            opened, out = True, out[1:]
        if text is not None:
            return self._split_text(text, opened)
        if self.end_id in out:
            end = out.index(self.end_id)
            thinking = out[:end]
            if self.start_id in thinking:  # text before an opening tag is not thinking
                thinking = thinking[thinking.index(self.start_id) + 1 :]
            return self.decode(out[end + 1 :]).lstrip("\n"), self.decode(thinking).strip("\n")
        if self.start_id in out:
            return "", self.decode(out[out.index(self.start_id) + 1 :]).strip("\n")
        if opened:
            return "", self.decode(out).strip("\n")
        return self.decode(out), None

    @staticmethod
    def _split_text(text: str, opened: bool) -> tuple[str, str | None]:
        if END in text:
            thinking, _, answer = text.partition(END)
            thinking = thinking.partition(START)[2] if START in thinking else thinking
            return answer.lstrip("\n"), thinking.strip("\n")
        if START in text:
            return "", text.partition(START)[2].strip("\n")
        if opened:
            return "", text.strip("\n")
        return text, None


def _last(ids: Sequence[int], token: int) -> int:
    """The last index of ``token`` in ``ids``, -1 when absent."""
    for i in range(len(ids) - 1, -1, -1):
        if ids[i] == token:
            return i
    return -1
