"""The grammar library behind one small interface: compile a constraint, track one sample's
state, fill and apply token masks.

The library is llguidance (README, "Structured outputs", says why it and not xgrammar). Nothing
outside this module imports it: the scheduler sees a sample's state only through
:class:`batchgen.engine.request.Constraint`, the engine calls :func:`apply_masks`.

A matcher's state is a function of the grammar and the tokens it consumed, nothing else: masks
depend only on the row's own tokens, so constrained samples keep every reproducibility contract.
Library errors (a grammar it rejects, a step over its work limit, a token outside the mask) are
states, not exceptions: a compile error raises :class:`GrammarError` here, a sample whose matcher
fails ends with ``finish_reason: error``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import llguidance
import llguidance.hf
import torch
from torch import Tensor

# JSON layouts (sampling.structured.json_layout). Whitespace never precedes the value nor
# follows it, and outside strings it is only allowed in the gaps between JSON tokens (after
# "{", "[", ",", around ":", before "}" and "]").
#
# auto: each gap holds at most JSON_GAP_MAX_CHARS whitespace characters. Models write JSON with
# a space after ":" and ",", or a line break and indentation (``{\n  "name": "Bob",\n  ...``);
# forcing them into another layout costs accuracy (README, "Structured outputs"). Unbounded
# whitespace is the classic runaway (a model that prefers "\n" or " " emits it until
# max_tokens); the bound lets a gap hold a line break ("\r\n" at most) and 16 columns of
# indentation (4 levels at 4 spaces, 8 at 2), and caps what a whitespace-loving model can
# waste at 18 characters per gap. llguidance matches the pattern once per gap (never repeated),
# so the bound is on the whole gap.
JSON_GAP_MAX_CHARS = 18
JSON_LAYOUTS: dict[str, dict[str, Any]] = {
    "auto": {"whitespace_pattern": rf"[\x20\x0A\x0D\x09]{{1,{JSON_GAP_MAX_CHARS}}}"},
    # compact: "," and ":" without spaces and no whitespace between tokens
    "compact": {"whitespace_flexible": False},
}


class GrammarError(ValueError):
    """A constraint the library rejects (or that exceeds the limits); ``str`` is one line."""


@dataclass(frozen=True)
class GrammarLimits:
    """Bounds on compiling and on each step's mask.

    ``max_source_bytes`` bounds the constraint's text; ``max_grammar_size`` (grammar symbols) and
    ``lexer_fuel`` (regex-compilation work, about 50k units per ms) bound the compile's size and
    time; ``step_fuel`` bounds the work of one mask (about 14k units per ms). A grammar over a
    compile limit is a :class:`GrammarError`; a step over its limit ends that sample as an error.
    """

    max_source_bytes: int = 1 << 20
    max_grammar_size: int = 500_000
    lexer_fuel: int = 5_000_000  # ~100 ms of lexer construction
    step_fuel: int = 500_000  # ~35 ms for one token's mask


class Matcher:
    """The grammar state of one sample (a :class:`~batchgen.engine.request.Constraint`)."""

    __slots__ = ("_m",)

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._m = matcher

    def fork(self) -> Matcher:
        return Matcher(self._m.deep_copy())

    def consume(self, token: int) -> None:
        self._m.consume_token(token)  # a token outside the mask puts the matcher in error

    @property
    def complete(self) -> bool:
        """Nothing may follow: the grammar reached its end (by EOS, or with no other token)."""
        return self._m.is_stopped() and not self._m.is_error()

    @property
    def accepting(self) -> bool:
        """The output so far is a complete sentence of the grammar."""
        return self._m.is_accepting() and not self._m.is_error()

    @property
    def error(self) -> str | None:
        return self._m.get_error() if self._m.is_error() else None

    def fill_mask(self, row: Tensor) -> None:
        """Write the allowed-token bitmask into ``row``: [ceil(V / 32)] int32, contiguous, CPU."""
        self._m.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)


class CompiledGrammar:
    """One compiled constraint; :meth:`start` gives a fresh sample state (a cheap copy of a
    template matcher that shares the compiled grammar)."""

    __slots__ = ("_template",)

    def __init__(self, template: llguidance.LLMatcher) -> None:
        self._template = template

    def start(self) -> Matcher:
        return Matcher(self._template.deep_copy())


class GrammarCompiler:
    """Compiles constraints for one tokenizer and vocabulary.

    ``vocab_size`` is the model's (its logits' width, which may exceed the tokenizer's);
    ``eos_token_ids`` are the tokens that end a sample, allowed only where the grammar is
    complete. ``seconds`` sums the time spent compiling.
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        limits: GrammarLimits = GrammarLimits(),
    ) -> None:
        self.vocab_size = vocab_size
        self.limits = limits
        self.seconds = 0.0
        self._hf_tokenizer = tokenizer
        self._tokenizer = llguidance.hf.from_tokenizer(
            tokenizer, n_vocab=vocab_size, eos_token=list(eos_token_ids)
        )
        self._parser_limits = llguidance.LLParserLimits(
            max_grammar_size=limits.max_grammar_size,
            initial_lexer_fuel=limits.lexer_fuel,
            step_lexer_fuel=limits.step_fuel,
            verbose_errors=False,
        )

    def json_schema(self, schema_text: str, layout: str = "auto") -> CompiledGrammar:
        """A JSON value that validates against ``schema_text`` (a JSON schema, as JSON text),
        in ``layout`` (a key of :data:`JSON_LAYOUTS`)."""
        self._check_size(schema_text)
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(
                schema_text, defaults=JSON_LAYOUTS[layout]
            )
        except ValueError as err:
            raise GrammarError(_one_line(str(err))) from None
        return self._compile(grammar)

    def regex(self, pattern: str) -> CompiledGrammar:
        """Text that the regular expression matches as a whole. ``\\d`` and ``\\w`` mean ASCII
        digits and word characters (as in JSON schema), not every Unicode digit: the library's
        Unicode tables need not be Python's."""
        self._check_size(pattern)
        try:
            lark_regex = llguidance.regex_to_lark(pattern, "dw")
        except ValueError as err:
            raise GrammarError(_one_line(str(err))) from None
        return self._compile(llguidance.LLMatcher.grammar_from_lark(f"start: /{lark_regex}/\n"))

    def choice(self, choices: Sequence[str]) -> CompiledGrammar:
        """Exactly one of ``choices``, whose first token is the first token of the choice's own
        tokenization; the tokens after it are free (any tokenization of the rest).

        The output text is the choice exactly. Without the first token pinned, a choice that
        starts with a space (" positive") could begin with a bare " " token: a greedy model
        takes it (its probability is that of a space before any word), then has to spell the
        word without its space, a tokenization it never saw (README, "Structured outputs").
        When a choice's first token does not decode to a prefix of it (a byte split inside a
        character), that choice is taken in any tokenization.
        """
        alternatives = []
        for choice in choices:
            ids = self._hf_tokenizer.encode(choice, add_special_tokens=False)
            head = self._hf_tokenizer.decode(ids[:1]) if ids else ""
            if head and choice.startswith(head) and ids[0] < self.vocab_size:
                rest = choice[len(head) :]
                tail = f" {json.dumps(rest, ensure_ascii=False)}" if rest else ""
                alternatives.append(f"<[{ids[0]}]>{tail}")
            else:
                alternatives.append(json.dumps(choice, ensure_ascii=False))
        return self.lark(f"start: {' | '.join(alternatives)}\n")

    def lark(self, grammar: str) -> CompiledGrammar:
        """A Lark-syntax grammar (llguidance's dialect) whose start rule is ``start``."""
        self._check_size(grammar)
        return self._compile(llguidance.LLMatcher.grammar_from_lark(grammar))

    def _check_size(self, text: str) -> None:
        size = len(text.encode())
        if size > self.limits.max_source_bytes:
            raise GrammarError(
                f"{size} bytes, over the limit of {self.limits.max_source_bytes} bytes"
            )

    def _compile(self, grammar: str) -> CompiledGrammar:
        start = time.perf_counter()
        try:
            template = llguidance.LLMatcher(
                self._tokenizer, grammar, log_level=0, limits=self._parser_limits
            )
        finally:
            self.seconds += time.perf_counter() - start
        if template.is_error():
            raise GrammarError(_one_line(template.get_error()))
        return CompiledGrammar(template)


