"""RadixCache and NullCache: hand-written cases, then random operations against a brute-force model."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import pytest

from batchgen.engine.block_pool import BlockPool
from batchgen.engine.radix_cache import (
    CacheHandle,
    NullCache,
    RadixCache,
    make_prefix_cache,
)

BS = 2


def num_cached_blocks(cache: RadixCache | NullCache) -> int:
    """Blocks owned by the tree (each holds one tree reference)."""
    return len(cache.owned_blocks())


def num_evictable_blocks(cache: RadixCache | NullCache) -> int:
    """Blocks in unlocked nodes: what ``evict`` would drop if asked for everything."""
    return len(cache.owned_blocks()) - getattr(cache, "_num_locked_blocks", 0)


def make(num_blocks: int = 32, block_size: int = BS) -> tuple[BlockPool, RadixCache]:
    pool = BlockPool(num_blocks)
    return pool, RadixCache(pool, block_size)


def finish(pool: BlockPool, cache: RadixCache, tokens: Sequence[int]) -> list[int]:
    """A finished sequence: fresh blocks for every whole block, inserted, then released."""
    blocks = pool.allocate(len(tokens) // cache.block_size)
    cache.insert(tokens[: len(blocks) * cache.block_size], blocks)
    pool.decref(blocks)
    cache.check()
    pool.check()
    return blocks


def tree_content(cache: RadixCache) -> dict[tuple[int, ...], int]:
    """White-box: every cached whole-block prefix -> the block id of its last block."""
    bs = cache.block_size
    out: dict[tuple[int, ...], int] = {}
    stack = [(cache._root, ())]
    while stack:
        node, prefix = stack.pop()
        for child in node.children.values():
            for i, b in enumerate(child.blocks):
                out[prefix + child.key[: (i + 1) * bs]] = b
            stack.append((child, prefix + child.key))
    return out


# ---- hand-written cases ---------------------------------------------------------------------


def test_empty_cache_matches_nothing() -> None:
    _, cache = make()
    m = cache.match([1, 2, 3, 4])
    assert m.blocks == [] and m.num_tokens == 0
    assert num_cached_blocks(cache) == 0 and num_evictable_blocks(cache) == 0
    assert cache.evict(5) == 0
    cache.check()


def test_exact_match_returns_blocks_and_the_insert_handle() -> None:
    pool, cache = make()
    blocks = pool.allocate(2)
    handle = cache.insert([1, 2, 3, 4], blocks)
    assert [pool.refcount(b) for b in blocks] == [2, 2]  # caller + tree
    m = cache.match([1, 2, 3, 4])
    assert m.blocks == blocks and m.num_tokens == 4 and m.handle == handle
    assert cache.owned_blocks() == set(blocks)
    assert num_cached_blocks(cache) == 2 and num_evictable_blocks(cache) == 2
    cache.check()
    pool.check()


def test_partial_block_tail_is_ignored() -> None:
    pool, cache = make()
    blocks = finish(pool, cache, [1, 2, 3, 4, 5])  # the tail token 5 is not cached
    assert len(blocks) == 2 and num_cached_blocks(cache) == 2
    assert cache.match([1, 2, 3, 4, 5]).blocks == blocks
    assert cache.match([1, 2, 3]).blocks == blocks[:1]  # ends inside a node: split
    assert cache.match([1]).blocks == []
    with pytest.raises(ValueError):
        cache.insert([1, 2, 3], blocks)
    cache.check()


def test_split_on_partial_match() -> None:
    pool, cache = make()
    a, b, c = finish(pool, cache, [1, 2, 3, 4, 5, 6])
    assert len(cache._root.children) == 1
    m = cache.match([1, 2, 3, 9, 5, 6])
    assert m.blocks == [a] and m.num_tokens == 2
    (upper,) = cache._root.children.values()
    assert upper.key == (1, 2) and upper.blocks == [a]
    (lower,) = upper.children.values()
    assert lower.key == (3, 4, 5, 6) and lower.blocks == [b, c]
    assert cache.match([1, 2, 3, 4, 5, 6]).blocks == [a, b, c]  # the split lost nothing
    cache.check()


def test_insert_extending_an_existing_path_adopts_only_the_new_part() -> None:
    pool, cache = make()
    a, b = pool.allocate(2)
    h1 = cache.insert([1, 2, 3, 4], [a, b])
    c = pool.allocate(1)[0]
    h2 = cache.insert([1, 2, 3, 4, 5, 6], [a, b, c])
    assert h2.num_tokens == 6 and h2 != h1
    assert [pool.refcount(x) for x in (a, b, c)] == [2, 2, 2]
    assert cache.match([1, 2, 3, 4, 5, 6, 7, 8]).blocks == [a, b, c]
    cache.check()
    pool.decref([a, b, c])
    assert cache.evict(3) == 3 and pool.num_free == pool.num_blocks
    cache.check()
    pool.check()


def test_insert_of_a_cached_prefix_with_other_blocks_keeps_the_trees() -> None:
    pool, cache = make()
    a, b = finish(pool, cache, [1, 2, 3, 4])
    x, y, z = pool.allocate(3)  # computed elsewhere for the same prefix
    handle = cache.insert([1, 2, 3, 4, 5, 6], [x, y, z])
    assert handle.num_tokens == 6
    assert cache.match([1, 2, 3, 4, 5, 6]).blocks == [a, b, z]
    assert [pool.refcount(v) for v in (x, y, z)] == [1, 1, 2]
    assert cache.owned_blocks() == {a, b, z}
    free_before = pool.num_free
    pool.decref([x, y, z])  # the caller finishes: its duplicates go back to the pool
    assert pool.num_free == free_before + 2
    cache.check()
    pool.check()


def test_insert_of_a_shorter_prefix_splits_and_adopts_nothing() -> None:
    pool, cache = make()
    a, b, c = finish(pool, cache, [1, 2, 3, 4, 5, 6])
    x, y = pool.allocate(2)
    handle = cache.insert([1, 2, 3, 4], [x, y])
    assert handle.num_tokens == 4
    assert handle == cache.match([1, 2, 3, 4]).handle
    assert num_cached_blocks(cache) == 3 and pool.refcount(x) == 1
    cache.check()


def test_insert_branches_at_the_first_differing_block() -> None:
    pool, cache = make()
    a, b = finish(pool, cache, [1, 2, 3, 4])
    _, d = finish(pool, cache, [1, 2, 5, 6])
    assert cache.match([1, 2, 3, 4]).blocks == [a, b]
    assert cache.match([1, 2, 5, 6]).blocks == [a, d]
    (upper,) = cache._root.children.values()
    assert upper.blocks == [a] and len(upper.children) == 2
    assert num_cached_blocks(cache) == 3
    cache.check()


def test_insert_rejects_owned_repeated_or_free_blocks() -> None:
    pool, cache = make()
    (a,) = finish(pool, cache, [1, 2])
    pool.incref([a])
    with pytest.raises(ValueError):
        cache.insert([3, 4], [a])  # already owned by the tree at another prefix
    b = pool.allocate(1)[0]
    with pytest.raises(ValueError):
        cache.insert([5, 6, 7, 8], [b, b])
    pool.decref([b])
    with pytest.raises(ValueError):
        cache.insert([5, 6], [b])  # b is free
    cache.check()
    pool.check()


def test_match_max_blocks() -> None:
    pool, cache = make()
    a, b, c = finish(pool, cache, [1, 2, 3, 4, 5, 6])
    assert cache.match([1, 2, 3, 4, 5, 6], max_blocks=2).blocks == [a, b]
    assert cache.match([1, 2, 3, 4, 5, 6], max_blocks=2).num_tokens == 4
    assert cache.match([1, 2, 3, 4, 5, 6], max_blocks=9).blocks == [a, b, c]
    m = cache.match([1, 2, 3, 4, 5, 6], max_blocks=0)
    assert m.blocks == [] and m.num_tokens == 0
    with pytest.raises(ValueError):
        cache.match([1, 2], max_blocks=-1)
    cache.check()


def test_match_partial_finds_the_longest_shared_head_of_a_next_block() -> None:
    pool, cache = make(block_size=4)
    a, b = finish(pool, cache, [1, 2, 3, 4, 5, 6, 7, 8])
    (c,) = finish(pool, cache, [1, 2, 3, 4, 5, 6, 9, 9])[1:]  # shares 2 tokens of block 2
    (d,) = finish(pool, cache, [1, 2, 3, 4, 7, 7, 7, 7])[1:]
    m = cache.match([1, 2, 3, 4, 5, 6, 7, 0, 0])
    assert m.blocks == [a] and m.num_tokens == 4
    assert cache.match_partial(m.handle, [1, 2, 3, 4, 5, 6, 7, 0, 0], limit=9) == (b, 3)
    assert cache.match_partial(m.handle, [1, 2, 3, 4, 5, 6, 0], limit=9) in ((b, 2), (c, 2))
    assert cache.match_partial(m.handle, [1, 2, 3, 4, 5, 6, 7, 0], limit=2) in ((b, 2), (c, 2))
    assert cache.match_partial(m.handle, [1, 2, 3, 4, 7, 0], limit=9) == (d, 1)
    # never a whole block (that is match's job), never past the limit or the tokens
    assert cache.match_partial(m.handle, [1, 2, 3, 4, 5, 6, 7, 8, 1], limit=9) == (b, 3)
    assert cache.match_partial(m.handle, [1, 2, 3, 4, 5, 6], limit=9) in ((b, 2), (c, 2))
    assert cache.match_partial(m.handle, [1, 2, 3, 4, 5], limit=0) is None
    assert cache.match_partial(m.handle, [1, 2, 3, 4, 8, 8], limit=9) is None
    assert cache.match_partial(m.handle, [1, 2, 3, 4], limit=9) is None
    root = cache.match([9]).handle
    assert cache.match_partial(root, [1, 2, 0], limit=9) == (a, 2)
    # read-only: no references, locks or evictions
    assert [pool.refcount(x) for x in (a, b, c, d)] == [1, 1, 1, 1]
    cache.check()
    assert NullCache(4).match_partial(root, [1, 2, 0], limit=9) is None


def test_evict_in_lru_order() -> None:
    pool, cache = make()
    (a,) = finish(pool, cache, [1, 1])
    (b,) = finish(pool, cache, [2, 2])
    (c,) = finish(pool, cache, [3, 3])
    cache.match([1, 1])  # a is now the most recently used
    assert cache.evict(1) == 1
    assert pool.refcount(b) == 0 and cache.owned_blocks() == {a, c}
    assert cache.evict(1) == 1
    assert cache.owned_blocks() == {a}
    cache.insert([3, 3], pool.allocate(1))  # a new leaf is the most recent
    assert cache.evict(1) == 1 and cache.match([1, 1]).blocks == []
    cache.check()
    pool.check()


def test_evict_trims_a_long_leaf_from_its_tail() -> None:
    pool, cache = make()
    a, b, c, d = finish(pool, cache, [1, 2, 3, 4, 5, 6, 7, 8])
    assert cache.evict(1) == 1
    assert pool.refcount(d) == 0
    assert cache.match([1, 2, 3, 4, 5, 6, 7, 8]).blocks == [a, b, c]
    assert cache.evict(2) == 2
    assert cache.owned_blocks() == {a}
    cache.check()
    pool.check()


def test_locked_node_and_its_ancestors_are_never_evicted() -> None:
    pool, cache = make()
    a, b = finish(pool, cache, [1, 2, 3, 4])
    _, d = finish(pool, cache, [1, 2, 5, 6])
    (e,) = finish(pool, cache, [7, 7])
    m = cache.match([1, 2, 3, 4])
    cache.lock(m.handle)
    assert num_evictable_blocks(cache) == 2  # d and e
    assert cache.evict(100) == 2
    assert cache.owned_blocks() == {a, b}
    assert num_evictable_blocks(cache) == 0
    cache.check()
    cache.lock(m.handle)  # locks nest
    cache.unlock(m.handle)
    assert cache.evict(100) == 0
    cache.unlock(m.handle)
    assert num_evictable_blocks(cache) == 2
    assert cache.evict(100) == 2 and pool.num_free == pool.num_blocks
    cache.check()
    pool.check()


def test_lock_deep_handle_protects_a_split_parent() -> None:
    pool, cache = make()
    a, b, c = finish(pool, cache, [1, 2, 3, 4, 5, 6])
    h = cache.match([1, 2, 3, 4, 5, 6]).handle
    cache.lock(h)
    cache.match([1, 2, 9, 9])  # splits the locked node; the upper part must stay locked
    cache.check()
    assert cache.evict(10) == 0
    cache.unlock(h)
    assert cache.evict(10) == 3
    cache.check()


def test_parent_becomes_evictable_after_its_children_go() -> None:
    pool, cache = make()
    (a,) = finish(pool, cache, [1, 2])
    finish(pool, cache, [1, 2, 3, 4])
    finish(pool, cache, [1, 2, 5, 6])
    assert num_evictable_blocks(cache) == 3
    assert cache.evict(2) == 2
    assert cache.owned_blocks() == {a}
    assert cache.evict(1) == 1
    assert num_cached_blocks(cache) == 0 and pool.num_free == pool.num_blocks
    cache.check()


def test_evict_counts_only_blocks_actually_freed() -> None:
    pool, cache = make()
    held = pool.allocate(2)
    cache.insert([1, 2, 3, 4], held)  # a running sequence holds them and did not lock
    (c,) = finish(pool, cache, [5, 5])
    assert cache.evict(1) == 1  # LRU: the held blocks go first, freeing nothing, then c
    assert num_cached_blocks(cache) == 0
    assert [pool.refcount(b) for b in held] == [1, 1] and pool.refcount(c) == 0
    cache.check()
    pool.check()


def test_unlock_and_lock_errors() -> None:
    pool, cache = make()
    finish(pool, cache, [1, 2])
    h = cache.match([1, 2]).handle
    with pytest.raises(ValueError):
        cache.unlock(h)
    cache.evict(1)
    with pytest.raises(ValueError):
        cache.lock(h)  # evicted: stale
    other = RadixCache(pool, BS)
    with pytest.raises(ValueError):
        other.lock(cache.match([]).handle)  # another tree's root
    with pytest.raises(ValueError):
        cache.evict(-1)
    cache.check()


def test_root_handle_can_be_locked() -> None:
    pool, cache = make()
    finish(pool, cache, [1, 2])
    root = cache.match([9, 9]).handle
    assert root.num_tokens == 0
    cache.lock(root)
    assert cache.evict(1) == 1  # the root protects nothing
    cache.unlock(root)
    cache.check()


def test_handles_compare_by_position() -> None:
    pool, cache = make()
    h = cache.insert([1, 2], pool.allocate(1))
    assert h == cache.match([1, 2, 3]).handle
    assert hash(h) == hash(cache.match([1, 2]).handle)
    assert h != cache.match([]).handle
    assert isinstance(h, CacheHandle) and "2" in repr(h)


def test_block_size_must_be_positive() -> None:
    with pytest.raises(ValueError):
        RadixCache(BlockPool(1), 0)
    with pytest.raises(ValueError):
        NullCache(0)


# ---- NullCache --------------------------------------------------------------------------------


def test_null_cache_caches_nothing() -> None:
    pool = BlockPool(8)
    cache = NullCache(BS)
    blocks = pool.allocate(2)
    h = cache.insert([1, 2, 3, 4], blocks)
    assert h.num_tokens == 0
    assert [pool.refcount(b) for b in blocks] == [1, 1]  # nothing adopted
    m = cache.match([1, 2, 3, 4])
    assert m.blocks == [] and m.num_tokens == 0 and m.handle == h
    cache.lock(m.handle)
    cache.unlock(m.handle)
    assert cache.evict(3) == 0
    assert num_cached_blocks(cache) == 0 and num_evictable_blocks(cache) == 0
    assert cache.owned_blocks() == set()
    cache.check()
    with pytest.raises(ValueError):
        cache.insert([1, 2, 3], blocks)
    with pytest.raises(ValueError):
        cache.evict(-1)


def test_make_prefix_cache() -> None:
    pool = BlockPool(4)
    assert isinstance(make_prefix_cache(pool, BS, enabled=True), RadixCache)
    assert isinstance(make_prefix_cache(pool, BS, enabled=False), NullCache)


# ---- random operations against a brute-force model -----------------------------------------


class Model:
    """The cache as a dict of whole-block prefixes, with LRU stamps and lock counts per prefix.

    Eviction removes one block at a time: the unlocked leaf prefix with the oldest stamp.
    """

    def __init__(self, block_size: int) -> None:
        self.bs = block_size
        self.blocks: dict[tuple[int, ...], int] = {}
        self.stamp: dict[tuple[int, ...], int] = {}
        self.locks: Counter[tuple[int, ...]] = Counter()
        self.num_children: Counter[tuple[int, ...]] = Counter()
        self.clock = 0

    def prefixes(self, tokens: Sequence[int], n: int) -> list[tuple[int, ...]]:
        return [tuple(tokens[: k * self.bs]) for k in range(1, n + 1)]

    def match(self, tokens: Sequence[int], max_blocks: int | None) -> list[int]:
        n = len(tokens) // self.bs
        if max_blocks is not None:
            n = min(n, max_blocks)
        self.clock += 1
        out = []
        for p in self.prefixes(tokens, n):
            if p not in self.blocks:
                break
            out.append(self.blocks[p])
            self.stamp[p] = self.clock
        return out

    def insert(self, tokens: Sequence[int], blocks: Sequence[int]) -> list[int]:
        """Returns the blocks adopted."""
        self.clock += 1
        adopted = []
        for p, b in zip(self.prefixes(tokens, len(blocks)), blocks, strict=True):
            if p not in self.blocks:
                self.blocks[p] = b
                self.num_children[p[: -self.bs]] += 1
                adopted.append(b)
            self.stamp[p] = self.clock
        return adopted

    def lock(self, tokens: Sequence[int], delta: int) -> None:
        for p in self.prefixes(tokens, len(tokens) // self.bs):
            self.locks[p] += delta
            assert self.locks[p] >= 0

    def evict(self, num_blocks: int, held: Counter[int]) -> int:
        freed = 0
        while freed < num_blocks:
            leaves = [p for p in self.blocks if self.num_children[p] == 0 and self.locks[p] == 0]
            if not leaves:
                break
            oldest = min(self.stamp[p] for p in leaves)
            (p,) = [q for q in leaves if self.stamp[q] == oldest]  # never a tie
            b = self.blocks.pop(p)
            del self.stamp[p]
            self.num_children[p[: -self.bs]] -= 1
            if held[b] == 0:
                freed += 1
        return freed

    @property
    def num_evictable(self) -> int:
        return sum(1 for p in self.blocks if self.locks[p] == 0)


@dataclass
class Holder:
    """A running sequence: blocks it holds a reference to, and the handle it has locked."""

    tokens: tuple[int, ...]  # the prefix its handle covers
    handle: CacheHandle | None  # None: holds its blocks without a lock
    blocks: list[int]


def random_tokens(rng: random.Random, model: Model, alphabet: int, max_blocks: int) -> list[int]:
    """Tokens that often share a prefix with something cached, with a partial tail sometimes."""
    bs = model.bs
    if model.blocks and rng.random() < 0.6:
        base = list(rng.choice(list(model.blocks)))
        base = base[: rng.randint(0, len(base) // bs) * bs]
    else:
        base = []
    extra = rng.randint(0, max_blocks * bs + bs - 1)
    return base + [rng.randrange(alphabet) for _ in range(extra)]


@pytest.mark.parametrize(
    ("block_size", "alphabet", "num_blocks", "seed"),
    [(2, 2, 40, 0), (2, 3, 48, 1), (1, 3, 24, 2), (3, 2, 40, 3)],
)
def test_random_operations_match_the_model(
    block_size: int, alphabet: int, num_blocks: int, seed: int
) -> None:
    rng = random.Random(seed)
    pool = BlockPool(num_blocks)
    cache = RadixCache(pool, block_size)
    model = Model(block_size)
    holders: list[Holder] = []
    bs = block_size

    def held() -> Counter[int]:
        return Counter(b for h in holders for b in h.blocks)

    def evict(n: int) -> int:
        expected = model.evict(n, held())
        got = cache.evict(n)
        assert got == expected
        return got

    def lock(h: Holder) -> None:
        assert h.handle is not None
        cache.lock(h.handle)
        model.lock(h.tokens, +1)

    def release(h: Holder) -> None:
        holders.remove(h)
        if h.handle is not None:
            cache.unlock(h.handle)
            model.lock(h.tokens, -1)
        pool.decref(h.blocks)

    def run_sequence() -> None:
        """Admit a sequence (match, lock, allocate), publish some blocks, maybe finish it."""
        tokens = random_tokens(rng, model, alphabet, 5)
        max_blocks = rng.choice([None, rng.randint(0, 4)])
        m = cache.match(tokens, max_blocks)
        assert m.blocks == model.match(tokens, max_blocks)
        assert m.num_tokens == len(m.blocks) * bs
        pool.incref(m.blocks)
        h = Holder(tuple(tokens[: m.num_tokens]), m.handle, list(m.blocks))
        holders.append(h)
        lock(h)
        n = len(tokens) // bs
        if rng.random() < 0.2:
            # Computed elsewhere: fresh blocks for the whole sequence, even the cached part.
            need, reuse = n, []
        else:
            need, reuse = n - len(m.blocks), list(m.blocks)
        if not pool.can_allocate(need):
            evict(need - pool.num_free)
        if not pool.can_allocate(need):
            release(h)  # no room: give up, as a scheduler would wait
            return
        fresh = pool.allocate(need)
        h.blocks += fresh
        blocks = reuse + fresh
        k = rng.randint(0, n) if rng.random() < 0.3 else n  # sometimes publish only a part
        new_handle = cache.insert(tokens[: k * bs], blocks[:k])
        model.insert(tokens[: k * bs], blocks[:k])
        assert new_handle.num_tokens == k * bs
        # Hand the lock over: lock the new handle first, then unlock the old one.
        old_tokens, old_handle = h.tokens, h.handle
        assert old_handle is not None
        h.tokens, h.handle = tuple(tokens[: k * bs]), new_handle
        lock(h)
        cache.unlock(old_handle)
        model.lock(old_tokens, -1)
        if rng.random() < 0.15:
            # Keeps its blocks but drops the lock: the tree may drop them, unfreed, meanwhile.
            cache.unlock(new_handle)
            model.lock(h.tokens, -1)
            h.handle = None
        if len(holders) > 5 or rng.random() < 0.5:
            release(h)

    for _ in range(3000):
        op = rng.random()
        if op < 0.5:
            run_sequence()
        elif op < 0.65:
            tokens = random_tokens(rng, model, alphabet, 5)
            max_blocks = rng.choice([None, rng.randint(0, 4)])
            assert cache.match(tokens, max_blocks).blocks == model.match(tokens, max_blocks)
        elif op < 0.75:
            # Pin a cached prefix without holding its blocks.
            tokens = random_tokens(rng, model, alphabet, 5)
            m = cache.match(tokens)
            assert m.blocks == model.match(tokens, None)
            h = Holder(tuple(tokens[: m.num_tokens]), m.handle, [])
            holders.append(h)
            lock(h)
        elif op < 0.88:
            if holders:
                release(rng.choice(holders))
        else:
            evict(rng.randint(0, 6))

        cache.check()
        pool.check()
        assert tree_content(cache) == model.blocks
        assert num_cached_blocks(cache) == len(model.blocks)
        assert num_evictable_blocks(cache) == model.num_evictable
        owned = cache.owned_blocks()
        counts = held()
        for b in range(num_blocks):
            assert pool.refcount(b) == (b in owned) + counts[b]

    for h in list(holders):
        release(h)
    assert num_evictable_blocks(cache) == num_cached_blocks(cache)
    assert cache.evict(num_blocks) == len(model.blocks)
    assert num_cached_blocks(cache) == 0
    assert pool.num_free == pool.num_blocks
    cache.check()
    pool.check()
