"""A rank's plan: which sources other blocks alone take (spans.away), decided per layer, not per tensor.

Nearly all of an MoE checkpoint's tensors are experts, and at scale nearly all of those are other blocks'
own: a rank keeps only their bytes per node (an Elsewhere each), for the job-wide quotas. Layer after layer
an expert param's layouts are alike (expert_layouts.takers_inputs says when), so the decision made for one
layer's sources, one takers lookup and away test each, is copied to the next alike layer's sources at once.
"""

from __future__ import annotations

from ..topology import Layout
from .spans import Elsewhere, away, block_nodes
from .types import geometry


class Away:
    """spans.away for block `home`'s rank, per distinct (takers, rows, bytes per row): alike sources share one
    decision and one Elsewhere."""

    def __init__(self, layout: Layout, home: int):
        self.memo: dict[tuple, tuple] = {}
        self.args = (layout.local_world, frozenset(layout.reader_nodes), block_nodes(layout), home)

    def __call__(self, takers: tuple, rows: int, row_bytes: int) -> Elsewhere | None:
        key = (id(takers), rows, row_bytes)   # the memo holds the takers: ids stay unique
        known = self.memo.get(key)
        if known is None:
            known = self.memo[key] = (takers, away(takers, rows, row_bytes, *self.args))
        return known[1]


def elsewhere_in_bulk(lazy_layouts, shares: dict[str, list], tensors: dict, decide: Away,
                      per_node: frozenset) -> dict[str, Elsewhere | None]:
    """Per source that one lazily shared layouts object (expert_layouts.py) alone takes: its Elsewhere, or None
    where this rank plans it. A layouts object whose takers inputs equal an earlier one's takes its decisions."""
    out: dict[str, Elsewhere | None] = {}
    earlier: dict[tuple, tuple] = {}
    taken_twice = per_node.union(name for name, ss in shares.items() if len(ss) > 1)
    for lays in lazy_layouts:
        sources = list(lays.sources())
        whole = taken_twice.isdisjoint(sources)
        if not whole:   # shares of several params: planned one by one
            sources = [s for s in sources if s not in taken_twice]
        inputs = lays.takers_inputs(tensors, None if whole else sources)
        if inputs is None:
            continue
        key, value = inputs
        known = earlier.get(key)
        if known is None or known[0] != value:
            decided = []
            for s in sources:
                e = tensors[s]
                rows, row_bytes, _, isz = geometry(e.shape, e.dtype)
                decided.append(decide(lays.takers(s, isz), rows, row_bytes))
            known = earlier[key] = (value, decided)
        out.update(zip(sources, known[1]))
    return out
