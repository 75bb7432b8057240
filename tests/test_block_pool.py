"""BlockPool: allocation, reference counts, the free list and its invariant check."""

from __future__ import annotations

import random

import pytest

from batchgen.engine.block_pool import BlockPool, OutOfBlocks


def test_needs_a_block() -> None:
    with pytest.raises(ValueError):
        BlockPool(0)


def test_allocate_gives_distinct_blocks_with_count_one() -> None:
    pool = BlockPool(8)
    blocks = pool.allocate(5)
    assert len(set(blocks)) == 5
    assert all(0 <= b < 8 for b in blocks)
    assert all(pool.refcount(b) == 1 for b in blocks)
    assert pool.num_free == 3 and pool.num_used == 5
    pool.check()


def test_allocate_zero_is_empty() -> None:
    pool = BlockPool(2)
    assert pool.allocate(0) == []
    assert pool.num_free == 2


def test_out_of_blocks_takes_nothing() -> None:
    pool = BlockPool(4)
    pool.allocate(3)
    assert pool.can_allocate(1) and not pool.can_allocate(2)
    with pytest.raises(OutOfBlocks):
        pool.allocate(2)
    assert pool.num_free == 1  # a failed allocate leaves the pool as it was
    pool.check()


def test_incref_decref_frees_only_at_zero() -> None:
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    pool.incref([a, a, b])
    assert pool.refcount(a) == 3 and pool.refcount(b) == 2
    assert pool.decref([a, b]) == 0
    assert pool.decref([a, b]) == 1  # b reaches zero
    assert pool.refcount(b) == 0 and pool.num_free == 3
    assert pool.decref([a]) == 1
    assert pool.num_free == 4
    pool.check()


def test_freed_blocks_are_reused_last() -> None:
    pool = BlockPool(4)
    first = pool.allocate(2)
    pool.decref(first)
    # FIFO: the two never-used blocks come before the two just freed.
    assert pool.allocate(4) == [2, 3, *first]


def test_incref_or_decref_of_a_free_block_asserts() -> None:
    pool = BlockPool(2)
    with pytest.raises(AssertionError):
        pool.incref([0])
    with pytest.raises(AssertionError):
        pool.decref([0])
    pool.check()  # the failed calls changed nothing


def test_check_catches_corruption() -> None:
    pool = BlockPool(3)
    pool.allocate(1)
    pool._free.append(pool._free[0])  # a block on the free list twice
    with pytest.raises(AssertionError):
        pool.check()


def test_random_holders_return_every_block() -> None:
    rng = random.Random(0)
    pool = BlockPool(32)
    held: list[int] = []  # one entry per reference held by the test
    for _ in range(2000):
        op = rng.random()
        if op < 0.4:
            n = rng.randint(0, 6)
            if pool.can_allocate(n):
                held.extend(pool.allocate(n))
            else:
                with pytest.raises(OutOfBlocks):
                    pool.allocate(n)
        elif op < 0.6 and held:
            b = rng.choice(held)
            pool.incref([b])
            held.append(b)
        elif held:
            b = held.pop(rng.randrange(len(held)))
            pool.decref([b])
        for b in range(pool.num_blocks):
            assert pool.refcount(b) == held.count(b)
        pool.check()
    pool.decref(held)
    assert pool.num_free == pool.num_blocks
    assert all(pool.refcount(b) == 0 for b in range(pool.num_blocks))
    pool.check()
