"""Per-target layouts: for every rank, the spec of the param it holds and the pieces that fill it.

A dense target is cut over the TP group by its style (shard.py), once per TP rank: its data-parallel
replicas hold the same (ranks.RankValues). An expert target is
[local experts, *inner local shape]: each hosted expert (experts.py) is cut by its inner style over the
ranks of one expert group and stacked in ascending global id, once per (host set, rank in expert group)
of the placement's period: expert groups that host the same experts share the value, like replicas.
"""

from __future__ import annotations

import operator

from ..errors import PlanError
from ..rules import FamilyRules
from ..topology import Layout
from .expected_shapes import delivered_dtype
from .expert_layouts import ExpertCuts, ExpertLayouts
from .experts import expert_placement
from .parts import check_vocab, logical_parts, oriented_shape, vector_experts
from .shard import HEAD_STYLES, LocalLayout, Part, cut, view2d
from .transpose import stored_layout
from .ranks import RankValues
from .types import ParamSpec, Target

_SHAPE_AND_DTYPE = operator.attrgetter("shape", "dtype")   # of a checkpoint entry: how an expert's sources look


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
    """(per expert its logical parts, the shape of one expert, and per part the shape and dtype of its source when
    every expert's sources look like expert 0's, else None), checked: every expert has one shape."""
    if target.rule.stacked:
        (src,) = target.sources
        shape = oriented_shape(index[src].shape, target.rule.transposed, stacked=True)
        if len(shape) < 2 or shape[0] != num_experts:
            raise PlanError(f"{where}: {src} has shape {list(shape)}, but a stacked expert tensor has dim 0 = "
                            f"num experts = {num_experts} (config.json); the checkpoint and config.json disagree")
        rows_per = view2d(shape)[0] // num_experts
        # Every expert is the same rows of one source, rows_per further down: expert 0's parts, shifted.
        parts0 = logical_parts(target, [src], index, rules, config, row0=0, rows=rows_per)
        return [[Part(q.source, q.row0 + e * rows_per, q.rows, q.cols) for q in parts0]
                for e in range(num_experts)], shape[1:], None
    per_expert_parts, cut_anew, look = _per_expert_parts(target, index, rules, config, num_experts)
    one_expert = (sum(p.rows for p in per_expert_parts[0]),) + \
        oriented_shape(index[target.sources[0]].shape, target.rule.transposed)[1:]

    def sizes_of(e: int) -> tuple:
        return tuple((p.rows, p.cols) for p in per_expert_parts[e])
    odd = [e for e in cut_anew if sizes_of(e) != sizes_of(0)]   # the others are expert 0's parts, renamed
    if odd:
        raise PlanError(f"{where}: experts {odd} have part shapes {sizes_of(odd[0])} but expert 0 has "
                        f"{sizes_of(0)}; every expert must have one shape (the checkpoint contradicts itself)")
    return per_expert_parts, one_expert, look


def _per_expert_parts(target: Target, index, rules: FamilyRules, config: dict,
                      num_experts: int) -> tuple[list[list[Part]], list[int], tuple | None]:
    """Each expert's logical parts, the experts cut anew, and (none cut anew) per part of expert 0 its source's
    shape and dtype. Parts depend on the sources' shapes and dtypes only, so an expert whose sources look like
    expert 0's has expert 0's parts on its own sources; any other is cut (and checked) anew."""
    sources0 = target.expert_sources[0]
    parts0 = logical_parts(target, list(sources0), index, rules, config)
    position = {s: k for k, s in enumerate(sources0)}
    look = list(map(_SHAPE_AND_DTYPE, map(index.__getitem__, sources0)))
    if len(position) != len(sources0):   # a source named twice: no positional renaming
        look = None
    out, anew = [parts0], []
    renamed = [(position[q.source], q.row0, q.rows, q.cols) for q in parts0]
    new = tuple.__new__   # a Part per expert source of the job: the tuple's own constructor
    for e in range(1, num_experts):
        sources = target.expert_sources[e]
        if look is not None and list(map(_SHAPE_AND_DTYPE, map(index.__getitem__, sources))) == look:
            out.append([new(Part, (sources[k], row0, rows, cols)) for k, row0, rows, cols in renamed])
        else:
            out.append(logical_parts(target, list(sources), index, rules, config))
            anew.append(e)
    return out, anew, None if anew or look is None else tuple(look[k] for k, *_ in renamed)


def _expert_layouts(target: Target, index, rules: FamilyRules, config: dict, layout: Layout, placement,
                    sizes: dict) -> Planned:
    """Expert params: [local experts, *inner local shape], slots in ascending global id; one value per
    (host set, rank in expert group) of the placement's period, shared by the ranks that hold it, made when
    first asked (expert_layouts.py: other ranks' values are rarely needed whole)."""
    rule = target.rule
    num_experts = rules.dim(config, "experts")
    g = placement.group_size
    where = f"{target.name} (rule expert/{rule.inner} in {rules.source})"
    per_expert_parts, one_expert, look = _expert_parts(target, index, rules, config, num_experts, where)
    inner = effective_style(rule.inner, len(one_expert))
    vector = vector_experts(target, index)   # [experts, n] as stored, cut as [experts, n, 1]
    global_shape = (num_experts,) + tuple(one_expert[:1] if vector else one_expert)
    dtype = delivered_dtype(rule, index[target.sources[0]].dtype)
    # Expert 0 is cut for every rank of the group, so that a rank hosting no expert (EPLB) still gets its shape.
    cuts = ExpertCuts(per_expert_parts, [cut(inner, per_expert_parts[0], g, t, f"{where} expert 0",
                                             label="tp-in-expert-group", **sizes) for t in range(g)])
    inner_local = [local_shape(inner, tuple(one_expert), LocalLayout(lay.rows, lay.cols, ())) for lay in cuts.cuts]
    restore = rule.transposed or vector
    tails = [inner_local[t][:1] if vector else inner_local[t] for t in range(g)]
    keys, made_lays, made_specs = placement.keys, {}, {}

    def layout_of(i: int) -> LocalLayout:   # one value per (host set, rank in group), made when first asked
        key = keys[i]
        lay = made_lays.get(key)
        if lay is None:
            k, t = key
            lay = cuts.stacked(placement.hosts[k], t)
            if restore:
                lay = stored_layout(lay, target, index, cuts.cuts[t].rows, num_experts)
            made_lays[key] = lay
        return lay

    def spec_of(i: int) -> ParamSpec:   # ranks of one host set mostly hold one spec (equal splits)
        k, t = keys[i]
        hosts = placement.hosts[k]
        padding = layout_of(i).padding if restore else cuts.padding(len(hosts), t)
        shape = (len(hosts),) + tails[t]
        spec = made_specs.get((k, shape, padding))
        if spec is None:
            spec = made_specs[k, shape, padding] = ParamSpec(target.name, "expert", dtype, global_shape, shape,
                                                             padding, None, hosts)
        return spec
    lays = ExpertLayouts(target.name, cuts, placement, layout_of, exact=not restore, look=look)
    lays.value(0)   # what could fail in making a value (restoring the stored orientation) fails while planning
    return RankValues((), layout.world, make=spec_of, period=placement.period), lays


def relayout(target: Target, index, rules: FamilyRules, config: dict, q: int) -> Planned:
    """Target's (specs, layouts) on q ranks at tp q (ep 1): to name the group sizes a derived cut accepts."""
    lay = Layout(world=q, tp=q)
    placement = expert_placement(rules.dim(config, "experts"), lay) if target.rule.style == "expert" else None
    return layouts_for_target(target, index, rules, config, lay, placement)
