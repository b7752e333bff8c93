"""Per-target layouts: for every rank, the spec of the param it holds and the pieces that fill it.

A dense target is cut over the TP group by its style (shard.py), once per TP rank: its data-parallel
replicas hold the same (ranks.RankValues). An expert target is
[local experts, *inner local shape]: each hosted expert (experts.py) is cut by its inner style over the
ranks of one expert group and stacked in ascending global id.
"""

from __future__ import annotations

from ..errors import PlanError
from ..rules import FamilyRules
from ..topology import Layout
from .experts import expert_hosts
from .parts import check_vocab, logical_parts
from .shard import HEAD_STYLES, LocalLayout, Piece, cut, view2d
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


def layouts_for_target(target: Target, index, rules: FamilyRules, config: dict, layout: Layout, hosts) -> Planned:
    """Per rank (spec, layout) of `target`; hosts: expert_hosts(...) when the target is an expert param."""
    rule = target.rule
    sizes = {}
    if (rule.inner or rule.style) in HEAD_STYLES:
        sizes = dict(heads=rules.dim(config, "heads"), kv_heads=rules.dim(config, "kv_heads"))
    if rule.style == "expert":
        return _expert_layouts(target, index, rules, config, layout, hosts, sizes)
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
    shape0 = entries[0].shape
    global_shape = (sum(p.rows for p in parts),) + tuple(shape0[1:]) if len(parts) > 1 or rule.split else shape0
    if style == "qkv" and len(entries) == 1:
        global_shape = shape0
    specs, lays = [], []
    for t in range(layout.tp):
        lay = cut(style, parts, layout.tp, t, f"{target.name} (rule {rule.style})", pad_to=rule.pad_to, **sizes)
        lays.append(lay)
        specs.append(ParamSpec(target.name, rule.style, entries[0].dtype, tuple(global_shape),
                               local_shape(style, tuple(global_shape), lay), lay.padding))
    if all(lay == lays[0] for lay in lays) and all(spec == specs[0] for spec in specs):
        specs, lays = specs[:1], lays[:1]
    return RankValues(specs, layout.world), RankValues(lays, layout.world)


def _expert_parts(target: Target, index, rules: FamilyRules, config: dict, num_experts: int, where: str):
    """(per expert its logical parts, the shape of one expert), checked: every expert has one shape."""
    if target.rule.stacked:
        (src,) = target.sources
        shape = tuple(index[src].shape)
        if len(shape) < 2 or shape[0] != num_experts:
            raise PlanError(f"{where}: {src} has shape {list(shape)}, but a stacked expert tensor has dim 0 = "
                            f"num experts = {num_experts} (config.json); the checkpoint and config.json disagree")
        rows_per = view2d(shape)[0] // num_experts
        return [logical_parts(target, [src], index, rules, config, row0=e * rows_per, rows=rows_per)
                for e in range(num_experts)], shape[1:]
    per_expert_parts = [logical_parts(target, list(target.expert_sources[e]), index, rules, config)
                        for e in range(num_experts)]
    one_expert = (sum(p.rows for p in per_expert_parts[0]),) + tuple(index[target.sources[0]].shape[1:])
    sizes_of = [tuple((p.rows, p.cols) for p in parts) for parts in per_expert_parts]
    odd = [e for e in range(num_experts) if sizes_of[e] != sizes_of[0]]
    if odd:
        raise PlanError(f"{where}: experts {odd} have part shapes {sizes_of[odd[0]]} but expert 0 has "
                        f"{sizes_of[0]}; every expert must have one shape (the checkpoint contradicts itself)")
    return per_expert_parts, one_expert


def _part_index(lay: LocalLayout, parts0) -> list[tuple[int, Piece]]:
    """Each of expert 0's pieces with the index of the part it was cut from."""
    return [(next(j for j, q in enumerate(parts0) if q.source == p.source and q.row0 <= p.rows[0] < q.row0 + q.rows), p)
            for p in lay.pieces]


def _rebased(indexed: list[tuple[int, Piece]], rows: int, parts0, parts_e, slot: int) -> list[Piece]:
    """Expert 0's pieces (with their part index) moved onto expert e's parts (same sizes), at local `slot`."""
    out = []
    for j, p in indexed:
        shift = parts_e[j].row0 - parts0[j].row0
        out.append(Piece(parts_e[j].source, (p.rows[0] + shift, p.rows[1] + shift), p.cols, p.dst_row + slot * rows,
                         p.dst_col))
    return out


def _expert_layouts(target: Target, index, rules: FamilyRules, config: dict, layout: Layout, hosts,
                    sizes: dict) -> Planned:
    """Expert params: [local experts, *inner local shape], slots in ascending global id. Every expert has
    one shape (checked), so each rank of an expert group is cut once and the cut moved onto each expert."""
    rule = target.rule
    num_experts = rules.dim(config, "experts")
    g = layout.expert_group_size
    where = f"{target.name} (rule expert/{rule.inner} in {rules.source})"
    per_expert_parts, one_expert = _expert_parts(target, index, rules, config, num_experts, where)
    inner = effective_style(rule.inner, len(one_expert))
    global_shape = (num_experts,) + tuple(one_expert)
    dtype = index[target.sources[0]].dtype
    parts0 = per_expert_parts[0]
    # Cut expert 0 for every rank of the group, so that a rank hosting no expert (EPLB) still gets its shape.
    cuts = [cut(inner, parts0, g, t, f"{where} expert 0", label="tp-in-expert-group", **sizes) for t in range(g)]
    indexed = [_part_index(lay, parts0) for lay in cuts]
    lays = []
    for r in range(layout.world):
        t = layout.rank_in_expert_group(r)
        lay = cuts[t]
        pieces = [p for slot, e in enumerate(hosts[r])
                  for p in _rebased(indexed[t], lay.rows, parts0, per_expert_parts[e], slot)]
        lays.append(LocalLayout(len(hosts[r]) * lay.rows, lay.cols, tuple(pieces), ()))

    def spec(r: int) -> ParamSpec:
        lay = cuts[layout.rank_in_expert_group(r)]
        inner_local = local_shape(inner, tuple(one_expert), LocalLayout(lay.rows, lay.cols, ()))
        return ParamSpec(target.name, "expert", dtype, global_shape, (len(hosts[r]),) + inner_local, (), None, hosts[r])
    return RankValues((), layout.world, make=spec, period=layout.world), RankValues(lays, layout.world)


def relayout(target: Target, index, rules: FamilyRules, config: dict, q: int) -> Planned:
    """Target's (specs, layouts) on q ranks at tp q (ep 1): to name the group sizes a derived cut accepts."""
    lay = Layout(world=q, tp=q)
    hosts = expert_hosts(rules.dim(config, "experts"), lay) if target.rule.style == "expert" else None
    return layouts_for_target(target, index, rules, config, lay, hosts)
