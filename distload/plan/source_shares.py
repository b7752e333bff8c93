"""A source's shares as the plan holds them: made when first asked, their takers known before.

Most sources' shares are a tuple made while planning. An expert source's are made from its param's layouts
(expert_layouts.py) only when a rank asks for them: the reader that reads the source and the ranks that
receive it. Every rank needs every source's takers (buckets.py and spans.py cut and place by them), and
those come from the cut templates without any share.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

_MAKING = threading.Lock()


def share_takers(shares, isz: int) -> tuple:
    """Per share (first row, end row, bytes per row, group): Source.takers."""
    return tuple([(p.rows[0], p.rows[1], (p.cols[1] - p.cols[0]) * isz, g) for g, _, p in shares])


class SourceShares(Sequence):
    """A source's shares made when first asked (then kept: one object per share, as a tuple would hold), its
    takers known before. parts: per param that takes the source, in planning order, its shares (a list) or
    layouts that make them per source (expert_layouts.py)."""

    __slots__ = ("_source", "_parts", "_made", "takers")   # one per expert source of the job

    def __init__(self, source: str, parts: list, isz: int):
        self._source, self._parts, self._made = source, parts, None
        self.takers = sum([share_takers(part, isz) if isinstance(part, list) else part.takers(source, isz)
                           for part in parts], ())

    @classmethod
    def of_layouts(cls, source: str, lays, takers: tuple) -> "SourceShares":
        """The shares of a source that one param's layouts alone take (`takers`: lays.takers(source)): planning's
        common case, one per expert source, built without __init__'s checks."""
        self = object.__new__(cls)
        self._source, self._parts, self._made, self.takers = source, (lays,), None, takers
        return self

    @property
    def made(self) -> bool:
        """Have the shares been made (someone asked for them)?"""
        return self._made is not None

    def _all(self) -> tuple:
        if self._made is None:
            # Once, under a lock: the transfer's read-ahead thread walks shares too, and callers match a share
            # by identity (transfer/pieces.py), so every caller must see the same objects.
            with _MAKING:
                if self._made is None:
                    self._made = tuple(s for part in self._parts
                                       for s in (part if isinstance(part, list) else part.shares(self._source)))
        return self._made

    def __getitem__(self, i):
        return self._all()[i]

    def __len__(self) -> int:
        return len(self.takers)

    def __iter__(self):
        return iter(self._all())

    def __eq__(self, other) -> bool:
        return isinstance(other, Sequence) and tuple(self) == tuple(other)

    def __hash__(self) -> int:
        return hash(self._all())

    def __repr__(self) -> str:
        return repr(self._all())


def takers_broadcast(takers: tuple, rows: int, row_bytes: int, world: int) -> bool:
    """is_broadcast, asked of a source's takers (made without its shares)."""
    for r0, r1, width, _ in takers:
        if r0 != 0 or r1 != rows or width != row_bytes:
            return False
    if sum(t[3].count for t in takers) != world:
        return False
    return len({r for t in takers for r in t[3].members()}) == world if len(takers) > 1 else True
