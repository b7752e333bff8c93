"""Expert params' layouts, made per rank when asked, and each expert source's shares, made per source.

An expert param has one layout per (host set, rank in expert group): at 1024 ranks and one expert per group,
a value per rank. Every rank needs its own value, but of the others only their pieces of the sources it
reads or receives. So the values are stacked lazily (`ExpertLayouts` is a lazy ranks.RankValues), and a
source's shares and takers are made from the cut templates and the placement (which values host the
source's expert, in which slot), without stacking any layout: what a rank plans for experts grows with the
experts it serves or reads, and the takers every rank needs for bucketing are one pass per distinct
(template, expert, part), memoized across layers (experts.Placement.memo).
"""

from __future__ import annotations

import operator

from ..errors import PlanError
from .ranks import RankValues
from .shard import LocalLayout, Piece
from .source_shares import share_takers
from .types import Share

_DTYPE_AND_SHAPE = operator.attrgetter("dtype", "shape")   # of a checkpoint entry


def _part_of(piece: Piece, parts) -> int:
    """The index of the part of `parts` a cut piece was taken from (every cut takes a piece from one part)."""
    for j, q in enumerate(parts):
        if q.source == piece.source and q.row0 <= piece.rows[0] and piece.rows[1] <= q.row0 + q.rows:
            return j
    raise PlanError(f"{piece.source}: piece rows {piece.rows} lie in no part of the expert")  # a cut's bug


class ExpertCuts:
    """One expert param's cut per rank of an expert group, moved onto each expert and stacked per host set.

    Every expert has one shape (checked), so expert 0 is cut once per rank in the group and each other
    expert's pieces are the same rectangles of its own parts (same source position, rows shifted by its
    part's start): planning costs one Piece per (hosted expert, piece of the cut), nothing more."""

    def __init__(self, per_expert_parts, cuts: list[LocalLayout]):
        self.cuts = cuts
        parts0 = per_expert_parts[0]
        # Per rank of the group, expert 0's pieces as (part index, rows, cols, dst_row, dst_col).
        self.templates = tuple(tuple((_part_of(p, parts0), p.rows, p.cols, p.dst_row, p.dst_col) for p in lay.pieces)
                               for lay in cuts)
        # Per expert, per part: (its source, its rows' shift from expert 0's part).
        self.moves = [[(q.source, q.row0 - q0.row0) for q, q0 in zip(parts, parts0)] for parts in per_expert_parts]

    def stacked(self, hosts: tuple[int, ...], t: int) -> LocalLayout:
        """Rank t's layout holding `hosts` in ascending slots (serving orientation)."""
        base = self.cuts[t]
        rows, template = base.rows, self.templates[t]
        pieces = []
        for slot, e in enumerate(hosts):
            moves, dst0 = self.moves[e], slot * rows
            for j, src_rows, cols, dst_row, dst_col in template:
                source, shift = moves[j]
                if shift:
                    src_rows = (src_rows[0] + shift, src_rows[1] + shift)
                pieces.append(Piece(source, src_rows, cols, dst_row + dst0, dst_col))
        return LocalLayout(len(hosts) * rows, base.cols, tuple(pieces), self.padding(len(hosts), t))

    def padding(self, n_hosts: int, t: int) -> tuple:
        """Rank t's zero regions holding n_hosts experts: its cut's, once per slot."""
        base = self.cuts[t]
        return tuple((a + slot * base.rows, b + slot * base.rows, c, d) for slot in range(n_hosts)
                     for a, b, c, d in base.padding) if base.padding else ()

    def slots_by_source(self) -> dict[str, tuple[tuple[int, int, int], ...]]:
        """Per source, where experts take it: (expert, part index, row shift)."""
        each = [(source, ((e, j, shift),)) for e, moves in enumerate(self.moves)
                for j, (source, shift) in enumerate(moves)]
        once = dict(each)
        if len(once) == len(each):   # the usual: every (expert, part) its own source
            return once
        out: dict[str, list] = {}
        for e, moves in enumerate(self.moves):
            for j, (source, shift) in enumerate(moves):
                out.setdefault(source, []).append((e, j, shift))
        return {source: tuple(slots) for source, slots in out.items()}


