"""Companions of expert weights, made per rank when asked, as their weights' layouts are (plan/expert_layouts.py).

At 1024 ranks an expert weight has a layout per rank; a rank needs its own, and of the others only which ranks
take each source's rows (its takers). So an expert weight's scales are derived lazily from the weight's values,
and a scale source's takers from its weight source's, mapped once per distinct weight takers (memoized across
layers in the placement's memo, as the weight's are): a rank's planning grows with the experts it serves.
"""

from __future__ import annotations

from ..dtypes import itemsize
from ..plan.expert_layouts import DerivedExpertLayouts, ExpertLayouts
from ..plan.ranks import RankValues


def lazy_expert_companion(c, weight_specs, weight_lays: ExpertLayouts, derive, map_takers, mapping: tuple,
                          tensors: dict, dtype: str) -> tuple[RankValues, DerivedExpertLayouts]:
    """Per rank (spec, layout) of companion `c` of an expert weight, when asked. derive(weight layout, weight spec)
    -> (spec, layout); map_takers(weight takers, weight entry, companion entry) -> the companion source's takers
    (first row, end row, bytes per row, group) each; mapping: what both depend on besides the weight's (the block
    size, say). Every expert has one geometry, so one rank of each (rank in group, number of hosted experts) is
    derived now: what derive refuses fails while planning."""
    pairs: dict[int, tuple] = {}
    scale_of = dict(c.scale_of)

    def pair(i: int):
        if i not in pairs:
            pairs[i] = derive(weight_lays.value(i), weight_specs.value(i))
        return pairs[i]
    placement = weight_lays.placement
    for i in placement.one_per_shape:
        pair(i)
    memo = placement.memo   # alike across layers, as the weight's takers are

    def takers_of(w_source: str) -> tuple:
        w, s = tensors[w_source], tensors[scale_of[w_source]]
        weight_takers = weight_lays.takers(w_source, itemsize(w.dtype))
        key = (mapping, id(weight_takers), w.shape[-2], w.dtype, s.dtype)   # shape[-2]: one matrix's rows
        known = memo.get(key)
        if known is None:   # the weight's takers are kept alive by the placement's memo: ids stay unique
            known = memo[key] = tuple(map_takers(weight_takers, w, s))
        return known
    return (RankValues((), weight_specs.world, make=lambda i: pair(i)[0], period=weight_lays.period),
            DerivedExpertLayouts(c.name, weight_lays, {s: w for w, s in c.scale_of}, lambda i: pair(i)[1], takers_of,
                                 mapping, dtype))
