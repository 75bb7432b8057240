"""``executor.kind: local``: one engine in this process.

:class:`RowGenerator` is one engine on one model, fed encoded rows and handing back finished input
rows; the local executor runs one here, each Ray worker one of its own.

Rows are fed in lexicographic order of their token ids, a depth-first walk of the window's prompt
trie: rows that share a prefix run one after another while the prefix is in the radix cache, and
identical prompts become one request whose samples are forked from a single prefill. Results are
keyed by id, so the order is invisible to users.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from batchgen.dataset import InputRow
from batchgen.engine.backends import Switches
from batchgen.engine.engine import Engine
from batchgen.engine.noise import rng_key
from batchgen.engine.profile import StepProfile
from batchgen.engine.request import (
    FinishReason,
    Request,
    SampleResult,
    SampleTarget,
    SamplingParams,
)
from batchgen.fingerprint import numerics
from batchgen.host_memory import keep_freed_memory
from batchgen.job import Job
from batchgen.model.config import ModelInfo
from batchgen.model.loader import load_model
from batchgen.plan import (
    Placement,
    engine_settings,
    max_model_len,
    plan_backends,
    plan_num_blocks,
    sampling_params,
)
from batchgen.prompts import EncodedRow, output_columns, row_params
from batchgen.reasoning import ReasoningSplit
from batchgen.schema import (
    RowGroup,
    error_rows,
    prompt_logprob_entries,
    sample_row,
    score_row,
)
from batchgen.structured import CompiledGrammar, RowSchemaError, StructuredOutputs


@dataclass
class PendingRow:
    """An input row whose samples are being generated (``None``: not finished yet)."""

    row: InputRow
    num_prompt_tokens: int
    samples: list[SampleResult | None]
    params: SamplingParams  # the row's (the job's, with the row's overrides)
    prompt: tuple[int, ...] = field(default=(), repr=False)  # its tokens


class RowGenerator:
    """One engine on one model: encoded rows in, finished input rows out (all n output rows of a
    row at once, as :data:`RowGroup`). The local executor runs one in the job's process; each
    Ray worker runs one of its own.

    Usage: :meth:`feed` rows (rows that cannot run come back at once as error groups), then
    :meth:`step` while :meth:`has_work`; each step returns the rows that finished in it.
    """

    def __init__(
        self,
        job: Job,
        info: ModelInfo,
        place: Placement,
        tokenizer: Any,
        structured: StructuredOutputs | None = None,
    ) -> None:
        """``structured``: the job's compiled constraints (the runner's, whose cache also served
        the row encoder); a Ray worker compiles its own."""
        self.job = job
        self.info = info
        self.place = place
        self.tokenizer = tokenizer
        self.params = sampling_params(job)
        self.structured = (
            structured if structured is not None else StructuredOutputs(job, info, tokenizer)
        )
        self.columns = output_columns(job, tokenizer)
        self.reasoning = ReasoningSplit.of(job.output.reasoning, tokenizer, self._decode)
        self.score = job.task == "score"
        self.pending: dict[int, PendingRow] = {}
        self.next_handle = 0
        self.backends = plan_backends(place)
        if place.device.type == "cpu":
            keep_freed_memory()  # step activations reuse mapped pages instead of faulting anew
        model, _ = load_model(
            job.model,
            place.device,
            place.dtype,
            self.backends.attention,
            layers=self.backends.layers,
        )
        num_blocks = plan_num_blocks(job, info, place, model=model)
        self.max_model_len = max_model_len(job, info, num_blocks)
        self.engine = Engine(
            model,
            info,
            engine_settings(job, place, num_blocks, self.max_model_len),
            device=place.device,
            dtype=place.dtype,
            kv_dtype=place.kv_cache_dtype,
            detokenize=self._decode if self.params.stop or _stop_per_row(job) else None,
            backends=self.backends,
            profile=Switches.from_environment().profile,
        )

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def has_work(self) -> bool:
        return self.engine.has_work()

    @property
    def num_waiting_targets(self) -> int:
        return self.engine.num_waiting_targets

    def _too_long(self, num_tokens: int) -> str:
        # When the KV cache, not the model or engine.max_model_len, sets the limit, say so.
        eng = self.job.engine
        limits = [self.info.max_model_len, eng.max_model_len or self.info.max_model_len]
        knob = "kv_cache_blocks" if eng.kv_cache_blocks is not None else "kv_cache_memory"
        cause = (
            f" (all the KV cache holds; raise engine.{knob})"
            if self.max_model_len < min(limits)
            else ""
        )
        return (
            f"prompt has {num_tokens} tokens; max_model_len is {self.max_model_len}{cause}, "
            "which leaves no room for output"
        )

    def feed(self, encoded: Sequence[EncodedRow]) -> list[RowGroup]:
        """Queue rows: the rest become requests in depth-first trie order, identical prompts
        (with the same constraint and the same sampling parameters) folded into one request.
        Returns the error groups of rows that cannot run."""
        if self.score:
            return self._feed_scores(encoded)
        errors: list[RowGroup] = []
        groups: dict[tuple[tuple[int, ...], str, SamplingParams], list[SampleTarget]] = {}
        grammars: dict[str, CompiledGrammar | None] = {}
        for item in encoded:
            row, tokens = item.row, item.tokens
            handle = self.next_handle
            self.next_handle += 1
            if tokens is None:
                errors.append(self._error_rows(row, item.problem or "unknown error"))
                continue
            if len(tokens) >= self.max_model_len:
                errors.append(self._error_rows(row, self._too_long(len(tokens))))
                continue
            key = item.schema or ""  # "": the job-level constraint (or none)
            if key not in grammars:
                try:
                    grammars[key] = self.structured.grammar_for(item.schema)
                except RowSchemaError as err:  # a worker's own compile of the row's schema
                    errors.append(self._error_rows(row, str(err)))
                    continue
            params = row_params(self.params, row)
            keep_prompt = params.prompt_logprobs is not None or self.reasoning is not None
            prompt = tuple(tokens) if keep_prompt else ()
            self.pending[handle] = PendingRow(row, len(tokens), [None] * params.n, params, prompt)
            targets = groups.setdefault((tuple(tokens), key, params), [])
            for k in range(params.n):
                targets.append(SampleTarget(handle, k, rng_key(params.seed, row.id, k)))
        # Trie order of the prompts; the parameters' text only orders equal prompts.
        for tokens, key, params in sorted(groups, key=lambda g: (g[0], g[1], repr(g[2]))):
            targets = tuple(groups[tokens, key, params])
            scored = params.prompt_logprobs is not None
            self.engine.add(
                Request(
                    tokens,
                    params,
                    targets,
                    grammar=grammars[key],
                    logprobs_from=1 if scored else None,
                    prompt_top_k=params.prompt_logprobs or 0,
                )
            )
        return errors

    def _feed_scores(self, encoded: Sequence[EncodedRow]) -> list[RowGroup]:
        """Score rows: one score-only request per continuation (its sample_index is the
        continuation's index), in trie order over the window, so the continuations of a context
        run while it is in the radix cache and each context is computed once."""
        errors: list[RowGroup] = []
        requests: list[tuple[tuple[int, ...], int, int, int]] = []
        for item in encoded:
            row, tokens, choices = item.row, item.tokens, item.choices
            handle = self.next_handle
            self.next_handle += 1
            if tokens is None or choices is None:
                errors.append(self._error_rows(row, item.problem or "unknown error"))
                continue
            longest = max(len(c) for c in choices)
            if longest > self.max_model_len:
                errors.append(
                    self._error_rows(
                        row,
                        f"prompt and continuation have {longest} tokens; max_model_len is "
                        f"{self.max_model_len}",
                    )
                )
                continue
            self.pending[handle] = PendingRow(row, len(tokens), [None] * len(choices), self.params)
            requests += [(c, len(tokens), handle, i) for i, c in enumerate(choices)]
        for whole, start, handle, i in sorted(requests):
            target = SampleTarget(handle, i, 0)
            self.engine.add(
                Request(whole, self.params, (target,), logprobs_from=start, score_only=True)
            )
        return errors

    def step(self) -> list[RowGroup]:
        """One engine step; the input rows whose every sample has finished."""
        done: list[RowGroup] = []
        for res in self.engine.step():
            pending = self.pending[res.target.row]
            pending.samples[res.target.sample_index] = res
            if all(s is not None for s in pending.samples):
                del self.pending[res.target.row]
                done.append(self._group(pending))
        return done

    def _text(self, res: SampleResult, params: SamplingParams) -> str:
        if res.text is not None:
            return res.text
        ids = res.token_ids
        if res.finish_reason == FinishReason.STOP and ids and ids[-1] in params.stop_token_ids:
            ids = ids[:-1]
        return self._decode(ids)

    def _error_rows(self, row: InputRow, problem: str) -> RowGroup:
        n = row.num_samples(self.params.n)
        return error_rows(row.id, row.keep, problem, n, self.columns)

    def _scored(self, pending: PendingRow) -> RowGroup:
        """The output row of a score row whose every continuation was scored."""
        results = [res for res in pending.samples if res is not None]
        lps = [[lp for lp, _ in res.prompt_logprobs or []] for res in results]
        return score_row(
            pending.row.id,
            pending.row.keep,
            choice_logprobs=[math.fsum(x) for x in lps],
            choice_num_tokens=[len(x) for x in lps],
            num_prompt_tokens=sum(res.num_prompt_tokens for res in results),
            num_cached_tokens=sum(res.num_cached_tokens for res in results),
        )

    def _text_and_reasoning(
        self, res: SampleResult, params: SamplingParams, prompt: tuple[int, ...]
    ) -> tuple[str, str | None]:
        if self.reasoning is None:
            return self._text(res, params), None
        ids = res.token_ids
        if res.finish_reason == FinishReason.STOP and ids and ids[-1] in params.stop_token_ids:
            ids = ids[:-1]
        return self.reasoning.split(prompt, ids, res.text)

    def _group(self, pending: PendingRow) -> RowGroup:
        if self.score:
            return self._scored(pending)
        rows = []
        for res in pending.samples:
            assert res is not None
            text, reasoning = self._text_and_reasoning(res, pending.params, pending.prompt)
            prompt_lps = None
            if res.prompt_logprobs is not None:
                prompt_lps = prompt_logprob_entries(pending.prompt, res.prompt_logprobs)
            rows.append(
                sample_row(
                    pending.row.id,
                    res.target.sample_index,
                    pending.row.keep,
                    text=text,
                    token_ids=res.token_ids,
                    finish_reason=res.finish_reason.value,
                    num_prompt_tokens=res.num_prompt_tokens,
                    num_cached_tokens=res.num_cached_tokens,
                    token_logprobs=res.token_logprobs,
                    logprobs=self.columns,
                    error=res.error,
                    top_logprobs=res.top_logprobs,
                    prompt_logprobs=prompt_lps,
                    reasoning=reasoning,
                )
            )
        return rows

    def report(self) -> dict[str, Any]:
        """The engine's figures for ``.batchgen/report.json``."""
        stats = self.engine.stats
        scheduler = self.engine.scheduler
        structured = None
        if self.structured.enabled:
            structured = {
                "constrained_samples": stats.constrained_samples,
                "complete_samples": stats.complete_samples,
                "compile_s": round(self.structured.seconds, 4),
                "mask_s": round(stats.mask_seconds, 4),
            }
        return {
            "structured": structured,
            "preemptions": scheduler.num_preemptions,
            "kv_blocks": self.engine.config.num_blocks,
            "kv_block_size": self.engine.config.block_size,
            "peak_kv_blocks_used": scheduler.peak_blocks_used,
            "peak_num_seqs": scheduler.peak_num_seqs,
            "evicted_kv_blocks": scheduler.num_evicted_blocks,
            "kv_waste": round(stats.waste, 4),
            "engine_steps": stats.steps,
            # engine.overlap: steps launched before the previous step's tokens were read back,
            # and tokens drawn after a token that ended its sample (computed for nothing)
            "overlapped_steps": stats.overlapped_steps,
            "discarded_tokens": stats.discarded_tokens,
            "device": str(self.place.device),
            "dtype": self.place.dtype_name,
            "dtype_reason": self.place.dtype_reason,
            "kv_cache_dtype": self.place.kv_dtype_name,
            "kv_bytes_per_token": self.info.kv_bytes_per_token(self.place.kv_cache_dtype),
            "attention_backend": self.place.backend,
            # the C kernels of batchgen.model.cpu_kernels ran (CPU, fp32/bf16, a compiler was found)
            "cpu_kernels": self.backends.layers.cpu is not None,
        } | self._profile()

    def _profile(self) -> dict[str, Any]:
        """``{"profile": ...}``: seconds per phase of the engine's steps, with BATCHGEN_PROFILE=1
        (:mod:`batchgen.engine.profile`); nothing without."""
        profile = self.engine.profile
        if not isinstance(profile, StepProfile):
            return {}
        return {"profile": profile.summary()}


def _stop_per_row(job: Job) -> bool:
    """Whether a row may bring stop strings of its own."""
    return "stop" in job.input.sampling_columns or job.input.format == "openai_batch"


class LocalExecutor:
    """The :class:`~batchgen.executors.Executor` of ``executor.kind: local``."""

    def __init__(
        self,
        job: Job,
        info: ModelInfo,
        place: Placement,
        tokenizer: Any,
        structured: StructuredOutputs | None = None,
    ) -> None:
        self.generator = RowGenerator(job, info, place, tokenizer, structured)
        self.window_rows = job.input.window_rows
        # Keep enough queued for full batches; read the next window only when the queue runs low.
        self._low_water = 2 * job.engine.max_num_seqs
        self._ready: list[RowGroup] = []  # error rows of submitted rows, handed back by poll

    def wants_work(self) -> bool:
        return self.generator.num_waiting_targets < self._low_water

    def submit(self, rows: Sequence[EncodedRow]) -> None:
        self._ready += self.generator.feed(rows)

    def has_work(self) -> bool:
        return bool(self._ready) or self.generator.has_work()

    def poll(self) -> list[RowGroup]:
        done, self._ready = self._ready, []
        if self.generator.has_work():
            done += self.generator.step()
        return done

    def numerics(self) -> str:
        place = self.generator.place
        return numerics(place.dtype_name, place.kv_dtype_name)

    def sampled_tokens(self) -> int:
        return self.generator.engine.stats.sampled_tokens

    def report(self) -> dict[str, Any]:
        return self.generator.report()

    def close(self) -> None:
        pass
