"""Per-target layouts: for every rank, the spec of the param it holds and the pieces that fill it.

A dense target is cut over the TP group by its style (shard.py), once per TP rank: its data-parallel
replicas hold the same (ranks.RankValues). An expert target is
[local experts, *inner local shape]: each hosted expert (experts.py) is cut by its inner style over the
ranks of one expert group and stacked in ascending global id, once per (host set, rank in expert group)
of the placement's period: expert groups that host the same experts share the value, like replicas.
"""

from __future__ import annotations

from ..errors import PlanError
from ..rules import FamilyRules
from ..topology import Layout
from .expected_shapes import delivered_dtype
from .experts import expert_placement
from .parts import check_vocab, logical_parts, oriented_shape, vector_experts
from .shard import HEAD_STYLES, LocalLayout, Piece, cut, view2d
from .transpose import stored_layout
from .ranks import RankValues
from .types import ParamSpec, Target


def local_shape(style: str, global_shape: tuple[int, ...], lay: LocalLayout) -> tuple[int, ...]:
    """The N-D shape of a rank's cut of a `global_shape` tensor, from the 2-D layout `lay`."""
    if style == "replicate":
        return global_shape
    if style == "row":
        return tuple(global_shape[:-1]) + (lay.cols,) if len(global_shape) > 1 else global_shape
    # Row cuts of the 2-D view split dim 0 of an N-D tensor: each dim-0 index spans rows_per_index rows.
    rows_per_index = view2d(global_shape)[0] // global_shape[0] if global_shape and global_shape[0] else 1
    if lay.rows % rows_per_index:
        raise PlanError(f"a {style} cut of a {list(global_shape)} tensor gives {lay.rows} rows of its 2-D view, "
                        f"not a whole number of dim-0 slices ({rows_per_index} rows each)")
    return (lay.rows // rows_per_index,) + tuple(global_shape[1:])


def effective_style(style: str, ndim: int) -> str:
    # The 1-D bias of a row-parallel layer is replicated: every rank holds it, and the forward adds it
    # once after the all-reduce (vLLM does the same).
    return "replicate" if style == "row" and ndim < 2 else style


Planned = tuple[RankValues, RankValues]   # per rank (stored per group of replicas): the param's spec and its layout


def layouts_for_target(target: Target, index, rules: FamilyRules, config: dict, layout: Layout, placement) -> Planned:
    """Per rank (spec, layout) of `target`; placement: experts.expert_placement(...) for an expert param."""
    rule = target.rule
    sizes = {}
    if (rule.inner or rule.style) in HEAD_STYLES:
        sizes = dict(heads=rules.dim(config, "heads"), kv_heads=rules.dim(config, "kv_heads"))
    if rule.groups:  # whole heads per rank (rule key groups)
        sizes["groups"] = rules.dim(config, rule.groups)
    if rule.style == "expert":
        return _expert_layouts(target, index, rules, config, layout, placement, sizes)
    return _dense_layouts(target, index, rules, config, layout, sizes)


def _dense_layouts(target: Target, index, rules: FamilyRules, config: dict, layout: Layout, sizes: dict) -> Planned:
    """Cut once per TP rank: ranks tp apart (data-parallel replicas) hold the same, and when every TP rank
    holds the same (replicated params) one value serves the whole world."""
    rule = target.rule
    entries = [index[s] for s in target.sources]
    parts = logical_parts(target, list(target.sources), index, rules, config)
    if rule.style == "vocab":
        check_vocab(target, parts, rules, config)
    style = effective_style(rule.style, len(entries[0].shape))
    shape0 = oriented_shape(entries[0].shape, rule.transposed)
    global_shape = (sum(p.rows for p in parts),) + tuple(shape0[1:]) if len(parts) > 1 or rule.split else shape0
    if style == "qkv" and len(entries) == 1:
        global_shape = shape0
    specs, lays = [], []
    for t in range(layout.tp):
        lay = cut(style, parts, layout.tp, t, f"{target.name} (rule {rule.style})", pad_to=rule.pad_to, **sizes)
        lays.append(stored_layout(lay, target, index, lay.rows))
        specs.append(ParamSpec(target.name, rule.style, delivered_dtype(rule, entries[0].dtype), tuple(global_shape),
                               local_shape(style, tuple(global_shape), lay), lay.padding))
    if all(lay == lays[0] for lay in lays) and all(spec == specs[0] for spec in specs):
        specs, lays = specs[:1], lays[:1]
    return RankValues(specs, layout.world), RankValues(lays, layout.world)


def _expert_parts(target: Target, index, rules: FamilyRules, config: dict, num_experts: int, where: str):
    """(per expert its logical parts, the shape of one expert), checked: every expert has one shape."""
    if target.rule.stacked:
        (src,) = target.sources
        shape = oriented_shape(index[src].shape, target.rule.transposed, stacked=True)
        if len(shape) < 2 or shape[0] != num_experts:
            raise PlanError(f"{where}: {src} has shape {list(shape)}, but a stacked expert tensor has dim 0 = "
                            f"num experts = {num_experts} (config.json); the checkpoint and config.json disagree")
        rows_per = view2d(shape)[0] // num_experts
        return [logical_parts(target, [src], index, rules, config, row0=e * rows_per, rows=rows_per)
                for e in range(num_experts)], shape[1:]
    per_expert_parts = [logical_parts(target, list(target.expert_sources[e]), index, rules, config)
                        for e in range(num_experts)]
    one_expert = (sum(p.rows for p in per_expert_parts[0]),) + \
        oriented_shape(index[target.sources[0]].shape, target.rule.transposed)[1:]
    sizes_of = [tuple((p.rows, p.cols) for p in parts) for parts in per_expert_parts]
    odd = [e for e in range(num_experts) if sizes_of[e] != sizes_of[0]]
    if odd:
        raise PlanError(f"{where}: experts {odd} have part shapes {sizes_of[odd[0]]} but expert 0 has "
                        f"{sizes_of[0]}; every expert must have one shape (the checkpoint contradicts itself)")
    return per_expert_parts, one_expert


def _part_of(piece: Piece, parts) -> int:
    """The index of the part of `parts` a cut piece was taken from (every cut takes a piece from one part)."""
    for j, q in enumerate(parts):
        if q.source == piece.source and q.row0 <= piece.rows[0] and piece.rows[1] <= q.row0 + q.rows:
            return j
    raise PlanError(f"{piece.source}: piece rows {piece.rows} lie in no part of the expert")  # a cut's bug


class _ExpertCuts:
    """One expert param's cut per rank of an expert group, moved onto each expert and stacked per host set.

    Every expert has one shape (checked), so expert 0 is cut once per rank in the group and each other
    expert's pieces are the same rectangles of its own parts: planning costs O(experts x group size)
    per param, whatever the number of expert groups that host the same experts."""

    def __init__(self, per_expert_parts, cuts: list[LocalLayout]):
        self.parts, self.cuts = per_expert_parts, cuts
        parts0 = per_expert_parts[0]
        self.indexed = [[(_part_of(p, parts0), p) for p in lay.pieces] for lay in cuts]
        self._moved: dict[tuple[int, int], tuple[Piece, ...]] = {}

    def moved(self, e: int, t: int) -> tuple[Piece, ...]:
        """Expert e's pieces for rank t of the group, at slot 0."""
        got = self._moved.get((e, t))
        if got is None:
            parts0, parts_e = self.parts[0], self.parts[e]
            got = tuple(p if e == 0 else Piece(parts_e[j].source, (p.rows[0] + parts_e[j].row0 - parts0[j].row0,
                                                                   p.rows[1] + parts_e[j].row0 - parts0[j].row0),
                                               p.cols, p.dst_row, p.dst_col) for j, p in self.indexed[t])
            self._moved[(e, t)] = got
        return got

    def stacked(self, hosts: tuple[int, ...], t: int) -> LocalLayout:
        """Rank t's layout holding `hosts` in ascending slots (serving orientation)."""
        base = self.cuts[t]
        rows = base.rows
        if len(hosts) == 1:  # one expert per rank (ep as large as the experts): its pieces as moved
            return LocalLayout(rows, base.cols, self.moved(hosts[0], t), base.padding)
        pieces = tuple(p if not slot else Piece(p.source, p.rows, p.cols, p.dst_row + slot * rows, p.dst_col)
                       for slot, e in enumerate(hosts) for p in self.moved(e, t))
        padding = tuple((a + slot * rows, b + slot * rows, c, d) for slot in range(len(hosts))
                        for a, b, c, d in base.padding)
        return LocalLayout(len(hosts) * rows, base.cols, pieces, padding)


def _expert_layouts(target: Target, index, rules: FamilyRules, config: dict, layout: Layout, placement,
                    sizes: dict) -> Planned:
    """Expert params: [local experts, *inner local shape], slots in ascending global id; one value per
    (host set, rank in expert group) of the placement's period, shared by the ranks that hold it."""
    rule = target.rule
    num_experts = rules.dim(config, "experts")
    g = placement.group_size
    where = f"{target.name} (rule expert/{rule.inner} in {rules.source})"
    per_expert_parts, one_expert = _expert_parts(target, index, rules, config, num_experts, where)
    inner = effective_style(rule.inner, len(one_expert))
    vector = vector_experts(target, index)   # [experts, n] as stored, cut as [experts, n, 1]
    global_shape = (num_experts,) + tuple(one_expert[:1] if vector else one_expert)
    dtype = delivered_dtype(rule, index[target.sources[0]].dtype)
    # Expert 0 is cut for every rank of the group, so that a rank hosting no expert (EPLB) still gets its shape.
    cuts = _ExpertCuts(per_expert_parts, [cut(inner, per_expert_parts[0], g, t, f"{where} expert 0",
                                              label="tp-in-expert-group", **sizes) for t in range(g)])
    inner_local = [local_shape(inner, tuple(one_expert), LocalLayout(lay.rows, lay.cols, ())) for lay in cuts.cuts]
    made: dict[tuple[int, int], tuple[ParamSpec, LocalLayout]] = {}
    specs: dict[tuple, ParamSpec] = {}   # ranks of one host set mostly hold one spec (equal splits)
    for key in dict.fromkeys(placement.keys):
        hosts, t = placement.hosts[key[0]], key[1]
        lay = stored_layout(cuts.stacked(hosts, t), target, index, cuts.cuts[t].rows, num_experts)
        shape = (len(hosts),) + (inner_local[t][:1] if vector else inner_local[t])
        spec_key = (key[0], shape, lay.padding)
        if spec_key not in specs:
            specs[spec_key] = ParamSpec(target.name, "expert", dtype, global_shape, shape, lay.padding, None, hosts)
        made[key] = (specs[spec_key], lay)
    values = [made[key] for key in placement.keys]
    return RankValues([s for s, _ in values], layout.world), RankValues([lay for _, lay in values], layout.world)


def relayout(target: Target, index, rules: FamilyRules, config: dict, q: int) -> Planned:
    """Target's (specs, layouts) on q ranks at tp q (ep 1): to name the group sizes a derived cut accepts."""
    lay = Layout(world=q, tp=q)
    placement = expert_placement(rules.dim(config, "experts"), lay) if target.rule.style == "expert" else None
    return layouts_for_target(target, index, rules, config, lay, placement)
