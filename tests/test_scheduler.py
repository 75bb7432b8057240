"""Scheduler, block pool and radix cache together, driven by a fake model (no torch).

The fake model keeps a simulated KV store: computing a chunk writes (position, token) into the
chunk's slots, and the "logits" of a sequence are a hash of the context read back through its
block table. A block-table, copy-on-write or cache bug therefore changes the generated tokens, and
every run is compared with a reference that needs no KV at all.
"""

from __future__ import annotations

import random
import zlib

import pytest

from batchgen.engine.block_pool import BlockPool
from batchgen.engine.radix_cache import NullCache, RadixCache
from batchgen.engine.request import (
    FinishReason,
    Request,
    SampleTarget,
    SamplingParams,
    TokenSequence,
)
from batchgen.engine.scheduler import Batch, Draw, Scheduler, SchedulerConfig

VOCAB = 50
EOS = 0


def update(sched: Scheduler, batch: Batch, draws: list[list[Draw]]) -> list[TokenSequence]:
    """A step that does not overlap: ``launched`` and ``complete`` at once. ``draws`` has one list
    per sampling chunk of ``batch`` (in order), with one Draw per target of its sequence."""
    sched.launched(batch)
    return sched.complete(batch, [d for chunk_draws in draws for d in chunk_draws])


def next_token(context: tuple[int, ...], key: int) -> int:
    """The fake model + sampler: a deterministic function of the whole context and the target."""
    return zlib.crc32(repr((context, key)).encode()) % VOCAB


def reference(prompt: tuple[int, ...], key: int, params: SamplingParams, max_len: int):
    tokens = list(prompt)
    while True:
        t = next_token(tuple(tokens), key)
        tokens.append(t)
        out = len(tokens) - len(prompt)
        if t == EOS and not params.ignore_eos:
            return tokens[len(prompt) :], FinishReason.STOP
        if out >= params.max_tokens or len(tokens) >= max_len:
            return tokens[len(prompt) :], FinishReason.LENGTH


