"""Per-part companions: a scale (or a small tensor) per weight part, held whole, every part's, in part order.

Per-tensor FP8 scales and static input scales, NVFP4's global scale, compressed-tensors' weight_shape: one
value (or a few) per checkpoint part of the weight, too small to cut and needed whole by whichever rows a rank
holds. Every rank holding the weight holds every part's, one after another in part order ([parts] of a fused
param, the part's own shape for one part); experts per hosted expert, one row each ([local experts, parts]),
or, for what the kernels take over all experts (NVFP4's input scales), every expert's on every rank.
"""

from __future__ import annotations

from ..plan.ranks import RankValues, per_group, unzipped
from ..plan.shard import LocalLayout, Piece, view2d
from ..plan.types import ParamSpec


def per_part_layouts(c, target, weight_specs: RankValues, index: dict, squeeze: bool = False,
                     every_expert: bool = False) -> tuple[RankValues, RankValues]:
    """Per rank (spec, layout) of per-part companion `c` of `target`. squeeze: an expert's single scalar is
    [local experts] (not [local experts, 1]); every_expert: experts' values of all experts on every rank."""
    entries = [index[s] for s in c.sources]
    if target.rule.style == "expert":
        return _experts(c, target, weight_specs, entries, squeeze, every_expert)
    world = weight_specs.world
    rows = [view2d(tuple(e.shape))[0] for e in entries]
    if len(entries) == 1:   # one source (also a fused one on disk): as it is, on every rank
        (e,) = entries
        shape = tuple(e.shape)
        lay = LocalLayout(*view2d(shape), (Piece(e.name, (0, rows[0]), (0, 1), 0, 0),))
        return RankValues([ParamSpec(c.name, "replicate", e.dtype, shape, shape)], world), RankValues([lay], world)
    shape = (sum(rows),)
    pieces = tuple(Piece(e.name, (0, n), (0, 1), sum(rows[:i]), 0) for i, (e, n) in enumerate(zip(entries, rows)))
    spec = ParamSpec(c.name, "replicate", entries[0].dtype, shape, shape)
    return RankValues([spec], world), RankValues([LocalLayout(shape[0], 1, pieces)], world)


def _experts(c, target, weight_specs: RankValues, entries, squeeze: bool, every_expert: bool):
    """[local experts, parts * values] slot by slot, each expert's parts in order (a [1, values] view each)."""
    scale_of = dict(c.scale_of)
    n_parts = len(target.expert_sources[0])
    k = view2d(tuple(entries[0].shape))[1]
    n_experts = weight_specs.value(0).global_shape[0]
    width = () if squeeze and n_parts * k == 1 else (n_parts * k,)
    dtype = entries[0].dtype

    def one(w):
        slots = tuple(range(n_experts)) if every_expert else w.experts
        pieces = tuple(Piece(scale_of[s], (0, 1), (0, k), slot, j * k)
                       for slot, e in enumerate(slots) for j, s in enumerate(target.expert_sources[e]))
        shape = (len(slots),) + width
        spec = (ParamSpec(c.name, "replicate", dtype, shape, shape) if every_expert else
                ParamSpec(c.name, "expert", dtype, (n_experts,) + width, shape, experts=w.experts))
        return spec, LocalLayout(*view2d(shape), pieces)
    return unzipped(per_group(one, weight_specs))
