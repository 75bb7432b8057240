"""The engine loop: schedule -> run the model -> sample -> update -> finished samples.

Overlapped steps (``EngineSettings.overlap``). Reading a step's sampled tokens back waits for the
device; without overlap the device then idles while the host updates, schedules and builds the
next step. With overlap each ``step()`` launches step N+1 *before* reading step N's tokens: the
scheduler records step N as launched (its tokens in flight), schedules step N+1, whose decode
rows of in-flight tokens get their input ids on the device from step N's sampled-token tensor
(``StepTensors.fill_pending``); only then are step N's tokens read back (pinned, double-buffered
on CUDA: ``staging.Readback``) and the scheduler completes step N. The outputs are the same;
see ``scheduler`` for what in-flight tokens change (rows that wait, discarded tokens).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from batchgen.engine.backends import Backends, choose_backends
from batchgen.engine.batch import build_step
from batchgen.engine.block_pool import BlockPool
from batchgen.engine.cuda_graphs import DecodeGraphs
from batchgen.engine.device import device_guard
from batchgen.engine.grammar import apply_masks
from batchgen.engine.logprobs import token_logprobs
from batchgen.engine.profile import NO_PROFILE, NoProfile, StepProfile, instrument
from batchgen.engine.radix_cache import make_prefix_cache
from batchgen.engine.request import Request, SampleResult, TokenSequence
from batchgen.engine.sampler import SamplingBatch, sample
from batchgen.engine.scheduler import Batch, Draw, Scheduler, SchedulerConfig
from batchgen.engine.staging import PendingReadback, Readback, Staging
from batchgen.engine.stop import StopStrings
from batchgen.model.config import ModelInfo


@dataclass(frozen=True)
class EngineSettings:
    block_size: int
    num_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    prefix_caching: bool = True
    attention_backend: str = "torch"  # "torch" | "triton" (the kernels are Backends')
    cuda_graphs: bool = False  # decode-only steps from CUDA graphs (needs CUDA and triton)
    overlap: bool = False  # launch each step before reading the previous one's tokens back


@dataclass
class EngineStats:
    steps: int = 0
    computed_tokens: int = 0  # tokens run through the model (prefill, recompute and decode)
    sampled_tokens: int = 0  # tokens drawn (what a progress bar's tokens/s counts)
    allocated_slots: int = 0  # summed over steps: KV slots in blocks in use
    unused_slots: int = 0  # summed over steps: allocated slots that hold no token yet
    mask_seconds: float = 0.0  # filling and applying structured-output masks
    constrained_samples: int = 0  # finished samples that followed a grammar
    complete_samples: int = 0  # of those, the ones whose output is complete for the grammar
    overlapped_steps: int = 0  # steps launched before the previous step's tokens were read
    discarded_tokens: int = 0  # drawn after a token that turned out to finish its sample

    @property
    def waste(self) -> float:
        """Internal fragmentation of the paged pool, averaged over steps."""
        return self.unused_slots / self.allocated_slots if self.allocated_slots else 0.0


@dataclass
class _Launched:
    """A step queued on the device whose sampled tokens the host has not read yet."""

    batch: Batch  # scheduler.launched() has run: batch.sampled names each row's sequence
    tokens: torch.Tensor | None  # [S] int64 on the device (None: nothing sampled)
    readback: PendingReadback | None
    rows: dict[int, int] = field(default_factory=dict)  # id(seq) -> row of tokens (in flight)
    # the top-K alternatives of each sampled row (ids [S, K], logprobs [S, K]); None: not asked
    top: tuple[torch.Tensor, torch.Tensor] | None = None


class Engine:
    """Runs requests to completion on one model. Usage: ``add()`` requests, then call ``step()``
    while ``has_work()``; each step returns the samples that finished in it."""

    def __init__(
        self,
        model: torch.nn.Module,
        info: ModelInfo,
        config: EngineSettings,
        *,
        device: torch.device,
        dtype: torch.dtype,
        kv_dtype: torch.dtype | None = None,
        detokenize: Callable[[list[int]], str] | None = None,
        backends: Backends | None = None,
        check_invariants: bool = False,
        profile: bool = False,
    ) -> None:
        """``dtype`` is the model's compute dtype, ``kv_dtype`` the KV cache's (None: dtype;
        int8 or float8_e4m3fn: a quantized cache with one fp32 scale per token and KV head, in
        ``kv_scales``). ``detokenize`` is needed only for stop strings; ``backends``: the kernels
        the model was built with, whose block copy and sampler kernels the engine runs (default:
        :func:`~batchgen.engine.backends.choose_backends`' choice here); ``check_invariants`` runs the block accounting checks after every schedule and
        update (tests); ``profile`` times each step's phases into ``self.profile``
        (:mod:`batchgen.engine.profile`)."""
        self.model = model
        self.config = config
        self.device = device
        self.vocab_size = info.vocab_size
        self.check_invariants = check_invariants
        if backends is None:
            backends = choose_backends(device, dtype, config.attention_backend)
        self.sampler_kernels = backends.sampler
        self.profile: StepProfile | NoProfile = NO_PROFILE
        if profile:
            sync = torch.cuda.synchronize if device.type == "cuda" else None
            self.profile = StepProfile(sync)
            instrument(model, backends.attention, self.profile)
        self.copy_blocks = backends.copy_blocks
        # [layers, K/V, blocks, block_size, kv_heads, head_dim]. Zeros, not empty: padded reads of
        # the torch path must see finite values.
        kv_dtype = dtype if kv_dtype is None else kv_dtype
        shape = (info.num_layers, 2, config.num_blocks, config.block_size, info.num_kv_heads)
        self.kv_cache = torch.zeros(*shape, info.head_dim, dtype=kv_dtype, device=device)
        # A quantized cache's fp32 scales [layers, K/V, blocks, block_size, kv_heads] (slot
        # value = kv_cache * kv_scales); None for a float cache.
        self.kv_scales: torch.Tensor | None = None
        if kv_dtype in (torch.int8, torch.float8_e4m3fn):
            self.kv_scales = torch.zeros(*shape, dtype=torch.float32, device=device)
        self.pool = BlockPool(config.num_blocks)
        cache = make_prefix_cache(self.pool, config.block_size, config.prefix_caching)
        self.scheduler = Scheduler(
            SchedulerConfig(
                block_size=config.block_size,
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=config.max_model_len,
                watermark_blocks=max(1, config.num_blocks // 100),
            ),
            self.pool,
            cache,
            info.eos_token_ids,
            StopStrings(detokenize) if detokenize is not None else None,
        )
        self.stats = EngineStats()
        self.num_heads = info.num_heads
        self.dtype = dtype  # of activations and queries (the cache's may differ: kv_dtype)
        self.staging = Staging(device)
        self.readback = Readback(device)
        self._in_flight: _Launched | None = None  # the launched step not yet completed
        if config.attention_backend == "triton" and device.type == "cuda":
            self.warm_up()
        self.graphs: DecodeGraphs | None = None
        if config.cuda_graphs:
            if device.type != "cuda" or config.attention_backend != "triton":
                raise ValueError("cuda_graphs needs a CUDA device and the triton backend")
            self.graphs = DecodeGraphs(
                model,
                self.kv_cache,
                kv_scales=self.kv_scales,
                block_size=config.block_size,
                max_num_seqs=config.max_num_seqs,
                max_model_len=config.max_model_len,
                device=device,
            )
            with device_guard(device):
                self.graphs.capture_all()

    def warm_up(self) -> int:
        """Compile every attention variant a run can launch now, not mid-run (Triton backend;
        the engine calls it on CUDA). Returns the number of warm-up launches."""
        from batchgen.kernels.warmup import warm_up_attention

        with device_guard(self.device), torch.inference_mode():
            scales = (None, None) if self.kv_scales is None else tuple(self.kv_scales[0])
            return warm_up_attention(
                self.kv_cache[0, 0], self.kv_cache[0, 1], self.num_heads, self.dtype, *scales
            )

    def add(self, request: Request) -> None:
        self.scheduler.add(request)

    def has_work(self) -> bool:
        return self._in_flight is not None or self.scheduler.has_work()

    @property
    def num_waiting_targets(self) -> int:
        return self.scheduler.num_waiting_targets

    @torch.inference_mode()
    def step(self) -> list[SampleResult]:
        """Schedule, run and sample one step on the engine's device (made current for Triton);
        return the samples that finished.

        Plain: launch this step, then complete it (read its tokens back). Overlapped
        (``EngineSettings.overlap``): launch this step, then complete the step before it, whose
        tokens were in flight while this one was scheduled and built; this one stays in flight.
        """
        with device_guard(self.device):
            prev, self._in_flight = self._in_flight, None
            start = time.perf_counter()
            batch = self.scheduler.schedule()
            if self.profile.enabled and batch:
                prefill = any(chunk.num_tokens != 1 for chunk in batch.chunks)
                self.profile.begin_step("prefill" if prefill else "decode")
                self.profile.add("schedule", time.perf_counter() - start)
            if not batch:
                # Everything schedulable waits for an in-flight token (or for blocks it holds).
                assert prev is not None, "scheduler produced an empty batch while work remains"
                results = self._complete(prev)
            elif not self.config.overlap:
                results = self._complete(self._launch(batch, prev))
            else:
                launched = self._launch(batch, prev)
                results = self._complete(prev) if prev is not None else []
                self._in_flight = launched
            if self.check_invariants:
                self.scheduler.check()
            return results

    def _launch(self, batch: Batch, prev: _Launched | None) -> _Launched:
        """Queue ``batch``'s block copies, forward pass and draw, and tell the scheduler it is
        launched; ``prev``: the step before it when its tokens are still in flight (the fill
        source of this step's decodes)."""
        if self.check_invariants:
            self.scheduler.check(batch)
        launched = self._run(batch, prev)
        self.scheduler.launched(batch)
        launched.rows = {id(seq): row for row, seq in enumerate(batch.sampled)}
        if prev is not None:
            self.stats.overlapped_steps += 1
        return launched

    def _run(self, batch: Batch, prev: _Launched | None) -> _Launched:
        """The device work of ``_launch``: block copies, the forward pass and the draw."""
        profile = self.profile
        with profile.span("build"):
            if batch.copies:
                src, dst = zip(*batch.copies, strict=True)
                src_t, dst_t = self.staging.upload(torch.int64, [src, dst])
                self.copy_blocks(self.kv_cache, src_t, dst_t)
                if self.kv_scales is not None:  # a copied block keeps its tokens' scales
                    self.copy_blocks(self.kv_scales, src_t, dst_t)
            rows = prev.rows if prev is not None else None
            step = build_step(batch, self.config.block_size, self.device, self.staging, rows)
            if step.fill_rows is not None:
                assert prev is not None and prev.tokens is not None
                step.fill_pending(prev.tokens)
        with profile.span("forward"):
            sample_rows = step.logits_indices  # rows of ``hidden`` that sample
            if self.graphs is not None and self.graphs.supports(step):
                assert step.keep is None  # a step of decodes alone wants every row
                hidden = self.graphs.run(step)
            else:
                # the quantized cache's scales go with it (models of float caches never see them)
                scales = {} if self.kv_scales is None else {"kv_scales": self.kv_scales}
                hidden = self.model(
                    step.input_ids, step.positions, self.kv_cache, step.meta, **scales,
                    keep=step.keep,
                )  # fmt: skip
                if step.keep is not None:
                    assert step.kept_indices is not None
                    sample_rows = step.kept_indices
        self._account(batch)
        with profile.span("prompt_logprobs"):
            self._prompt_logprobs(batch, step.first_rows, hidden)
        if not len(step.logits_indices):
            return _Launched(batch, None, None)
        with profile.span("lm_head"):
            logits = self.model.compute_logits(hidden[sample_rows])
        with profile.span("sample"):
            tokens, logprobs, top = self._sample(batch, logits)
            readback = self.readback.start(tokens, logprobs)
        return _Launched(batch, tokens, readback, top=top)

    def _prompt_logprobs(
        self, batch: Batch, first_rows: tuple[int, ...], hidden: torch.Tensor
    ) -> None:
        """Fill the scored prompt tokens' logprobs of ``batch``'s chunks (requests with
        ``logprobs_from``): the LM head runs on the hidden states before those tokens only, in
        chunks of positions (:mod:`batchgen.engine.logprobs`). Waits for the device."""
        rows: list[int] = []
        targets: list[int] = []
        slots: list[tuple[list, int, int]] = []  # (sequence's list, index, top K)
        for chunk, first in zip(batch.chunks, first_rows, strict=True):
            seq = chunk.seq
            scored = seq.prompt_logprobs
            if scored is None:
                continue
            start = seq.request.logprobs_from
            assert start is not None
            # position p's hidden state gives the logprob of token p + 1
            lo = max(chunk.start, start - 1)
            hi = min(chunk.start + chunk.num_tokens, seq.num_prompt_tokens - 1)
            for p in range(lo, hi):
                rows.append(first + p - chunk.start)
                targets.append(seq.token_ids[p + 1])
                slots.append((scored, p + 1 - start, seq.request.prompt_top_k))
        if not rows:
            return
        index = torch.tensor(rows, dtype=torch.int64, device=hidden.device)
        target_t = torch.tensor(targets, dtype=torch.int64, device=hidden.device)
        top_k = max(k for _, _, k in slots)
        lps, tops = token_logprobs(
            self.model.compute_logits, hidden[index], target_t, self.vocab_size, top_k
        )
        for (scored, i, k), lp, top in zip(slots, lps, tops, strict=True):
            scored[i] = (lp, top[:k])

    def _complete(self, launched: _Launched) -> list[SampleResult]:
        """Read ``launched``'s tokens back and let the scheduler record them; the samples that
        finished."""
        with self.profile.span("complete"):
            return self._complete_step(launched)

    def _complete_step(self, launched: _Launched) -> list[SampleResult]:
        draws: list[Draw] = []
        if launched.readback is not None:
            tokens, logprobs = launched.readback.result()
            # Draw.logprob is read only for samples that asked for logprobs
            lps = logprobs if logprobs is not None else [0.0] * len(tokens)
            tops: list = [None] * len(tokens)
            if launched.top is not None:
                ids, values = (t.tolist() for t in launched.top)
                tops = [list(zip(i, v, strict=True)) for i, v in zip(ids, values, strict=True)]
            draws = [Draw(t, lp, top) for t, lp, top in zip(tokens, lps, tops, strict=True)]
        discarded = self.scheduler.num_discarded_tokens
        finished = self.scheduler.complete(launched.batch, draws)
        discarded = self.scheduler.num_discarded_tokens - discarded
        self.stats.discarded_tokens += discarded
        self.stats.sampled_tokens += len(draws) - discarded
        results = [self._result(seq) for seq in finished]
        for res in results:
            self.stats.constrained_samples += res.constrained
            self.stats.complete_samples += res.complete
        return results

    def _sample(
        self, batch: Batch, logits: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None, tuple[torch.Tensor, torch.Tensor] | None]:
        """Draw the step's tokens on the device: [S] int64 and their logprobs ([S] float32, or
        None when no sample asks for them), rows in the order of ``batch.chunks``' targets, and
        the top-K alternatives (ids, logprobs [S, K]; K the largest a sample asks for) or
        None."""
        params, keys, positions, seqs = [], [], [], []
        for chunk in batch.chunks:
            if not chunk.samples:
                continue
            seq = chunk.seq
            for target in seq.targets:
                params.append(seq.params)
                keys.append(target.rng_key)
                positions.append(seq.num_tokens)  # the drawn token's index (after in-flight ones)
                seqs.append(seq)
        # Rows with penalties or a grammar never have a token in flight (Scheduler: they wait
        # for it), so their history and grammar state are complete here.
        needs_history = any(p.needs_history for p in params)
        prompt_ids = [s.token_ids[: s.num_prompt_tokens] for s in seqs] if needs_history else None
        output_ids = [s.output_ids for s in seqs] if needs_history else None
        rows = SamplingBatch.from_rows(
            params, keys, positions, prompt_ids, output_ids, self.vocab_size, logits.device,
            staging=self.staging,
        )  # fmt: skip
        if any(s.constraint is not None for s in seqs):
            # Before forking, a sequence's targets share its grammar state (no token yet).
            start = time.perf_counter()
            logits = logits.float()
            apply_masks(logits, [s.constraint for s in seqs])
            self.stats.mask_seconds += time.perf_counter() - start
        want_logprobs = any(p.logprobs for p in params)
        top_k = max((p.top_logprobs for p in params if p.logprobs), default=0)
        out = sample(
            logits, rows, logprobs=want_logprobs, kernels=self.sampler_kernels, top_logprobs=top_k
        )
        top = None
        if out.top_ids is not None and out.top_logprobs is not None:
            top = (out.top_ids, out.top_logprobs)
        return out.tokens, out.logprobs, top

    def _account(self, batch: Batch) -> None:
        bs = self.config.block_size
        self.stats.steps += 1
        self.stats.computed_tokens += batch.num_tokens
        self.stats.allocated_slots += self.pool.num_used * bs
        for chunk in batch.chunks:
            seq = chunk.seq
            self.stats.unused_slots += len(seq.block_table) * bs - (chunk.start + chunk.num_tokens)

    @staticmethod
    def _result(seq: TokenSequence) -> SampleResult:
        assert seq.forked and seq.finish_reason is not None
        return SampleResult(
            target=seq.targets[0],
            token_ids=seq.output_ids,
            finish_reason=seq.finish_reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens or 0,
            token_logprobs=list(seq.token_logprobs) if seq.params.logprobs else None,
            top_logprobs=(
                list(seq.top_logprobs) if seq.params.logprobs and seq.params.top_logprobs else None
            ),
            prompt_logprobs=(
                list(seq.prompt_logprobs)  # type: ignore[arg-type]
                if seq.prompt_logprobs is not None
                else None
            ),
            text=seq.text,
            error=seq.constraint.error if seq.constraint is not None else None,
            constrained=seq.constraint is not None,
            complete=seq.constraint is not None and seq.constraint.accepting,
        )