class FakeRunner:
    def __init__(self, sched: Scheduler, num_blocks: int, block_size: int) -> None:
        self.sched = sched
        self.bs = block_size
        self.kv: list[tuple[int, int] | None] = [None] * (num_blocks * block_size)
        self.computed_tokens = 0
        self.copies_per_step: list[int] = []
        self.sampled_per_step: list[int] = []

    def step(self):
        batch = self.sched.schedule()
        assert batch, "empty batch with work left"
        self.sched.check(batch)
        self.copies_per_step.append(len(batch.copies))
        self.copy_blocks(batch.copies)
        draws = []
        for chunk in batch.chunks:
            seq = chunk.seq
            for p in range(chunk.start, chunk.start + chunk.num_tokens):
                slot = seq.block_table[p // self.bs] * self.bs + p % self.bs
                self.kv[slot] = (p, seq.token_ids[p])
            self.computed_tokens += chunk.num_tokens
            if chunk.samples:
                context = self.context(seq, chunk.start + chunk.num_tokens)
                draws.append([Draw(next_token(context, t.rng_key), 0.0) for t in seq.targets])
        self.sampled_per_step.append(sum(map(len, draws)))
        finished = update(self.sched, batch, draws)
        self.sched.check()
        return finished

    def copy_blocks(self, copies) -> None:
        for src, dst in copies:
            self.kv[dst * self.bs : (dst + 1) * self.bs] = self.kv[
                src * self.bs : (src + 1) * self.bs
            ]

    def context(self, seq, end: int) -> tuple[int, ...]:
        """The tokens at positions [0, end) as the KV slots hold them (asserts none is stale)."""
        context = []
        for p in range(end):
            entry = self.kv[seq.block_table[p // self.bs] * self.bs + p % self.bs]
            assert entry is not None and entry[0] == p, f"stale KV at position {p}"
            context.append(entry[1])
        return tuple(context)

    def pending(self) -> bool:
        return False


class OverlapRunner(FakeRunner):
    """Steps overlapped the engine's way: step N+1 is scheduled and "computed" before step N's
    tokens are given to the scheduler. A token in flight is written into the KV store from step
    N's draws (as the device fills it), never from ``token_ids``, which does not hold it yet."""

    def __init__(self, sched: Scheduler, num_blocks: int, block_size: int) -> None:
        super().__init__(sched, num_blocks, block_size)
        self.prev: tuple[object, list[Draw]] | None = None  # launched batch, its draws
        self.in_flight_rows: list[int] = []  # per scheduled chunk: its token was in flight

    def pending(self) -> bool:
        return self.prev is not None

    def step(self):
        prev, self.prev = self.prev, None
        batch = self.sched.schedule()
        if not batch:  # everything waits for an in-flight token
            assert prev is not None, "empty batch with work left"
            finished = self.sched.complete(*prev)
            self.sched.check()
            return finished
        self.sched.check(batch)
        device = {}  # id(seq) -> its in-flight token, as the device knows it
        if prev is not None:
            device = {id(seq): d.token for seq, d in zip(prev[0].sampled, prev[1], strict=True)}
        self.copy_blocks(batch.copies)
        draws = []
        for chunk in batch.chunks:
            seq = chunk.seq
            self.in_flight_rows.append(seq.num_in_flight)
            for p in range(chunk.start, chunk.start + chunk.num_tokens):
                token = seq.token_ids[p] if p < len(seq.token_ids) else device[id(seq)]
                self.kv[seq.block_table[p // self.bs] * self.bs + p % self.bs] = (p, token)
            self.computed_tokens += chunk.num_tokens
            if chunk.samples:
                context = self.context(seq, chunk.start + chunk.num_tokens)
                draws.extend(Draw(next_token(context, t.rng_key), 0.0) for t in seq.targets)
        self.sampled_per_step.append(len(draws))
        self.sched.launched(batch)
        finished = self.sched.complete(*prev) if prev is not None else []
        self.prev = (batch, draws)
        self.sched.check()
        return finished


def outputs_fed_back(results) -> int:
    """Output tokens the runner computed: each sequence's outputs but its last (never fed back)."""
    return sum(len(s.output_ids) - 1 for s in results.values())


def run_all(
    requests,
    *,
    num_blocks=64,
    block_size=4,
    max_num_seqs=8,
    budget=32,
    max_model_len=10_000,
    caching=True,
    overlap=False,
):
    pool = BlockPool(num_blocks)
    cache = RadixCache(pool, block_size) if caching else NullCache(block_size)
    sched = Scheduler(
        SchedulerConfig(block_size, max_num_seqs, budget, max_model_len, watermark_blocks=1),
        pool,
        cache,
        eos_token_ids=(EOS,),
    )
    runner = (OverlapRunner if overlap else FakeRunner)(sched, num_blocks, block_size)
    for r in requests:
        sched.add(r)
    results = {}
    steps = 0
    while sched.has_work() or runner.pending():
        for seq in runner.step():
            t = seq.targets[0]
            assert (t.row, t.sample_index) not in results
            results[(t.row, t.sample_index)] = seq
        steps += 1
        assert steps < 100_000
    # Every block is free or owned by the cache; evicting the cache frees everything.
    cache.evict(num_blocks)
    assert pool.num_free == num_blocks
    return results, sched, runner


def make_requests(rng, num_rows, n, params, prefixes=()):
    reqs = []
    for row in range(num_rows):
        prefix = list(rng.choice(prefixes)) if prefixes else []
        prompt = tuple(prefix + [rng.randrange(1, VOCAB) for _ in range(rng.randrange(1, 12))])
        targets = tuple(SampleTarget(row, k, row * 1000 + k) for k in range(n))
        reqs.append(Request(prompt, params, targets))
    return reqs


def check_against_reference(reqs, results, max_len=10_000):
    for r in reqs:
        for t in r.targets:
            seq = results[(t.row, t.sample_index)]
            tokens, reason = reference(r.prompt_token_ids, t.rng_key, r.params, max_len)
            assert seq.output_ids == tokens
            assert seq.finish_reason == reason


@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("num_blocks", [12, 40, 400])
@pytest.mark.parametrize("n", [1, 3, 11])
def test_results_match_reference_under_any_memory(caching, num_blocks, n):
    rng = random.Random(num_blocks * 10 + n)
    prefixes = [
        tuple(rng.randrange(1, VOCAB) for _ in range(rng.randrange(3, 14))) for _ in range(3)
    ]
    params = SamplingParams(n=n, max_tokens=12, ignore_eos=True)
    reqs = make_requests(rng, 20, n, params, prefixes)
    results, sched, _ = run_all(reqs, num_blocks=num_blocks, caching=caching)
    check_against_reference(reqs, results)
    if num_blocks == 12:
        assert sched.num_preemptions > 0


def test_eos_stops_and_max_model_len_limits():
    rng = random.Random(1)
    params = SamplingParams(max_tokens=50)
    reqs = make_requests(rng, 30, 1, params)
    results, _, _ = run_all(reqs, max_model_len=20)
    check_against_reference(reqs, results, max_len=20)
    reasons = {s.finish_reason for s in results.values()}
    assert FinishReason.STOP in reasons and FinishReason.LENGTH in reasons


def test_chunked_prefill_splits_long_prompts():
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    prompt = tuple(range(1, 45))  # 44 tokens, budget 8 -> 6 chunks
    reqs = [Request(prompt, params, (SampleTarget(0, 0, 7),))]
    pool = BlockPool(32)
    sched = Scheduler(SchedulerConfig(4, 4, 8, 1000), pool, RadixCache(pool, 4))
    runner = FakeRunner(sched, 32, 4)
    sched.add(reqs[0])
    chunk_sizes = []
    while sched.has_work():
        batch_sizes_before = runner.computed_tokens
        runner.step()
        chunk_sizes.append(runner.computed_tokens - batch_sizes_before)
    assert chunk_sizes[:6] == [8, 8, 8, 8, 8, 4]
    assert chunk_sizes[6:] == [1, 1]


def test_fork_shares_prompt_blocks_and_copies_on_write():
    bs = 4
    params = SamplingParams(n=4, max_tokens=5, ignore_eos=True)
    prompt = tuple(range(1, 11))  # 10 tokens: 2 full blocks + a partial one
    req = Request(prompt, params, tuple(SampleTarget(0, k, k) for k in range(4)))
    pool = BlockPool(64)
    sched = Scheduler(SchedulerConfig(bs, 8, 64, 1000), pool, RadixCache(pool, bs))
    runner = FakeRunner(sched, 64, bs)
    sched.add(req)
    runner.step()  # prefill + fork
    assert len(sched.running) == 4
    tables = [s.block_table for s in sched.running]
    assert all(t == tables[0] for t in tables)
    assert all(pool.refcount(b) >= 4 for b in tables[0])
    used_after_prefill = pool.num_used
    runner.step()  # first decode: three samples copy the partial block, the last writes in place
    assert runner.copies_per_step[-1] == 3
    assert pool.num_used == used_after_prefill + 3
    results = {}
    while sched.has_work():
        for seq in runner.step():
            results[(0, seq.targets[0].sample_index)] = seq
    check_against_reference([req], results)
    # The runner computed the prompt once (every output token but the last is fed back) ...
    assert runner.computed_tokens - outputs_fed_back(results) == len(prompt)
    # ... and only the first sample is charged for it.
    assert sorted(s.num_cached_tokens for s in results.values()) == [0, 10, 10, 10]


@pytest.mark.parametrize("template_len,copies", [(40, 0), (42, 9)])
def test_shared_prefix_is_computed_once(template_len: int, copies: int):
    """10 blocks of template (or 10 blocks + 2 tokens: later rows copy the first row's 11th block,
    its source held until the step ran, instead of computing those 2 tokens)."""
    bs = 4
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    template = tuple(range(1, template_len + 1))
    reqs = [
        Request(template + (100 + i, 101 + i), params, (SampleTarget(i, 0, i),)) for i in range(10)
    ]
    results, _, runner = run_all(reqs, num_blocks=200, block_size=bs, budget=256, max_num_seqs=16)
    check_against_reference(reqs, results)
    # Ideal: the template once plus each row's two own tokens, counted by the runner.
    computed = runner.computed_tokens - outputs_fed_back(results)
    assert computed == template_len + 10 * 2
    assert sum(runner.copies_per_step) == copies
    # The rows' num_cached_tokens account for exactly the prompt tokens not computed.
    prompt_tokens = sum(len(r.prompt_token_ids) for r in reqs)
    assert prompt_tokens - sum(s.num_cached_tokens for s in results.values()) == computed


def test_partial_copy_is_dropped_when_its_source_is_the_room_needed():
    """Holding the copy's source (only the tree holds it) would keep eviction from freeing the
    block the admission needs: the sequence is admitted without the copy instead."""
    bs = 4
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    first = Request(tuple(range(1, 11)), params, (SampleTarget(0, 0, 0),))  # 2 blocks + 2
    pool = BlockPool(8)
    cache = RadixCache(pool, bs)
    sched = Scheduler(SchedulerConfig(bs, 4, 64, 1000), pool, cache)
    runner = FakeRunner(sched, 8, bs)
    sched.add(first)
    while sched.has_work():
        runner.step()
    assert len(cache.owned_blocks()) == 2
    # shares block 0 and the first 2 tokens of block 1, then needs all 8 blocks of the pool
    second = Request(tuple(range(1, 7)) + tuple(range(50, 74)), params, (SampleTarget(1, 0, 1),))
    sched.add(second)
    results = {}
    while sched.has_work():
        for seq in runner.step():
            results[(seq.targets[0].row, 0)] = seq
    check_against_reference([second], results)
    assert results[(1, 0)].num_cached_tokens == 4
    cache.evict(8)
    assert pool.num_free == 8


@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("prompt_len", [8, 9, 10, 11])
def test_identical_prompts_and_forks_compute_the_prompt_once(prompt_len, n, caching):
    """Five requests with one prompt, n samples each. The runner's own count: with the prefix
    cache, the prompt's full blocks are computed once; a later request computes its tail past the
    last full block (the first request's partial block is cached only once full), at least its
    last token (whose logits are needed; for a prompt of whole blocks the tokens before it in its
    last block are copied out of the cached block). Without the cache each request computes the prompt, its n forks share it. The rows'
    num_cached_tokens account for exactly the prompt tokens not computed."""
    bs, requests = 4, 5
    prompt = tuple(range(1, prompt_len + 1))
    params = SamplingParams(n=n, max_tokens=4, ignore_eos=True)
    reqs = [
        Request(prompt, params, tuple(SampleTarget(r, k, r * 10 + k) for k in range(n)))
        for r in range(requests)
    ]
    results, _, runner = run_all(reqs, block_size=bs, max_num_seqs=16, caching=caching)
    check_against_reference(reqs, results)
    computed = runner.computed_tokens - outputs_fed_back(results)
    later = max(1, prompt_len % bs) if caching else prompt_len
    assert computed == prompt_len + (requests - 1) * later
    cached = sum(s.num_cached_tokens for s in results.values())
    assert requests * n * prompt_len - cached == computed


@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("folded", [False, True])
def test_forks_never_exceed_max_num_seqs_and_the_prompt_is_computed_once(caching, folded):
    """One prompt with n=600, or 300 identical rows with n=2 folded into one request, under
    max_num_seqs=16: no step samples more than 16 sequences, every sample gets its tokens, and
    the prompt is computed once plus one token (its last, whose logits are needed) for each
    later group of samples, with or without the prefix cache."""
    bs, max_num_seqs, max_tokens = 4, 16, 5
    prompt = tuple(range(1, 11))  # 10 tokens: 2 full blocks and a partial one
    params = SamplingParams(n=2 if folded else 600, max_tokens=max_tokens, ignore_eos=True)
    if folded:
        targets = [SampleTarget(row, k, row * 10 + k) for row in range(300) for k in range(2)]
    else:
        targets = [SampleTarget(0, k, k) for k in range(600)]
    req = Request(prompt, params, tuple(targets))
    results, sched, runner = run_all(
        [req], num_blocks=64, block_size=bs, max_num_seqs=max_num_seqs, caching=caching
    )
    check_against_reference([req], results)
    assert len(results) == 600
    assert max(runner.sampled_per_step) == sched.peak_num_seqs == max_num_seqs
    groups = -(-600 // max_num_seqs)
    computed = runner.computed_tokens - outputs_fed_back(results)
    assert computed == len(prompt) + (groups - 1)


def test_check_rejects_block_copies_that_cannot_run_as_one_set():
    """check(batch) after schedule: a copy destination written twice, or also read as a source,
    would make the result depend on the order of the copies."""
    bs = 4
    params = SamplingParams(n=3, max_tokens=3, ignore_eos=True)
    req = Request(tuple(range(1, 7)), params, tuple(SampleTarget(0, k, k) for k in range(3)))
    pool = BlockPool(32)
    sched = Scheduler(SchedulerConfig(bs, 8, 64, 1000), pool, RadixCache(pool, bs))
    runner = FakeRunner(sched, 32, bs)
    sched.add(req)
    runner.step()  # prefill and fork: the three share the partial block
    batch = sched.schedule()
    assert len(batch.copies) == 2  # two copy on write, the third writes in place
    sched.check(batch)
    (src, dst), (_, dst2) = batch.copies
    for bad in ([(src, dst), (src, dst)], [(src, dst), (dst, dst2)]):
        good, batch.copies = batch.copies, bad
        with pytest.raises(AssertionError, match="copied into twice|also a source"):
            sched.check(batch)
        batch.copies = good


# -- overlapped steps: tokens in flight ------------------------------------------------------------


@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("num_blocks", [12, 40])
@pytest.mark.parametrize("n", [1, 3])
def test_overlapped_steps_match_reference_under_any_memory(caching, num_blocks, n):
    """EOS may end a sample while the token after it is computed (then discarded); tight
    memory preempts (never a sequence with a token in flight: ``_preempt`` asserts it)."""
    rng = random.Random(num_blocks * 10 + n)
    prefixes = [tuple(rng.randrange(1, VOCAB) for _ in range(rng.randrange(3, 14)))]
    params = SamplingParams(n=n, max_tokens=12)
    reqs = make_requests(rng, 20, n, params, prefixes)
    results, sched, runner = run_all(reqs, num_blocks=num_blocks, caching=caching, overlap=True)
    check_against_reference(reqs, results)
    assert any(runner.in_flight_rows)  # rows ran ahead of their tokens
    assert sched.num_discarded_tokens > 0
    if num_blocks == 12:
        assert sched.num_preemptions > 0


def test_a_token_after_a_finish_is_discarded_and_a_foreseen_finish_costs_nothing():
    """With memory and budget to spare every decode runs ahead: each sample that EOS ends
    discards exactly one token, one that max_tokens ends (foreseen: retired at launch) none."""
    rng = random.Random(5)
    reqs = make_requests(rng, 24, 2, SamplingParams(n=2, max_tokens=6))
    results, sched, _ = run_all(reqs, num_blocks=400, budget=1000, overlap=True)
    check_against_reference(reqs, results)
    # (an EOS drawn as the 6th token was foreseen too: max_tokens would end the sample there)
    unforeseen = sum(len(s.output_ids) < 6 for s in results.values())
    assert 0 < unforeseen < len(results)
    assert sched.num_discarded_tokens == unforeseen


def test_max_tokens_one_retires_at_launch():
    pool = BlockPool(16)
    sched = Scheduler(SchedulerConfig(4, 4, 64, 1000), pool, RadixCache(pool, 4))
    runner = OverlapRunner(sched, 16, 4)
    params = SamplingParams(n=2, max_tokens=1, ignore_eos=True)
    sched.add(Request((3, 4, 5), params, (SampleTarget(0, 0, 1), SampleTarget(0, 1, 2))))
    assert runner.step() == []  # launched: both children retired, their token in flight
    assert not sched.running and sched.has_work() and pool.num_used == 0  # blocks freed
    finished = runner.step()  # nothing to schedule: the tokens are read
    assert [len(s.output_ids) for s in finished] == [1, 1]
    assert {s.finish_reason for s in finished} == {FinishReason.LENGTH}
    assert not sched.has_work() and sched.num_discarded_tokens == 0


def test_check_covers_in_flight_tokens():
    """check() rejects a second token in flight, an in-flight token in a waiting sequence, a
    cached block holding an unknown token, and a grammar/penalty row run ahead of its token."""
    pool = BlockPool(32)
    sched = Scheduler(SchedulerConfig(4, 4, 64, 1000), pool, RadixCache(pool, 4))
    runner = OverlapRunner(sched, 32, 4)
    sched.add(Request((3, 4, 5, 6, 7), SamplingParams(max_tokens=20, ignore_eos=True),
                      (SampleTarget(0, 0, 1),)))  # fmt: skip
    runner.step()
    (seq,) = sched.running
    assert seq.num_in_flight == 1 and seq.num_computed == len(seq.token_ids) == 5
    sched.check()
    for corrupt, undo in [
        (lambda: setattr(seq, "num_in_flight", 2), lambda: setattr(seq, "num_in_flight", 1)),
        (lambda: setattr(seq, "num_computed", 4), lambda: setattr(seq, "num_computed", 5)),
        (lambda: setattr(seq, "num_blocks_in_cache", 2), lambda: setattr(seq, "num_blocks_in_cache", 1)),
    ]:  # fmt: skip
        corrupt()
        with pytest.raises(AssertionError):
            sched.check()
        undo()
        sched.check()
    batch = sched.schedule()
    sched.check(batch)
    seq.request = Request(seq.request.prompt_token_ids,
                          SamplingParams(max_tokens=20, repetition_penalty=1.5), seq.targets)  # fmt: skip
    with pytest.raises(AssertionError, match="waits for its token"):
        sched.check(batch)
