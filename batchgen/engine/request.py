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
    def greedy(self) -> bool:
        return self.temperature == 0.0


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
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
    extra: dict = field(default_factory=dict)
