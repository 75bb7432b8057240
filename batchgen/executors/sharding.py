"""Sharding a round of rows over Ray workers by shared prompt prefix.

A round starts as one group; a group is split by its next block (``engine.block_size`` tokens)
only while it alone costs more than one worker's fair share of the round (cost: prompt tokens +
n * max_tokens). Rows sharing a prefix therefore stay together unless keeping them together would
leave workers idle. Groups go to workers largest first, each to the worker with the least
outstanding work, or to the worker that ran the same prefix in an earlier round while that keeps
the balance. Plain data: no Ray, no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from batchgen.prompts import EncodedRow

STICKY_KEYS = 100_000  # prefixes remembered across rounds (oldest forgotten first)


@dataclass
class PrefixGroup:
    """Rows whose prompts start with ``key`` (whole blocks, or a whole prompt at the end)."""

    key: tuple[int, ...]
    rows: list[EncodedRow]
    cost: int


def group_by_prefix(
    rows: Sequence[EncodedRow], block_size: int, limit: float, cost: Callable[[EncodedRow], int]
) -> list[PrefixGroup]:
    """Split ``rows`` (all with tokens) into groups sharing their leading blocks.

    All rows start as one group; a group costing more than ``limit`` is split by the next
    ``block_size`` tokens of its prompts, until it costs ``limit`` or less. Identical prompts
    costing more than ``limit`` are split into runs of rows (each piece then computes the prompt
    once). Every row lands in exactly one group; within a group, rows keep their input order.
    """
    out: list[PrefixGroup] = []
    todo: list[tuple[tuple[int, ...], list[EncodedRow], int]] = [((), list(rows), 0)]
    while todo:
        key, members, depth = todo.pop()
        total = sum(cost(r) for r in members)
        lo = depth * block_size
        assert all(r.tokens is not None for r in members)
        if total <= limit:
            out.append(PrefixGroup(key, members, total))
            continue
        if all(len(r.tokens) <= lo for r in members):  # type: ignore[arg-type]
            piece: list[EncodedRow] = []
            piece_cost = 0
            for r in members:
                if piece and piece_cost + cost(r) > limit:
                    out.append(PrefixGroup(key, piece, piece_cost))
                    piece, piece_cost = [], 0
                piece.append(r)
                piece_cost += cost(r)
            out.append(PrefixGroup(key, piece, piece_cost))
            continue
        parts: dict[tuple[int, ...], list[EncodedRow]] = {}
        for r in members:
            parts.setdefault(tuple(r.tokens[lo : lo + block_size]), []).append(r)  # type: ignore[index]
        todo.extend((key + chunk, sub, depth + 1) for chunk, sub in parts.items())
    return out


class Planner:
    """Assigns the prefix groups of each round to workers (see the module's docstring)."""

    def __init__(self, block_size: int, n: int, max_tokens: int) -> None:
        self.block_size = block_size
        self.decode_cost = n * max_tokens
        self.sticky: dict[tuple[int, ...], int] = {}  # prefix -> the worker that ran it

    def cost(self, row: EncodedRow) -> int:
        assert row.tokens is not None
        return len(row.tokens) + self.decode_cost

    def plan(
        self, rows: Sequence[EncodedRow], load: dict[int, int]
    ) -> dict[int, list[PrefixGroup]]:
        """``load``: the outstanding cost of each live worker (updated here as groups land)."""
        workers = sorted(load)
        limit = sum(self.cost(r) for r in rows) / len(workers)
        groups = group_by_prefix(rows, self.block_size, limit, self.cost)
        groups.sort(key=lambda g: (-g.cost, g.key))
        shards: dict[int, list[PrefixGroup]] = {w: [] for w in workers}
        for g in groups:
            least = min(workers, key=lambda w: (load[w], w))
            w = self.sticky.get(g.key, least)
            if w not in load or load[w] - load[least] > limit:
                w = least
            shards[w].append(g)
            load[w] += g.cost
            if g.key and len(g.rows) > 1:
                self.sticky.pop(g.key, None)
                self.sticky[g.key] = w
                if len(self.sticky) > STICKY_KEYS:
                    del self.sticky[next(iter(self.sticky))]
        return shards


def common_prefix(seqs: Sequence[Sequence[int]]) -> Sequence[int]:
    """The longest prefix all of ``seqs`` share (that of the lexicographic least and greatest)."""
    lo, hi = min(seqs), max(seqs)
    for i, (a, b) in enumerate(zip(lo, hi, strict=False)):
        if a != b:
            return lo[:i]
    return lo[: min(len(lo), len(hi))]
