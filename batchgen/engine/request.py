"""What the engine is asked to do (immutable) and what it hands back.

A ``Request`` is one prompt with the samples to draw from it. Several input rows with the same
prompt may be folded into one request: the prompt is computed once and forked once per sample.
Each ``SampleTarget`` names where its result goes (``row``: the runner's handle for the input row)
and carries the key of its random stream, so a sample's tokens depend only on (seed, id,
sample_index) and never on its batch neighbours.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Protocol

from batchgen.engine.stop import DecodedText


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    max_tokens: int = 256
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int = 0
    logprobs: bool = False

    @property
    def needs_history(self) -> bool:
        """Whether drawing a token reads the sample's tokens so far on the host: repetition,
        presence and frequency penalties count them (the scheduler lets such rows wait for an
        in-flight token; the sampler builds their token counts)."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


class Constraint(Protocol):
    """The grammar state of one sample (structured outputs; :mod:`batchgen.engine.grammar`).

    A function of the grammar and the tokens consumed so far, nothing else. The scheduler forks it
    with its sequence and feeds it every sampled token; the engine masks the logits with it."""

    def fork(self) -> Constraint:
        """An independent copy of this state."""
        ...

    def consume(self, token: int) -> None:
        """Advance by one sampled token (one outside the grammar puts the state in error)."""
        ...

    @property
    def complete(self) -> bool:
        """The grammar reached its end: nothing may follow."""
        ...

    @property
    def accepting(self) -> bool:
        """The tokens so far form a complete output of the grammar."""
        ...

    @property
    def error(self) -> str | None:
        """Why the state failed (a step over the library's work limit), or None."""
        ...


class ConstraintSource(Protocol):
    """A compiled grammar: where the samples of a constrained request start from."""

    def start(self) -> Constraint: ...


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id, a stop string, or a completed structured output
    LENGTH = "length"  # max_tokens or max_model_len
    ERROR = "error"


@dataclass(frozen=True)
class SampleTarget:
    row: int  # the runner's handle of the input row
    sample_index: int  # 0 .. n-1
    rng_key: int  # 64-bit key of this sample's random stream, from (seed, id, sample_index)


@dataclass(frozen=True)
class Request:
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    targets: tuple[SampleTarget, ...]  # one per sample to draw; at least one
    grammar: ConstraintSource | None = None  # the structured output every sample must follow


@dataclass
class SampleResult:
    """One finished sample, as the engine yields it."""

    target: SampleTarget
    token_ids: list[int]
    finish_reason: FinishReason
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens whose KV this sample reused instead of computing
    token_logprobs: list[float] | None = None  # set when params.logprobs
    text: str | None = None  # set by the engine when stop strings were matched (truncated text)
    error: str | None = None  # why, when finish_reason is ERROR
    constrained: bool = False  # the request had a grammar
    complete: bool = False  # constrained, and the output is a complete sentence of the grammar


@dataclass(eq=False)
class TokenSequence:
    """The scheduler's mutable state of one token stream.

    Before its prompt is computed, one sequence stands for several targets of its request; when
    the prompt's last chunk is computed it forks into one sequence per target, which share every
    block (refcounts) until they write into a shared block (copy-on-write). Invariants:
    ``len(block_table) * block_size >= num_computed``; the first ``num_computed`` tokens' KV is in
    ``block_table``; ``cache_handle`` is the radix node this sequence holds a lock on.

    A request with more targets than free sequence slots is split: the admitted part takes the
    targets that fit and names the waiting rest (``rest``; the rest ``waits_for`` it); when the
    part's prompt is computed, the rest is *parked*: it waits holding the KV of all prompt tokens
    but the last (``num_computed == num_prompt_tokens - 1``), which it computes once admitted.

    Overlapped steps (``engine.overlap``): a token sampled on the device but not yet read back is
    *in flight*; ``token_ids`` holds the known tokens only and ``num_in_flight`` counts the rest
    (``num_tokens`` is both). While a token is in flight every known token has been computed
    (``num_computed == len(token_ids)``); the next step may compute the in-flight token, its input
    id filled on the device from the step that sampled it.
    """

    request: Request
    targets: tuple[SampleTarget, ...]
    token_ids: list[int]
    num_prompt_tokens: int
    cache_handle: object  # radix-cache handle this sequence has locked (the root when none)
    num_computed: int = 0
    block_table: list[int] = field(default_factory=list)
    num_cached_tokens: int | None = None  # fixed at first admission; see SampleResult
    num_blocks_in_cache: int = 0  # leading blocks already inserted into the radix cache
    token_logprobs: list[float] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    rest: TokenSequence | None = None  # the waiting rest of this sequence's targets, to be parked
    waits_for: TokenSequence | None = None  # the admitted part whose prompt this sequence waits for
    decoded: DecodedText = field(default_factory=DecodedText)  # read only for stop strings
    text: str | None = None  # the output text cut before a matched stop string
    # The grammar state after the tokens so far (the request has a grammar); forked with the
    # sequence, kept through preemption (the tokens it consumed are kept too).
    constraint: Constraint | None = None
    # Tokens sampled on the device, not yet known to the host (0, or 1 between steps; 2 briefly
    # while a step has been launched and the one before it not yet completed).
    num_in_flight: int = 0

    @property
    def num_tokens(self) -> int:
        """Known and in-flight tokens: the length of the sequence on the device."""
        return len(self.token_ids) + self.num_in_flight

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def forked(self) -> bool:
        return len(self.targets) == 1
