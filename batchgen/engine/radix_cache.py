"""The prefix cache: a radix tree over token ids whose nodes own KV blocks.

Keys are block-aligned: a node's key holds a whole number of blocks' worth of tokens and the node
owns exactly ``len(key) // block_size`` block ids, block ``i`` covering key tokens
``[i * block_size, (i + 1) * block_size)``. The partly filled tail of a sequence is never cached,
but a prefix that ends inside a cached block can still reuse that block's first tokens
(``match_partial``: the scheduler copies them).
The tree holds ONE pool reference per block it owns; eviction drops that reference.

How the scheduler uses it (single-threaded; no torch here):

1. ``m = cache.match(prompt, max_blocks=...)``; ``pool.incref(m.blocks)``; ``cache.lock(m.handle)``.
   Lock right after match, before anything can call ``evict``: an unlocked handle may be evicted.
   ``m.num_tokens`` tokens of the prompt need no prefill; ``cache.match_partial(m.handle, ...)``
   may add up to ``block_size - 1`` more, to copy out of a block that is incref'd at once.
2. Blocks for the rest come from ``pool.allocate``; if it falls short, ``cache.evict(k)`` and check
   the number it returns (blocks also held by an unlocked sequence are dropped by the tree but
   not freed).
3. Whenever a step has filled more of a sequence's blocks with known tokens (the scheduler
   publishes them at once, ``Scheduler._cache_full_blocks`` after each step):
   ``h = cache.insert(tokens[:n * bs], blocks[:n])``; ``cache.lock(h)``; ``cache.unlock(old)``
   (lock the new handle before unlocking the old one); when it is done with its blocks,
   ``cache.unlock(h)`` and ``pool.decref(its blocks)``. Where the tree already held a prefix with
   other block ids, the sequence's own blocks for that part are not adopted: they are freed by
   that final decref.

With that discipline (every sequence that holds tree blocks locks a handle covering them) every
unlocked tree block has reference count 1, so the blocks of unlocked nodes are exactly what
eviction can return to the pool; otherwise they are an upper bound.

``NullCache`` has the same interface and caches nothing (``prefix_caching: false``), so callers
never branch on whether caching is on; ``make_prefix_cache`` picks one.

One noun in one file: the tree, its lock counts, its LRU of evictable leaves and
the null cache for "caching off" keep one invariant together (``check``).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from typing import NamedTuple, Protocol

from batchgen.engine.block_pool import BlockPool

# How many of a node's most recently added children match_partial compares (each costs up to a
# block of token comparisons; rows sharing a prefix are admitted together, so their siblings
# are recent).
_PARTIAL_SCAN = 32


class _Node:
    """One edge of the tree together with the node it leads to.

    Invariants (checked by ``RadixCache.check``):
    - ``len(key) % block_size == 0``, ``len(blocks) == len(key) // block_size``; only the root has
      an empty key;
    - ``parent.children[key[:block_size]] is self`` (children are keyed by their first block);
    - ``end == parent.end + len(key)``: the number of tokens from the root to this node's end.
      A node's ``end`` never changes (a split inserts the new node above), so handles stay valid;
    - ``lock_count == own_locks + sum(child.lock_count)``: a lock on a node counts on every
      ancestor, so a locked node's whole path to the root is locked;
    - ``last_access <= parent.last_access``: every touch stamps the whole path from the root.
    """

    __slots__ = (
        "key",
        "blocks",
        "children",
        "parent",
        "end",
        "lock_count",
        "own_locks",
        "last_access",
        "uid",
    )

    def __init__(
        self,
        key: tuple[int, ...],
        blocks: list[int],
        parent: _Node | None,
        end: int,
        last_access: int,
        uid: int,
    ) -> None:
        self.key = key
        self.blocks = blocks
        self.children: dict[tuple[int, ...], _Node] = {}
        # None for the root and for a node that has been evicted (detached from the tree).
        self.parent = parent
        self.end = end
        self.lock_count = 0  # locks on this node or any descendant
        self.own_locks = 0  # locks taken through a handle of exactly this node
        self.last_access = last_access  # logical clock, not wall time: deterministic LRU
        self.uid = uid  # creation order: a tie-breaker in the eviction heap


class CacheHandle:
    """An opaque reference to a point in the tree: the end of a cached prefix.

    Compare handles with ``==`` (same point in the tree). The root handle (``num_tokens == 0``)
    means "nothing cached". A handle stays valid while its node is locked; an unlocked handle
    may be evicted and must not be locked afterwards.
    """

    __slots__ = ("_node",)

    def __init__(self, node: _Node) -> None:
        self._node = node

    @property
    def num_tokens(self) -> int:
        """Tokens from the start of the sequence to this point (a multiple of the block size)."""
        return self._node.end

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CacheHandle) and other._node is self._node

    def __hash__(self) -> int:
        return id(self._node)

    def __repr__(self) -> str:
        return f"CacheHandle(num_tokens={self._node.end})"


class PrefixMatch(NamedTuple):
    """The longest cached whole-block prefix of some tokens."""

    blocks: list[int]  # block ids of the prefix, in order; a fresh list the caller may keep
    handle: CacheHandle  # the node ending exactly at the end of the prefix

    @property
    def num_tokens(self) -> int:
        """``len(blocks) * block_size``: the tokens that need no prefill."""
        return self.handle.num_tokens


class PrefixCache(Protocol):
    """What the scheduler sees of a prefix cache: ``RadixCache`` or ``NullCache``."""

    block_size: int

    def match(self, tokens: Sequence[int], max_blocks: int | None = None) -> PrefixMatch: ...

    def match_partial(
        self, handle: CacheHandle, tokens: Sequence[int], limit: int
    ) -> tuple[int, int] | None: ...

    def insert(self, tokens: Sequence[int], blocks: Sequence[int]) -> CacheHandle: ...

    def lock(self, handle: CacheHandle) -> None: ...

    def unlock(self, handle: CacheHandle) -> None: ...

    def evict(self, num_blocks: int) -> int: ...

    def owned_blocks(self) -> set[int]: ...

    def check(self) -> None: ...


def _check_insert_args(tokens: Sequence[int], blocks: Sequence[int], block_size: int) -> None:
    if len(tokens) != len(blocks) * block_size:
        raise ValueError(
            f"insert needs whole blocks: {len(tokens)} tokens for {len(blocks)} blocks "
            f"of {block_size}"
        )


class RadixCache:
    """A radix tree of cached prefixes with LRU eviction of unlocked leaves.

    Eviction never walks the tree: ``_evictable`` is exactly the set of unlocked non-root leaves
    and ``_heap`` orders them by ``(last_access, uid)``. Heap entries are invalidated lazily: an
    entry counts only while its node is in ``_evictable`` and its stamp equals the node's
    ``last_access``; every node in ``_evictable`` has such an entry (pushed whenever the node
    enters the set or is touched while in it).
    """

    def __init__(self, pool: BlockPool, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self._pool = pool
        self._clock = itertools.count(1)
        self._uids = itertools.count()
        self._root = _Node((), [], None, 0, 0, next(self._uids))
        self._owned: set[int] = set()  # every block id owned by some node
        self._num_locked_blocks = 0  # blocks of nodes with lock_count > 0
        self._evictable: set[_Node] = set()
        self._heap: list[tuple[int, int, _Node]] = []

    # ---- queries -------------------------------------------------------------------------------

    def owned_blocks(self) -> set[int]:
        """A copy of the set of block ids the tree owns (for the engine's accounting check)."""
        return set(self._owned)

    # ---- match / insert ------------------------------------------------------------------------

    def match(self, tokens: Sequence[int], max_blocks: int | None = None) -> PrefixMatch:
        """The longest cached whole-block prefix of ``tokens``, of at most ``max_blocks`` blocks.

        Stamps the matched path as recently used; splits a node where the match ends inside it,
        so the handle ends exactly at the prefix. Neither increfs nor locks: the caller increfs
        the blocks it keeps and locks the handle.
        """
        bs = self.block_size
        n = len(tokens) // bs
        if max_blocks is not None:
            if max_blocks < 0:
                raise ValueError(f"max_blocks must be >= 0, got {max_blocks}")
            n = min(n, max_blocks)
        toks = tuple(tokens[: n * bs])
        tick = next(self._clock)
        node = self._root
        self._touch(node, tick)
        blocks: list[int] = []
        pos = 0
        while pos < len(toks):
            child = node.children.get(toks[pos : pos + bs])
            if child is None:
                break
            common = self._common_blocks(child.key, toks, pos)
            if common < len(child.blocks):
                child = self._split(child, common)
            self._touch(child, tick)
            blocks.extend(child.blocks)
            pos += len(child.key)
            node = child
            # After a split the lower part's first block differs from toks (or toks ended), so
            # the next lookup fails or the loop ends.
        return PrefixMatch(blocks, CacheHandle(node))

    def match_partial(
        self, handle: CacheHandle, tokens: Sequence[int], limit: int
    ) -> tuple[int, int] | None:
        """A cached block continuing ``handle``'s prefix whose first ``j`` tokens equal the next
        ``j`` of ``tokens`` (``tokens[handle.num_tokens:]``), ``1 <= j <= min(limit,
        block_size - 1)``: ``(block id, j)`` with the largest j among the ``_PARTIAL_SCAN`` most
        recently added continuations, or None.

        Where a shared prefix ends inside a block (a template whose length is no multiple of
        the block size) the caller copies those j tokens' K/V out of the block instead of
        computing them again; the rest of the block belongs to another sequence. Neither
        increfs, locks nor stamps: incref the block before anything can evict.
        """
        bs = self.block_size
        start = handle.num_tokens
        want = tuple(tokens[start : start + min(limit, bs - 1)])
        if not want:
            return None
        best: tuple[int, int] | None = None
        for n, key in enumerate(reversed(handle._node.children)):
            if n == _PARTIAL_SCAN:
                break
            j = 0
            while j < len(want) and key[j] == want[j]:
                j += 1
            if j and (best is None or j > best[1]):
                best = (handle._node.children[key].blocks[0], j)
                if j == len(want):
                    break
        return best

    def insert(self, tokens: Sequence[int], blocks: Sequence[int]) -> CacheHandle:
        """Cache ``tokens`` (whole blocks) with the caller's ``blocks``; return the node at the end.

        Where the tree already holds a prefix of ``tokens`` it keeps its own blocks (possibly
        other ids computed elsewhere) and ignores the caller's for that part; the rest becomes a
        new leaf that adopts the caller's block ids (one tree reference each, via incref).
        Stamps the whole path as recently used.
        """
        bs = self.block_size
        _check_insert_args(tokens, blocks, bs)
        toks = tuple(tokens)
        tick = next(self._clock)
        node = self._root
        self._touch(node, tick)
        pos = 0
        while pos < len(toks):
            child = node.children.get(toks[pos : pos + bs])
            if child is None:
                node = self._add_leaf(node, toks[pos:], blocks[pos // bs :], tick)
                break
            common = self._common_blocks(child.key, toks, pos)
            if common < len(child.blocks):
                child = self._split(child, common)
            self._touch(child, tick)
            pos += len(child.key)
            node = child
        return CacheHandle(node)

    # ---- locks ---------------------------------------------------------------------------------

    def lock(self, handle: CacheHandle) -> None:
        """Protect the handle's node and all its ancestors from eviction (counted: nestable)."""
        path = self._path_to_root(handle)
        path[0].own_locks += 1
        for node in path:
            if node.lock_count == 0 and node is not self._root:
                self._num_locked_blocks += len(node.blocks)
                self._evictable.discard(node)
            node.lock_count += 1

    def unlock(self, handle: CacheHandle) -> None:
        """Undo one ``lock`` of the same handle."""
        path = self._path_to_root(handle)
        if path[0].own_locks == 0:
            raise ValueError(f"unlock of {handle!r}, which is not locked")
        path[0].own_locks -= 1
        for node in path:
            # lock_count >= own_locks of every node below: positive all along the path.
            node.lock_count -= 1
            if node.lock_count == 0 and node is not self._root:
                self._num_locked_blocks -= len(node.blocks)
                self._refresh_evictable(node)

    # ---- eviction ------------------------------------------------------------------------------

    def evict(self, num_blocks: int) -> int:
        """Drop least recently used unlocked leaves until ``num_blocks`` blocks are freed.

        Returns the number of blocks actually returned to the pool: fewer than asked when nothing
        evictable remains, since blocks a sequence still holds are dropped but not freed. A leaf
        longer than needed is split and only its tail dropped; a parent left as an unlocked
        leaf becomes evictable in its turn.
        """
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        freed = 0
        while freed < num_blocks:
            node = self._pop_lru()
            if node is None:
                break
            wanted = num_blocks - freed
            if wanted < len(node.blocks):
                # Keep the head: it gets the same stamp and becomes the next LRU leaf.
                self._split(node, len(node.blocks) - wanted)
            freed += self._remove_leaf(node)
        return freed

    # ---- invariants ----------------------------------------------------------------------------

    def check(self) -> None:
        """Assert every invariant of the tree, its counters and the eviction structures."""
        bs = self.block_size
        root = self._root
        assert root.parent is None and root.key == () and not root.blocks and root.end == 0
        seen: set[int] = set()
        locked_blocks = 0
        unlocked_leaves: set[_Node] = set()
        stack = [root]
        while stack:
            node = stack.pop()
            child_locks = 0
            for first, child in node.children.items():
                assert child.parent is node, "child's parent pointer is wrong"
                assert len(first) == bs and child.key[:bs] == first, "child under the wrong key"
                assert child.key and len(child.key) % bs == 0, f"key length {len(child.key)}"
                assert len(child.blocks) == len(child.key) // bs, "blocks do not match the key"
                assert child.end == node.end + len(child.key), "wrong end offset"
                assert child.last_access <= node.last_access, "child touched after its parent"
                child_locks += child.lock_count
                stack.append(child)
            assert node.own_locks >= 0
            assert node.lock_count == node.own_locks + child_locks, "inconsistent lock counts"
            if node is root:
                continue
            for b in node.blocks:
                assert b not in seen, f"block {b} owned twice"
                assert self._pool.refcount(b) >= 1, f"owned block {b} is free in the pool"
                seen.add(b)
            if node.lock_count > 0:
                locked_blocks += len(node.blocks)
            elif not node.children:
                unlocked_leaves.add(node)
        assert seen == self._owned, "owned-block set out of date"
        assert locked_blocks == self._num_locked_blocks, "locked-block counter out of date"
        assert unlocked_leaves == self._evictable, "evictable set != unlocked leaves"
        live = {(stamp, id(node)) for stamp, _, node in self._heap}
        for node in self._evictable:
            assert (node.last_access, id(node)) in live, "evictable leaf missing from the heap"

    # ---- internals -----------------------------------------------------------------------------

    def _common_blocks(self, key: tuple[int, ...], toks: tuple[int, ...], pos: int) -> int:
        """Whole blocks shared by ``key`` and ``toks[pos:]`` (the first is known to match)."""
        bs = self.block_size
        n = min(len(key), len(toks) - pos) // bs
        if key[: n * bs] == toks[pos : pos + n * bs]:
            return n
        i = 1
        while key[i * bs : (i + 1) * bs] == toks[pos + i * bs : pos + (i + 1) * bs]:
            i += 1
        return i

    def _split(self, node: _Node, nblocks: int) -> _Node:
        """Cut ``node`` after its first ``nblocks`` blocks; return the new upper node.

        ``node`` keeps the lower part and its ``end``, so handles to it stay valid; the upper
        node inherits the lock count (every lock through ``node`` passes through it) and the
        stamp. Owned blocks, the locked-block count and the evictable set are unchanged.
        """
        assert 0 < nblocks < len(node.blocks)
        parent = node.parent
        assert parent is not None
        bs = self.block_size
        cut = nblocks * bs
        upper = _Node(
            node.key[:cut],
            node.blocks[:nblocks],
            parent,
            node.end - len(node.key) + cut,
            node.last_access,
            next(self._uids),
        )
        upper.lock_count = node.lock_count
        parent.children[upper.key[:bs]] = upper  # replaces node: same first block
        node.key = node.key[cut:]
        node.blocks = node.blocks[nblocks:]
        node.parent = upper
        upper.children[node.key[:bs]] = node
        return upper

    def _add_leaf(
        self, parent: _Node, key: tuple[int, ...], blocks: Sequence[int], tick: int
    ) -> _Node:
        new_blocks = list(blocks)
        if len(set(new_blocks)) != len(new_blocks) or not self._owned.isdisjoint(new_blocks):
            raise ValueError(f"insert of blocks already owned or repeated: {new_blocks}")
        if any(self._pool.refcount(b) == 0 for b in new_blocks):
            raise ValueError(f"insert of a free block: {new_blocks}")
        self._pool.incref(new_blocks)
        self._owned.update(new_blocks)
        leaf = _Node(key, new_blocks, parent, parent.end + len(key), tick, next(self._uids))
        parent.children[key[: self.block_size]] = leaf
        self._evictable.discard(parent)  # no longer a leaf
        self._refresh_evictable(leaf)
        return leaf

    def _remove_leaf(self, node: _Node) -> int:
        """Detach an unlocked leaf, drop the tree's references; return blocks actually freed."""
        assert not node.children and node.lock_count == 0
        parent = node.parent
        assert parent is not None
        self._evictable.discard(node)
        del parent.children[node.key[: self.block_size]]
        node.parent = None  # detached: a stale handle to it can no longer be locked
        self._owned.difference_update(node.blocks)
        freed = self._pool.decref(node.blocks)
        self._refresh_evictable(parent)
        return freed

    def _touch(self, node: _Node, tick: int) -> None:
        node.last_access = tick
        if node in self._evictable:
            self._push(node)  # the old entry is now stale

    def _refresh_evictable(self, node: _Node) -> None:
        """Put ``node`` in the evictable set iff it is an unlocked non-root leaf."""
        if node is not self._root and not node.children and node.lock_count == 0:
            if node not in self._evictable:
                self._evictable.add(node)
                self._push(node)
        else:
            self._evictable.discard(node)

    def _push(self, node: _Node) -> None:
        heapq.heappush(self._heap, (node.last_access, node.uid, node))
        if len(self._heap) > 2 * len(self._evictable) + 64:
            # Too many stale entries: rebuild from the live set (amortized O(1) per push).
            self._heap = [(n.last_access, n.uid, n) for n in self._evictable]
            heapq.heapify(self._heap)

    def _pop_lru(self) -> _Node | None:
        """Remove and return the least recently used evictable leaf, or None if there is none."""
        while self._heap:
            stamp, _, node = heapq.heappop(self._heap)
            if node in self._evictable and stamp == node.last_access:
                self._evictable.discard(node)
                return node
        return None

    def _path_to_root(self, handle: CacheHandle) -> list[_Node]:
        """The handle's node and its ancestors, root last; refuses a handle not in this tree."""
        path = [handle._node]
        while (parent := path[-1].parent) is not None:
            path.append(parent)
        if path[-1] is not self._root:
            raise ValueError(f"{handle!r} is not in this cache (evicted or foreign)")
        return path


class NullCache:
    """The prefix cache for ``prefix_caching: false``: caches nothing, owns no blocks."""

    def __init__(self, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self._root = CacheHandle(_Node((), [], None, 0, 0, 0))

    def owned_blocks(self) -> set[int]:
        return set()

    def match(self, tokens: Sequence[int], max_blocks: int | None = None) -> PrefixMatch:
        """Always nothing: no blocks and the root handle."""
        if max_blocks is not None and max_blocks < 0:
            raise ValueError(f"max_blocks must be >= 0, got {max_blocks}")
        return PrefixMatch([], self._root)

    def match_partial(
        self, handle: CacheHandle, tokens: Sequence[int], limit: int
    ) -> tuple[int, int] | None:
        """Always None."""
        return None

    def insert(self, tokens: Sequence[int], blocks: Sequence[int]) -> CacheHandle:
        """Adopts nothing: the caller keeps sole ownership of its blocks."""
        _check_insert_args(tokens, blocks, self.block_size)
        return self._root

    def lock(self, handle: CacheHandle) -> None:
        pass

    def unlock(self, handle: CacheHandle) -> None:
        pass

    def evict(self, num_blocks: int) -> int:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        return 0

    def check(self) -> None:
        pass


def make_prefix_cache(pool: BlockPool, block_size: int, enabled: bool) -> PrefixCache:
    """A ``RadixCache`` over ``pool`` when prefix caching is on, else a ``NullCache``."""
    return RadixCache(pool, block_size) if enabled else NullCache(block_size)
