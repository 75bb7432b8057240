"""Continuous batching: which tokens of which sequences the next forward pass computes.

Each step fills a token budget: running sequences first (decodes and unfinished prefill chunks,
oldest first), then new sequences from the waiting queue (FIFO, each starting after its longest
cached prefix). When KV blocks run out, unlocked radix-cache leaves are evicted first, then the
newest running sequences are preempted: their blocks are released and they are recomputed later
(mostly from the prefix cache). A request with several targets is computed once and forked into
one sequence per target when its prompt is done; no step samples more than ``max_num_seqs``
sequences: a request with more targets than free slots is split, and the later parts reuse the
prompt's KV (see ``TokenSequence``). No torch here: the scheduler is plain data.

Overlapped steps (``engine.overlap``). A step is recorded in two halves: ``launched`` once its
forward pass and draw are queued on the device (the KV of its chunks counts as computed, its
sampled tokens are *in flight*, forks and parking happen), ``complete`` once its tokens are read
back (tokens appended, finish reasons). Between the two the engine may schedule and launch the
next step: a sequence whose token is in flight computes it (its input id filled on the device)
and samples the one after. If the in-flight token finishes the sequence (EOS, a stop string), the
token drawn after it is discarded (``num_discarded_tokens``). A sequence the in-flight token
finishes for sure (max_tokens, max_model_len) is retired at ``launched``: not scheduled again,
its blocks freed as they would be without overlap. A step that does not overlap calls the two
halves one after the other.

One noun in one file: admission, the token budget, forks, parking and
preemption share the block accounting that ``check`` asserts, and split apart they would each
have to re-derive it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from batchgen.engine.block_pool import BlockPool
from batchgen.engine.radix_cache import PrefixCache
from batchgen.engine.request import (
    FinishReason,
    Request,
    SampleTarget,
    TokenSequence,
)
from batchgen.engine.stop import StopStrings


@dataclass(frozen=True)
class SchedulerConfig:
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    # Admission keeps this many blocks free for the running sequences to grow into, so that a
    # burst of admissions is not immediately followed by preemptions.
    watermark_blocks: int = 0


@dataclass(frozen=True)
class Chunk:
    """Tokens ``start .. start + num_tokens`` of ``seq`` are computed this step (all known, but a
    decode's one token may be in flight: ``start == len(seq.token_ids)``)."""

    seq: TokenSequence
    start: int
    num_tokens: int
    # Whether this chunk reaches the end of the sequence (known and in-flight tokens) when it is
    # made, so its last token's logits are sampled (once per target of the sequence). Fixed
    # then: the sequence grows once the step is launched.
    samples: bool = field(init=False)

    def __post_init__(self) -> None:
        end = self.start + self.num_tokens
        object.__setattr__(self, "samples", end == self.seq.num_tokens)


@dataclass
class Batch:
    chunks: list[Chunk] = field(default_factory=list)
    # (src, dst) block copies to perform before the forward pass (copy-on-write, and the head of
    # a cached block that a new sequence's prompt shares in part), in any order: destinations
    # are distinct and none is a source (Scheduler.check).
    copies: list[tuple[int, int]] = field(default_factory=list)
    # One pool reference per copy source, held by the batch until it is launched (``launched``
    # drops them): no source is freed, and so reused as a destination, while the batch is scheduled.
    held: list[int] = field(default_factory=list)
    _holds: dict[int, int] = field(default_factory=dict, repr=False)  # block -> count in held
    # Set by ``Scheduler.launched``: the sequence of each sampled row, in row order (the rows of
    # a sampling chunk, one per target, become the forked children's).
    sampled: list[TokenSequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    def hold(self, block: int) -> None:
        """Record that the batch now holds a pool reference to ``block`` (taken by the caller)."""
        self.held.append(block)
        self._holds[block] = self._holds.get(block, 0) + 1

    def holds(self, block: int) -> int:
        """How many references to ``block`` the batch holds."""
        return self._holds.get(block, 0)

    def release_held(self) -> list[int]:
        """Forget the references the batch holds and return them, for the caller to drop."""
        held, self.held = self.held, []
        self._holds.clear()
        return held

    def __bool__(self) -> bool:
        return bool(self.chunks)


@dataclass(frozen=True)
class Draw:
    """One sampled token for one target of a sampling chunk."""

    token: int
    logprob: float  # set only for samples whose params ask for logprobs (else 0.0)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        pool: BlockPool,
        cache: PrefixCache,
        eos_token_ids: Sequence[int] = (),
        stop_strings: StopStrings | None = None,
    ) -> None:
        """``stop_strings`` finds the requests' stop strings in the output text; without it stop
        strings are not looked for."""
        self.config = config
        self.pool = pool
        self.cache = cache
        self.eos_token_ids = frozenset(eos_token_ids)
        self.stop_strings = stop_strings
        self.waiting: deque[TokenSequence] = deque()
        self.running: list[TokenSequence] = []
        self.num_preemptions = 0
        self.num_discarded_tokens = 0  # drawn after an in-flight token that finished its sequence
        # Sequences whose in-flight token finishes them for sure: out of ``running``, no blocks;
        # ``complete`` gives them their last token. id -> sequence.
        self._retired: dict[int, TokenSequence] = {}
        self.num_evicted_blocks = 0
        self.peak_blocks_used = 0
        self.peak_num_seqs = 0  # the most sequences sampled in one step
        self._num_parked = 0  # waiting sequences that hold their prompt's KV
        self._root = cache.match(()).handle

    # -- queue -----------------------------------------------------------------------------------

    def add(self, request: Request) -> None:
        self.waiting.append(
            TokenSequence(
                request=request,
                targets=request.targets,
                token_ids=list(request.prompt_token_ids),
                num_prompt_tokens=len(request.prompt_token_ids),
                cache_handle=self._root,
                constraint=request.grammar.start() if request.grammar is not None else None,
            )
        )

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._retired)

    @property
    def num_waiting_targets(self) -> int:
        return sum(len(s.targets) for s in self.waiting)

    # -- scheduling --------------------------------------------------------------------------------

    def schedule(self) -> Batch:
        batch = Batch()
        budget = self.config.max_num_batched_tokens
        preempted = False

        # 1. Running sequences, oldest first; victims of preemption are taken from the end. A
        # sequence whose token is in flight is never preempted (that token would be lost): when
        # the newest one is in flight, nothing is preempted and nothing more is scheduled this
        # step (the token is known after it, and the sequence can be preempted then).
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.num_in_flight and not self._may_run_ahead(seq):
                i += 1  # waits a step for its token
                continue
            n = min(seq.num_tokens - seq.num_computed, budget)
            while not self._reserve(seq, n, batch):
                victim = self.running[-1]
                if victim.num_in_flight:
                    preempted = True  # no admissions either: blocks are short
                    break
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                batch.chunks.append(Chunk(seq, seq.num_computed, n))
                budget -= n
                i += 1
                continue
            break  # seq was preempted (it was the newest) or the newest is in flight: stop

        # 2. Admit waiting sequences (or parts of them) while budget, slots and blocks allow.
        # A running sequence takes one slot per target: it samples that many rows per step.
        slots = sum(len(s.targets) for s in self.running)
        while self.waiting and budget > 0 and not preempted:
            seq = self.waiting[0]
            admitted = self._admit_next(seq, self.config.max_num_seqs - slots, budget, batch)
            if admitted is None:
                break
            if admitted is seq:
                self.waiting.popleft()
            self.running.append(admitted)
            slots += len(admitted.targets)
            budget -= batch.chunks[-1].num_tokens

        self.peak_blocks_used = max(self.peak_blocks_used, self.pool.num_used)
        sampled = sum(len(c.seq.targets) for c in batch.chunks if c.samples)
        self.peak_num_seqs = max(self.peak_num_seqs, sampled)
        return batch

    @staticmethod
    def _may_run_ahead(seq: TokenSequence) -> bool:
        """Whether running ``seq``, whose newest token is in flight, may be scheduled before that
        token is known. Not when sampling it reads that token on the host: a grammar state must
        consume it before the next mask is made, and repetition/presence/frequency penalties
        count the tokens so far. Such rows wait for their token: with overlapped steps they run
        every other step. (Stop strings need no wait: a stop found late discards one token.)"""
        return seq.constraint is None and not seq.params.needs_history

    def _admit_next(
        self, seq: TokenSequence, free: int, budget: int, batch: Batch
    ) -> TokenSequence | None:
        """Admit ``seq``, the head of the queue, or a new part of it with ``free`` of its targets
        (``free``: the sequence slots left); return what was admitted, or None if it must wait.

        A fresh sequence that fits ``max_num_seqs`` waits until it fits whole; a larger one, or a
        parked one, is split. Parts admitted before its prompt is computed leave the rest waiting
        for that part (parked when the prompt is done): computing it again would waste the work.
        """
        if seq.waits_for is not None or free <= 0:
            return None
        parked = seq.num_computed > 0
        if len(seq.targets) <= free:
            part = seq
        elif not parked and len(seq.targets) <= self.config.max_num_seqs:
            return None
        else:
            part = self._split(seq, free)
        if parked:
            if not self._resume_parked(part, keep=seq, batch=batch):
                if part is not seq:
                    self._release(part)
                return None
            if part is seq:
                self._num_parked -= 1
        elif not self._admit(part, budget, batch):
            return None
        if part is not seq:
            seq.targets = seq.targets[free:]
            if seq.num_computed == 0:  # fresh, or gave up its blocks to admit the part
                part.rest, seq.waits_for = seq, part
        return part

    def _split(self, seq: TokenSequence, k: int) -> TokenSequence:
        """A new sequence for the first ``k`` targets of waiting ``seq``, holding what ``seq``
        holds; the caller moves the targets once it is admitted."""
        return self._share(seq, seq.targets[:k], num_cached_tokens=None)

    def _share(
        self, seq: TokenSequence, targets: tuple[SampleTarget, ...], num_cached_tokens: int | None
    ) -> TokenSequence:
        """A sequence for ``targets`` with ``seq``'s tokens and progress, holding what ``seq``
        holds (one more reference on each block and one more radix lock, once computed)."""
        part = TokenSequence(
            request=seq.request,
            targets=targets,
            token_ids=list(seq.token_ids),
            num_prompt_tokens=seq.num_prompt_tokens,
            cache_handle=seq.cache_handle,
            num_computed=seq.num_computed,
            block_table=list(seq.block_table),
            num_cached_tokens=num_cached_tokens,
            num_blocks_in_cache=seq.num_blocks_in_cache,
            constraint=seq.constraint.fork() if seq.constraint is not None else None,
        )
        if seq.num_computed:
            self.pool.incref(part.block_table)
            self.cache.lock(part.cache_handle)
        return part

    def _resume_parked(self, seq: TokenSequence, keep: TokenSequence, batch: Batch) -> bool:
        """Schedule the last prompt token of a parked sequence (or part of one): its logits are
        needed again, and its KV goes into a block of its own. False if blocks ran out; parked
        ``keep`` keeps its blocks meanwhile."""
        watermark = self.config.watermark_blocks if self.running else 0
        if not self._reserve(seq, 1, batch, extra=watermark, keep=keep):
            return False
        if seq.num_cached_tokens is None:
            seq.num_cached_tokens = seq.num_computed
        batch.chunks.append(Chunk(seq, seq.num_computed, 1))
        return True

    def _park(self, seq: TokenSequence, source: TokenSequence) -> None:
        """Give waiting ``seq`` (the rest of ``source``'s targets) the KV of every prompt token
        but the last, now that ``source`` has computed its prompt."""
        seq.waits_for = None
        n = seq.num_prompt_tokens - 1
        if n == 0:
            return  # a one-token prompt: nothing to hold
        seq.block_table = source.block_table[: -(-n // self.config.block_size)]
        self.pool.incref(seq.block_table)
        self.cache.lock(source.cache_handle)
        seq.cache_handle = source.cache_handle
        seq.num_blocks_in_cache = source.num_blocks_in_cache  # <= len(block_table)
        seq.num_computed = n
        self._num_parked += 1

    def _unpark(self, seq: TokenSequence) -> None:
        """A parked sequence gives its blocks back (it will be admitted like a fresh one)."""
        self._release(seq)
        seq.num_computed = 0
        self._num_parked -= 1

    def _admit(self, seq: TokenSequence, budget: int, batch: Batch) -> bool:
        """Give ``seq`` its cached prefix and blocks for a first chunk; False if it must wait."""
        bs = self.config.block_size
        # Leave at least one token to compute: the last prompt token's logits are needed.
        match = self.cache.match(seq.token_ids, max_blocks=(len(seq.token_ids) - 1) // bs)
        cached = len(match.blocks) * bs
        if self._shares_uncached_prefix(seq, cached, batch):
            # A sequence computed in this very step shares at least one more block with this one:
            # wait a step and take it from the cache instead of computing it twice.
            return False
        # Hold the matched blocks before evicting, so eviction cannot take them.
        self.pool.incref(match.blocks)
        self.cache.lock(match.handle)
        watermark = self.config.watermark_blocks if self.running else 0
        # The prompt may go on to share the head of a further cached block: copy that block and
        # compute from the first differing token. Holding the copy's source can keep eviction
        # from freeing the block that would make room, so without room retry without it.
        partial = self.cache.match_partial(
            match.handle, seq.token_ids, len(seq.token_ids) - 1 - cached
        )
        for source, shared in [partial, (None, 0)] if partial else [(None, 0)]:
            start = cached + shared
            n = min(len(seq.token_ids) - start, budget)
            need = -(-(start + n) // bs) - len(match.blocks)
            held = [] if source is None else [source]
            self.pool.incref(held)
            if self._make_free(need + watermark):
                break
            self.pool.decref(held)
        else:
            self.cache.unlock(match.handle)
            self.pool.decref(match.blocks)
            return False
        own = self.pool.allocate(need)
        if source is not None:
            batch.copies.append((source, own[0]))
            batch.hold(source)
        seq.block_table = list(match.blocks) + own
        seq.cache_handle = match.handle
        seq.num_computed = start
        seq.num_blocks_in_cache = len(match.blocks)
        if seq.num_cached_tokens is None:
            seq.num_cached_tokens = start
        batch.chunks.append(Chunk(seq, start, n))
        return True

    def _shares_uncached_prefix(self, seq: TokenSequence, cached: int, batch: Batch) -> bool:
        end = cached + self.config.block_size
        if end >= len(seq.token_ids):
            return False
        head = seq.token_ids[:end]
        return any(
            c.start < end <= len(c.seq.token_ids) and c.seq.token_ids[:end] == head
            for c in batch.chunks
        )

    def _reserve(
        self,
        seq: TokenSequence,
        n: int,
        batch: Batch,
        extra: int = 0,
        keep: TokenSequence | None = None,
    ) -> bool:
        """Make the blocks for ``seq``'s next ``n`` tokens writable, with ``extra`` blocks to
        spare; False if blocks ran out. ``keep``: a parked sequence not to unpark for room."""
        bs = self.config.block_size
        start = seq.num_computed
        need = -(-(start + n) // bs) - len(seq.block_table)
        idx = start // bs
        # Shared with another holder than the batch's copies: write into a private copy.
        cow = start % bs != 0 and (
            self.pool.refcount(seq.block_table[idx]) - batch.holds(seq.block_table[idx]) > 1
        )
        if not self._make_free(need + cow + extra, keep):
            return False
        if cow:
            (copy,) = self.pool.allocate(1)
            batch.copies.append((seq.block_table[idx], copy))
            batch.hold(seq.block_table[idx])  # the sequence's reference passes to the batch
            seq.block_table[idx] = copy
        if need > 0:
            seq.block_table.extend(self.pool.allocate(need))
        return True

    def _make_free(self, n: int, keep: TokenSequence | None = None) -> bool:
        """Get ``n`` blocks free: evict cached blocks, then unpark parked sequences (but
        ``keep``), newest first; False if that is not enough (a running sequence must go)."""
        if self.pool.can_allocate(n):
            return True
        self.num_evicted_blocks += self.cache.evict(n - self.pool.num_free)
        if self.pool.can_allocate(n) or self._num_parked == 0:
            return self.pool.can_allocate(n)
        for seq in reversed(self.waiting):
            if seq.num_computed and seq is not keep:
                self._unpark(seq)
                self.num_evicted_blocks += self.cache.evict(max(0, n - self.pool.num_free))
                if self.pool.can_allocate(n):
                    return True
        return False

    def _preempt(self, seq: TokenSequence) -> None:
        assert not seq.num_in_flight, "preempting a sequence whose token is in flight"
        self.running.remove(seq)
        self._release(seq)
        seq.num_computed = 0
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _release(self, seq: TokenSequence) -> None:
        self.pool.decref(seq.block_table)
        self.cache.unlock(seq.cache_handle)
        seq.block_table = []
        seq.cache_handle = self._root
        seq.num_blocks_in_cache = 0

    # -- after the forward pass ------------------------------------------------------------------

    def launched(self, batch: Batch) -> None:
        """``batch``'s step is on the device: its chunks' KV counts as computed and each sampled
        row's token is in flight (``batch.sampled`` lists the rows' sequences). Sequences whose
        prompt ended fork, rests waiting for them park, and sequences the in-flight token
        finishes for sure are retired (their blocks freed now, as without overlap)."""
        # The copies are queued before any later step's work, which may reuse their sources.
        self.pool.decref(batch.release_held())
        for chunk in batch.chunks:
            seq = chunk.seq
            seq.num_computed += chunk.num_tokens
            self._cache_full_blocks(seq)
            if not chunk.samples:
                continue
            if seq.rest is not None:
                self._park(seq.rest, seq)
                seq.rest = None
            # Forked before the tokens are known: each child's token is its own row's draw.
            for child in self._fork(seq):
                child.num_in_flight += 1
                batch.sampled.append(child)
                if self._surely_finishes(child):
                    self.running.remove(child)
                    self._release(child)
                    self._retired[id(child)] = child

    def _surely_finishes(self, seq: TokenSequence) -> bool:
        """The in-flight tokens reach max_tokens or max_model_len (whatever they are)."""
        return (
            seq.num_output_tokens + seq.num_in_flight >= seq.params.max_tokens
            or seq.num_tokens >= self.config.max_model_len
        )

    def complete(self, batch: Batch, draws: list[Draw]) -> list[TokenSequence]:
        """Record the tokens of launched ``batch`` (one Draw per ``batch.sampled`` row); return
        the sequences that finished. A row whose sequence finished before (its previous token
        was its last) is discarded."""
        finished: list[TokenSequence] = []
        for seq, draw in zip(batch.sampled, draws, strict=True):
            if seq.finish_reason is not None:
                self.num_discarded_tokens += 1
                continue
            seq.num_in_flight -= 1
            seq.token_ids.append(draw.token)
            if seq.constraint is not None:
                seq.constraint.consume(draw.token)
            if seq.params.logprobs:
                seq.token_logprobs.append(draw.logprob)
            reason = self._finish_reason(seq, draw.token)
            if reason is not None:
                self.finish(seq, reason)
                finished.append(seq)
            elif id(seq) not in self._retired:  # (a retired one holds no blocks)
                self._cache_full_blocks(seq)  # blocks completed by a once in-flight token
        return finished

    def finish(self, seq: TokenSequence, reason: FinishReason) -> None:
        """Retire a running (or retired) sequence; a token still in flight will be discarded."""
        seq.finish_reason = reason
        seq.num_in_flight = 0
        if self._retired.pop(id(seq), None) is None:
            self.running.remove(seq)
            self._release(seq)

    def _fork(self, seq: TokenSequence) -> list[TokenSequence]:
        """Split a sequence that stands for several targets into one per target; the children
        share every block (one more reference each) and the radix lock."""
        if seq.forked:
            return [seq]
        children = [seq]
        for target in seq.targets[1:]:
            # Only the first sample is charged for computing the prompt.
            children.append(self._share(seq, (target,), num_cached_tokens=seq.num_prompt_tokens))
        seq.targets = seq.targets[:1]
        pos = self.running.index(seq) + 1
        self.running[pos:pos] = children[1:]
        return children

    def _cache_full_blocks(self, seq: TokenSequence) -> None:
        """Insert newly completed blocks into the prefix cache and move the lock to them: blocks
        of computed and known tokens (an in-flight token's id is not known yet)."""
        full = min(seq.num_computed, len(seq.token_ids)) // self.config.block_size
        if full <= seq.num_blocks_in_cache:
            return
        handle = self.cache.insert(
            seq.token_ids[: full * self.config.block_size], seq.block_table[:full]
        )
        self.cache.lock(handle)
        self.cache.unlock(seq.cache_handle)
        seq.cache_handle = handle
        seq.num_blocks_in_cache = full

    def _finish_reason(self, seq: TokenSequence, token: int) -> FinishReason | None:
        """Whether ``seq`` ends with its newest token ``token``, decided here only and in this
        order: EOS or a stop token id, a failed grammar state (error), a stop string (then
        ``seq.text`` is the output text cut before it), a completed grammar, max_tokens or
        max_model_len. (A grammar allows EOS only where its output is complete.)"""
        params = seq.params
        if token in params.stop_token_ids or (
            not params.ignore_eos and token in self.eos_token_ids
        ):
            return FinishReason.STOP
        constraint = seq.constraint
        if constraint is not None and constraint.error is not None:
            return FinishReason.ERROR
        if params.stop and self.stop_strings is not None:
            text = self.stop_strings.match(
                seq.decoded, seq.token_ids, seq.num_prompt_tokens, params.stop
            )
            if text is not None:
                seq.text = text
                return FinishReason.STOP
        if constraint is not None and constraint.complete:
            return FinishReason.STOP
        if seq.num_output_tokens >= params.max_tokens:
            return FinishReason.LENGTH
        if len(seq.token_ids) >= self.config.max_model_len:
            return FinishReason.LENGTH
        return None

    # -- invariants --------------------------------------------------------------------------------

    def check(self, batch: Batch | None = None) -> None:
        """Assert that every block is accounted for: free, owned by the cache, held by a running
        or parked sequence, or by ``batch`` (the batch scheduled last, until ``launched``), with
        refcounts equal to the number of holders; and the batch's block copies can run as one
        unordered set (destinations distinct, none of them a source, every source held).

        In-flight tokens: at most one per sequence, only in running (or retired) sequences that
        have computed every known token and cached no block holding an unknown one; a running
        one is scheduled only as a one-token decode of that token, and only if its sampling does
        not wait for it (``_may_run_ahead``); a retired one holds nothing.

        Call it after ``complete``, or after ``schedule`` with the batch it
        returned.
        """
        self.pool.check()
        self.cache.check()
        holders = [0] * self.pool.num_blocks
        for b in self.cache.owned_blocks():
            holders[b] += 1
        if batch is not None:
            sources = [src for src, _ in batch.copies]
            dests = [dst for _, dst in batch.copies]
            assert len(set(dests)) == len(dests), f"a block is copied into twice: {dests}"
            assert not set(dests) & set(sources), f"copy destination also a source: {dests}"
            assert set(sources) <= set(batch.held), "a copy source is not held by the batch"
            running = {id(seq) for seq in self.running}
            assert all(id(c.seq) in running for c in batch.chunks)
            for c in batch.chunks:
                assert len(c.seq.block_table) * self.config.block_size >= c.start + c.num_tokens
                if c.seq.num_in_flight:
                    assert c.start == len(c.seq.token_ids) and c.num_tokens == 1, c
                    assert self._may_run_ahead(c.seq), "a row that waits for its token ran"
            for b in batch.held:
                holders[b] += 1
        bs = self.config.block_size
        for seq in self.running:
            assert len(seq.block_table) * bs >= seq.num_computed
            assert seq.finish_reason is None and 0 <= seq.num_in_flight <= 1
            assert seq.num_blocks_in_cache * bs <= len(seq.token_ids), "unknown token cached"
            if seq.num_in_flight:
                assert seq.forked and seq.num_computed == len(seq.token_ids), "in flight"
            for b in seq.block_table:
                holders[b] += 1
        assert sum(len(s.targets) for s in self.running) <= self.config.max_num_seqs
        for seq in self._retired.values():
            assert seq.num_in_flight == 1 and seq.finish_reason is None
            assert not seq.block_table and seq.cache_handle is self._root
            assert all(seq is not r for r in self.running)
        parked = 0
        for seq in self.waiting:
            assert seq.num_in_flight == 0 and seq.finish_reason is None
            if seq.waits_for is not None:
                assert seq.waits_for.rest is seq and seq.num_computed == 0
            if seq.num_computed == 0:
                assert not seq.block_table
                continue
            # parked: the KV of every prompt token but the last
            parked += 1
            assert seq.num_output_tokens == 0
            assert seq.num_computed == seq.num_prompt_tokens - 1
            assert len(seq.block_table) == -(-seq.num_computed // self.config.block_size)
            for b in seq.block_table:
                holders[b] += 1
        assert parked == self._num_parked
        for b, count in enumerate(holders):
            assert self.pool.refcount(b) == count, (
                f"block {b}: refcount {self.pool.refcount(b)}, holders {count}"
            )
