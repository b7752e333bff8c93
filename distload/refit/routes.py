"""Pure routing: which trainer rank sends which bytes to which serving rank, planned once per link.

The serving side's plan (plan/build.py, from the update's names / shapes / dtypes, as for a load) says per
serving rank which rectangle of each checkpoint tensor lands where in which param (Source.shares). The
trainers' boxes (holdings.py) say who holds which rectangle. Replicas (DDP's full tensors, boxes two ranks
hold alike) are split by rows among their holders first, so every byte has one sender; then each delivery is
intersected with the holders' boxes. Per (trainer, serving) pair the moves are cut into messages of at most
`cap` bytes (the staging bound), which both sides replay in one global order (`message_order`): the first
pending message in that order always has its sender and its receiver at it, so blocking sends cannot deadlock.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import NamedTuple

from ..dtypes import itemsize
from ..errors import PlanError
from ..plan.shard import view2d


class Claim(NamedTuple):
    """Rows x cols of a source's 2-D view that trainer `rank` sends, at (local_row, local_col) of its local view."""
    rank: int
    rows: tuple[int, int]
    cols: tuple[int, int]
    local_row: int
    local_col: int


class Move(NamedTuple):
    source: str
    trainer: int
    rows: tuple[int, int]          # in the trainer's local 2-D view
    cols: tuple[int, int]
    param: str
    dst_row: int                   # in the param's (or staging param's) 2-D view
    dst_col: int
    dtype: str

    @property
    def nbytes(self) -> int:
        return (self.rows[1] - self.rows[0]) * (self.cols[1] - self.cols[0]) * itemsize(self.dtype)


@dataclass
class ServingRoutes:
    """One serving rank's replayable plan: per trainer its messages (lists of moves), and the digest the
    trainers' holdings must sum to for the plan to hold (the per-step check: one integer)."""
    rank: int
    messages: dict[int, list[list[Move]]] = field(default_factory=dict)
    expected: int = 0

    @property
    def bytes_received(self) -> int:
        return sum(m.nbytes for msgs in self.messages.values() for msg in msgs for m in msg)

    def holds(self, observed: int) -> bool:
        return observed == self.expected


DIGEST_BITS = 40   # a sum over 1 << 23 trainer ranks stays in an int64


def holdings_digest(rank: int, held: dict) -> int:
    """One trainer rank's holdings (names, dtypes, shapes, boxes) as a number; the step's all-reduce sums them."""
    text = repr((rank, sorted((n, h.dtype, tuple(h.shape), tuple(h.boxes)) for n, h in held.items())))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") & ((1 << DIGEST_BITS) - 1)


def claims(name: str, holdings: list[dict]) -> list[Claim]:
    """Disjoint claims covering the whole of source `name`: alike boxes split by rows among their holders."""
    alike: dict[tuple, list[tuple[int, int, int]]] = {}
    shape = None
    for t, held in enumerate(holdings):
        h = held.get(name)
        if h is None:
            continue
        shape = h.shape
        for r0, r1, c0, c1, lr, lc in h.boxes:
            alike.setdefault((r0, r1, c0, c1), []).append((t, lr, lc))
    out = []
    for (r0, r1, c0, c1), holders in sorted(alike.items()):
        n = len(holders)
        for i, (t, lr, lc) in enumerate(holders):
            a, b = r0 + (r1 - r0) * i // n, r0 + (r1 - r0) * (i + 1) // n
            if a < b:
                out.append(Claim(t, (a, b), (c0, c1), lr + a - r0, lc))
    _check_cover(name, shape, out)
    return out


def _check_cover(name: str, shape, out: list[Claim]) -> None:
    rows, cols = view2d(tuple(shape))
    area = sum((c.rows[1] - c.rows[0]) * (c.cols[1] - c.cols[0]) for c in out)
    by_row = sorted(out, key=lambda c: c.rows)
    for i, a in enumerate(by_row):
        for b in by_row[i + 1:]:
            if b.rows[0] >= a.rows[1]:
                break
            if b.cols[0] < a.cols[1] and a.cols[0] < b.cols[1]:
                raise PlanError(f"refit: trainer ranks {a.rank} and {b.rank} hold overlapping, unlike parts of "
                                f"{name} (rows {a.rows} / {b.rows}); hold it as equal replicas or disjoint shards")
    if area != rows * cols:
        raise PlanError(f"refit: the trainer ranks hold {area} of the {rows * cols} elements of {name} "
                        f"{list(shape)}; every element must be held by some trainer rank")


def serving_routes(plan, rank: int, holdings: list[dict], cap: int, expected: int = 0) -> ServingRoutes:
    """Serving rank `rank`'s messages from each trainer, for the plan's deliveries to it."""
    routes = ServingRoutes(rank, expected=expected)
    moves: dict[int, list[Move]] = {}
    for name, source in plan.sources.items():
        pieces = [(s.param, s.piece) for s in source.shares if rank in s.ranks]
        if not pieces:
            continue
        for c in claims(name, holdings):
            for param, p in pieces:
                r0, r1 = max(p.rows[0], c.rows[0]), min(p.rows[1], c.rows[1])
                c0, c1 = max(p.cols[0], c.cols[0]), min(p.cols[1], c.cols[1])
                if r0 >= r1 or c0 >= c1:
                    continue
                lr, lc = c.local_row - c.rows[0], c.local_col - c.cols[0]
                moves.setdefault(c.rank, []).append(Move(
                    name, c.rank, (r0 + lr, r1 + lr), (c0 + lc, c1 + lc), param,
                    p.dst_row + r0 - p.rows[0], p.dst_col + c0 - p.cols[0], source.dtype))
    routes.messages = {t: cut(ms, cap) for t, ms in sorted(moves.items())}
    return routes


def cut(moves: list[Move], cap: int) -> list[list[Move]]:
    """Moves packed in order into messages of at most `cap` bytes (a move longer than that split by rows;
    a single row longer than `cap` is one message of its own)."""
    messages, current, size = [], [], 0
    for m in moves:
        row_bytes = (m.cols[1] - m.cols[0]) * itemsize(m.dtype)
        r = m.rows[0]
        while r < m.rows[1]:
            room = max((cap - size) // row_bytes, 0)
            if room == 0 and current:
                messages.append(current)
                current, size = [], 0
                continue
            take = min(max(room, 1), m.rows[1] - r)
            current.append(m._replace(rows=(r, r + take), dst_row=m.dst_row + r - m.rows[0]))
            size += take * row_bytes
            r += take
    if current:
        messages.append(current)
    return messages


def message_order(trainer: int, serving: int, index: int, servings: int) -> tuple:
    """The global order of messages (index-th of the pair trainer -> serving rank): round-robin pairings."""
    return index, (serving - trainer) % servings, trainer, serving