def _one_line(text: str) -> str:
    return " ".join(text.split())[:400] or "rejected by the grammar library"


def apply_masks(logits: Tensor, matchers: Sequence[Matcher | None]) -> None:
    """Set the logits of tokens the rows' grammars do not allow to -inf, in place.

    logits: [S, V] float on any device; ``matchers``: one per row, None for an unconstrained
    row. The bitmasks are filled on the host ([S', ceil(V / 32)] int32 for the S' constrained
    rows), copied to the logits' device and unpacked there. A matcher in error (over its step
    limit) leaves its row unmasked: the sample ends as an error once its token is consumed.
    """
    rows = [i for i, m in enumerate(matchers) if m is not None and m.error is None]
    if not rows:
        return
    vocab = logits.shape[1]
    words = (vocab + 31) // 32
    bitmask = torch.empty(len(rows), words, dtype=torch.int32)  # [S', W]
    for j, i in enumerate(rows):
        matcher = matchers[i]
        assert matcher is not None
        matcher.fill_mask(bitmask[j])
    device = logits.device
    bits = torch.arange(32, dtype=torch.int32, device=device)  # [32]
    words_t = bitmask.to(device, non_blocking=True)
    allowed = ((words_t[:, :, None] >> bits) & 1).reshape(len(rows), words * 32)[:, :vocab]
    index = torch.tensor(rows, dtype=torch.int64).to(device)  # [S']
    masked = logits.index_select(0, index).masked_fill_(allowed == 0, float("-inf"))  # [S', V]
    logits.index_copy_(0, index, masked)
