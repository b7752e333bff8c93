"""Groups of ranks that hold the same shard, and per-rank values stored once per group.

Data-parallel replicas are a regular dimension of the layout: ranks tp apart hold the same shard of a
dense param, so the plan names the group (`Ranks`: first, step, count), never each member. What a rank
holds is looked up, not stored per rank: `RankValues` keeps one value per group of a periodic layout
(rank r holds values[r % len(values)]), `RankSpecs` is each rank's {param: spec} as a view over them.
Planning and the plan therefore cost the same at 8 ranks as at 4096 for the same model-parallel shape.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Mapping, Sequence
from typing import NamedTuple


class Ranks(NamedTuple):
    """The ranks first, first + step, ..., count of them: a group that holds one shard. (A tuple: planning
    hashes and compares groups hundreds of thousands of times.)"""
    first: int
    step: int = 1
    count: int = 1

    def __contains__(self, rank: int) -> bool:
        k, off = divmod(rank - self.first, self.step)
        return off == 0 and 0 <= k < self.count

    def members(self) -> range:
        return range(self.first, self.first + self.step * self.count, self.step)

    @property
    def last(self) -> int:
        return self.first + self.step * (self.count - 1)

    def nearest(self, rank: int) -> int:
        """The member in `rank`'s block of `step` ranks (rank itself when it is a member): where a reader
        delivers the group's bytes, so they leave its node only to fan out to the other replicas."""
        if rank in self:
            return rank
        k = rank // self.step - self.first // self.step   # blocks of `step` ranks, aligned at 0
        return self.first + self.step * min(self.count - 1, max(0, k))

    def on_node(self, node: int, local_world: int) -> int:
        """How many members run on `node` (local_world ranks per node, torchrun's numbering)."""
        part = self.part_on_node(node, local_world)
        return part.count if part else 0

    def part_on_node(self, node: int, local_world: int) -> "Ranks | None":
        """The members that run on `node`, as a group (None: none do; all of them when local_world is 0)."""
        if not local_world:
            return self
        lo = max(0, -(-(node * local_world - self.first) // self.step))
        hi = min(self.count - 1, -(-((node + 1) * local_world - self.first) // self.step) - 1)
        return Ranks(self.first + lo * self.step, self.step, hi - lo + 1) if hi >= lo else None

    @staticmethod
    def one(rank: int) -> "Ranks":
        return Ranks(rank, 1, 1)


@functools.lru_cache(maxsize=1 << 16)
def _group(first: int, step: int, count: int) -> Ranks:
    return Ranks(first, step, count)  # one object per group: planning names each group many times


@functools.lru_cache(maxsize=64)
def _groups(period: int, world: int) -> tuple[Ranks, ...]:
    return tuple(_group(i, period, world // period) for i in range(period))


class RankValues(Sequence):
    """Per rank of `world`, values[rank % len(values)]: ranks len(values) apart hold the same value.
    `make(i)` instead of `values` computes value i when first asked (cached)."""

    def __init__(self, values, world: int, make=None, period: int | None = None):
        self.period = len(values) if make is None else period
        if world % self.period:
            raise ValueError(f"period {self.period} does not divide world {world}")
        self.world, self._values, self._make = world, list(values) if make is None else {}, make

    def value(self, i: int):
        if self._make is None:
            return self._values[i]
        if i not in self._values:
            self._values[i] = self._make(i)
        return self._values[i]

    def group(self, i: int) -> Ranks:
        """The ranks that hold value i."""
        return _group(i, self.period, self.world // self.period)

    def groups(self) -> tuple[Ranks, ...]:
        """Per value, the ranks that hold it (one tuple per (period, world), however many params share it)."""
        return _groups(self.period, self.world)

    def __getitem__(self, rank: int):
        if not -self.world <= rank < self.world:
            raise IndexError(rank)
        return self.value(rank % self.period)

    def __len__(self) -> int:
        return self.world

    def map(self, fn) -> "RankValues":
        """fn applied to each value (lazily), same groups."""
        return RankValues((), self.world, make=lambda i: fn(self.value(i)), period=self.period)


def per_group(fn, *per_rank: RankValues) -> RankValues:
    """fn(value, ...) once per group of ranks holding equal values in each of `per_rank` (RankValues of one
    world; the period is the lcm of theirs), computed now, so that its errors surface while planning."""
    world = per_rank[0].world
    period = math.lcm(*(v.period for v in per_rank))
    columns = [_cycled(v, period) for v in per_rank]
    return RankValues([fn(*args) for args in zip(*columns)], world)


def _cycled(values: RankValues, period: int):
    """values' value for each of `period` groups, made as asked (lazy values in rank order, as fn sees them)."""
    if values._make is None:
        return itertools.islice(itertools.cycle(values._values), period)
    return (values.value(i % values.period) for i in range(period))


def unzipped(pairs: RankValues) -> tuple[RankValues, RankValues]:
    """RankValues of (a, b) pairs as (RankValues of a, RankValues of b), same groups."""
    values = [pairs.value(i) for i in range(pairs.period)]
    return RankValues([a for a, _ in values], pairs.world), RankValues([b for _, b in values], pairs.world)


class SpecView(Mapping):
    """One rank's {param name: ParamSpec}, looked up in the per-param RankValues."""

    def __init__(self, per_param: dict[str, RankValues], rank: int):
        self._per_param, self._rank = per_param, rank

    def __getitem__(self, name: str):
        spec = self._per_param[name][self._rank]
        if spec is None:
            raise KeyError(name)
        return spec

    def __iter__(self):
        return (n for n, v in self._per_param.items() if v[self._rank] is not None)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __contains__(self, name) -> bool:
        v = self._per_param.get(name)
        return v is not None and v[self._rank] is not None

    def __repr__(self) -> str:
        return f"SpecView(rank {self._rank}, {len(self)} params)"


class RankSpecs(Sequence):
    """Per rank its {param: spec} (a SpecView), over RankValues of specs (None: the rank lacks the param)."""

    def __init__(self, per_param: dict[str, RankValues], world: int):
        self.per_param, self.world = per_param, world

    def __getitem__(self, rank: int) -> SpecView:
        if not -self.world <= rank < self.world:
            raise IndexError(rank)
        return SpecView(self.per_param, rank % self.world)

    def __len__(self) -> int:
        return self.world

    def __eq__(self, other) -> bool:
        if not isinstance(other, Sequence) or len(other) != self.world:
            return NotImplemented
        return all(dict(self[r]) == dict(other[r]) for r in range(self.world))

    __hash__ = None

    def __repr__(self) -> str:  # every rank's specs: O(world), for tests and debugging only
        return f"RankSpecs({[dict(self[r]) for r in range(self.world)]!r})"
