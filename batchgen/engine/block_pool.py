"""Fixed-size KV blocks: a free list and a reference count per block.

A block is an integer id in ``range(num_blocks)``; the KV tensors live in the model runner, this
class only decides who owns which block. Every holder of a block (a sequence's block table, a
radix-tree node) holds one reference. Invariant: a block is on the free list iff its count is 0.
No torch here: the pool is tested in milliseconds.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable


class OutOfBlocks(RuntimeError):
    """Raised by allocate() when fewer blocks are free than asked for (a scheduler bug)."""


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._refcounts = [0] * num_blocks
        # FIFO free list: a freed block is reused last. (A free block is never in the prefix
        # cache: the tree holds a reference on every block it owns.)
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks, each with reference count 1."""
        if n > len(self._free):
            raise OutOfBlocks(f"asked for {n} blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self._refcounts[b] = 1
        return blocks

    def incref(self, blocks: Iterable[int]) -> None:
        for b in blocks:
            assert self._refcounts[b] > 0, f"incref of free block {b}"
            self._refcounts[b] += 1

    def decref(self, blocks: Iterable[int]) -> int:
        """Drop one reference from each block; return how many blocks became free."""
        freed = 0
        for b in blocks:
            count = self._refcounts[b] - 1
            assert count >= 0, f"decref of free block {b}"
            self._refcounts[b] = count
            if count == 0:
                self._free.append(b)
                freed += 1
        return freed

    def refcount(self, block: int) -> int:
        return self._refcounts[block]

    def check(self) -> None:
        """Assert the pool's invariants (free list == blocks with count 0, no duplicates)."""
        free = set(self._free)
        assert len(free) == len(self._free), "a block is on the free list twice"
        for b, count in enumerate(self._refcounts):
            assert count >= 0, f"block {b} has negative count {count}"
            assert (count == 0) == (b in free), f"block {b}: count {count}, free={b in free}"