class ExpertLayouts(RankValues):
    """An expert param's per-rank layouts (one value per index of the placement's period, stacked when asked)
    that also answer, per source, its shares and takers without stacking (see the module docstring).

    exact: the templates are the stored pieces (no transposed or vector restore rewrote them); otherwise a
    source's shares are read off the stacked values of the ranks that host its expert."""

    def __init__(self, param: str, cuts: ExpertCuts, placement, make, exact: bool, look: tuple | None = None):
        super().__init__((), placement.world, make=make, period=placement.period)
        self.param, self.cuts, self.placement, self.exact = param, cuts, placement, exact
        self.slots = cuts.slots_by_source()
        self._template_id = placement.memo.setdefault(("templates", cuts.templates), len(placement.memo))
        # Every (expert, part) its own source, unshifted, with the shape and dtype `look` names per part: what
        # `takers` and the sources' geometry depend on is then these few values (takers_inputs).
        moves = cuts.moves
        one_each = look is not None and len(self.slots) == len(moves) * len(look) and \
            not any(shift for parts in moves for _, shift in parts)
        self._alike = ("alike experts", len(moves), look) if one_each else None

    def sources(self):
        return self.slots.keys()

    def _entries(self, source: str):
        """(value index, slot, template position, rows, cols, dst_row, dst_col) of each piece of `source`, in the
        order the stacked values list them (index, then slot, then template position)."""
        hosting, keys, templates = self.placement.hosting, self.placement.keys, self.cuts.templates
        out = []
        for e, j, shift in self.slots[source]:
            for i, slot in hosting[e]:
                for n, (jj, rows, cols, dst_row, dst_col) in enumerate(templates[keys[i][1]]):
                    if jj == j:
                        out.append((i, slot, n, (rows[0] + shift, rows[1] + shift), cols, dst_row, dst_col))
        if len(self.slots[source]) > 1:
            out.sort()
        return out

    def holders(self, source: str) -> list[int]:
        """The value indices (ascending) whose ranks host the expert that takes `source`."""
        return sorted({i for e, _, _ in self.slots[source] for i, _ in self.placement.hosting[e]})

    def shares(self, source: str) -> list[Share]:
        if not self.exact:
            return _shares_read_off(self, self.holders(source), source)
        new, param = tuple.__new__, self.param
        cuts, keys = self.cuts.cuts, self.placement.keys
        return [new(Share, (self.group(i), param, Piece(source, rows, cols, dst_row + slot * cuts[keys[i][1]].rows,
                                                          dst_col)))
                for i, slot, _, rows, cols, dst_row, dst_col in self._entries(source)]

    def takers(self, source: str, isz: int) -> tuple:
        """(first row, end row, bytes per row, group) per share of `source`, as types.Source lists them."""
        if not self.exact:
            return share_takers(self.shares(source), isz)
        key = (self._template_id, self.slots[source], isz)
        memo = self.placement.memo
        known = memo.get(key)
        if known is None:
            known = memo[key] = tuple((rows[0], rows[1], (cols[1] - cols[0]) * isz, self.group(i))
                                      for i, _, _, rows, cols, _, _ in self._entries(source))
        return known

    def takers_inputs(self, tensors: dict, sources: list[str] | None = None) -> tuple | None:
        """What `takers` of `sources` (None: all, in `sources()` order) and their dtypes and shapes depend on: (a
        key, a value). Layouts with equal keys and values give, position for position, the same takers, dtype and
        shape (a rank's plan decides a layer's experts as an earlier layer's: other_blocks.py). None: not known
        without shares. Asked of every expert param: alike experts answer without a pass over their sources."""
        if not self.exact:
            return None
        key = ("experts", self._template_id)
        if sources is None:
            if self._alike is not None:
                return key, self._alike
            sources = list(self.slots)
        return key, (tuple(map(self.slots.__getitem__, sources)),
                     tuple(map(_DTYPE_AND_SHAPE, map(tensors.__getitem__, sources))))


class DerivedExpertLayouts(RankValues):
    """Layouts computed from an expert weight's (its block scales): value i = derive(weight value i), asked
    lazily; a derived source's shares are read off the values of the ranks holding its weight source, and its
    takers are `takers_of(weight source)`: the weight source's, mapped. mapping: what takers_of and the
    sources' shapes depend on besides the weight sources' takers, dtypes and shapes (the block size, say)."""

    def __init__(self, param: str, weight: ExpertLayouts, weight_source_of: dict[str, str], make, takers_of,
                 mapping: tuple, dtype: str):
        super().__init__((), weight.world, make=make, period=weight.period)
        self.param, self.weight, self.weight_source_of, self.takers_of = param, weight, weight_source_of, takers_of
        self.mapping, self.dtype = mapping, dtype   # every source's dtype; shapes follow the weights' (checked)

    def sources(self):
        return self.weight_source_of.keys()

    def shares(self, source: str) -> list[Share]:
        return _shares_read_off(self, self.weight.holders(self.weight_source_of[source]), source)

    def takers(self, source: str, isz: int) -> tuple:
        return self.takers_of(self.weight_source_of[source])

    def takers_inputs(self, tensors: dict, sources: list[str] | None = None) -> tuple | None:
        """As ExpertLayouts.takers_inputs, from the weight sources' and the mapping."""
        whole = sources is None
        weight_sources = list(map(self.weight_source_of.__getitem__, self.weight_source_of if whole else sources))
        in_order = whole and weight_sources == list(self.weight.slots)   # one scale per weight source, alike
        weights = self.weight.takers_inputs(tensors, None if in_order else weight_sources)
        if weights is None:
            return None
        key, value = weights
        if in_order:
            return ("derived", key, self.mapping), (value, self.dtype)
        mine = self.weight_source_of if whole else sources
        return ("derived", key, self.mapping), (value, tuple(map(_DTYPE_AND_SHAPE, map(tensors.__getitem__, mine))))


def _shares_read_off(lays: RankValues, holders: list[int], source: str) -> list[Share]:
    """`source`'s shares as the stacked values of `holders` list its pieces."""
    new, param = tuple.__new__, lays.param
    return [new(Share, (lays.group(i), param, p)) for i in holders for p in lays.value(i).pieces if p.source == source]


def lazily_shared(lays) -> bool:
    """Do these layouts give their shares per source (ExpertLayouts and the layouts derived from them)?"""
    return isinstance(lays, (ExpertLayouts, DerivedExpertLayouts))
