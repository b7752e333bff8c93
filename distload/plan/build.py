"""The load plan: a pure function (checkpoint index, rules, config, layout) -> LoadPlan.

Every rank computes the same plan from the same metadata, so no per-tensor control message ever
travels: a receiver knows from the plan which bytes arrive, in which order, and where they go. In a load
a rank plans the job-wide part and its own block's (rank mode, spans.py): the rows another block alone takes
are that block's business, so a rank's planning grows with what its block holds, not with the job. All
validation (names, shapes, dtypes, divisibility) happens here, before any byte is read.
"""

from __future__ import annotations

import collections
import itertools

from ..rules import names
from ..errors import PlanError
from ..rules import FamilyRules
from ..topology import Layout
from . import expected_shapes, landing, pipeline, transpose
from .bounds import check_loop_bounds
from ..gc_freeze import collector_paused
from .digest import inputs_digest
from .buckets import DEFAULT_STAGING_BYTES, buckets_for, interleaved
from .experts import expert_placement
from .layouts import Planned, layouts_for_target, relayout
from .quantization import UNQUANTIZED
from .other_blocks import Away, elsewhere_in_bulk
from .spans import Elsewhere, block_nodes, merged_run, reader_spans
from .targets import expand_targets, match_checkpoint
from .ranks import RankSpecs, RankValues
from .expert_layouts import lazily_shared
from .source_shares import SourceShares, share_takers, takers_broadcast
from .types import LoadPlan, ParamSpec, Share, Source, geometry as source_geometry, interned


def _placement(targets, rules: FamilyRules, config: dict, layout: Layout):
    """The experts' placement (None: the model has no experts, and then no --expert-map may place any)."""
    if any(t.rule.style == "expert" for t in targets):
        return expert_placement(rules.dim(config, "experts"), layout)
    if layout.expert_map is not None:   # a map asked for and placing nothing is a mistake, not a no-op
        raise PlanError(f"--expert-map: this model ({rules.name}) has no experts, so there is nothing to place; "
                        "leave --expert-map out (it is for MoE models)")
    return None


@collector_paused  # a plan is many long-lived objects and no cycles (gc_freeze.py)
def build_plan(tensors: dict, config: dict, rules: FamilyRules, layout: Layout, *,
               strict: bool = True, staging_bytes: int = DEFAULT_STAGING_BYTES, quantization=UNQUANTIZED,
               rank: int | None = None, config_checked: bool = False) -> LoadPlan:
    """Plan the load. `tensors` maps checkpoint names to entries (name, file, offset, dtype, shape).

    quantization: what the load does about quantization (quant.for_load: the checkpoint's format, --quantize,
    --dequantize; plan/quantization.py says what the plan asks of it). rank: plan what that rank needs (the
    load's plan: the job-wide buckets and its block's own, spans.py), not the rows other blocks alone take and
    read; None: the whole job (tools, tests, refit, resharding). config_checked: the config was checked against
    a whole checkpoint already (a refit's: the serving job's own), so a subset of its layers is no sign of a
    config that does not describe the tensors.
    """
    if not config_checked:
        check_loop_bounds(tensors, rules, config)
    digest = inputs_digest(tensors, config, rules, layout, strict=strict, staging_bytes=staging_bytes,
                           quantization=quantization.key)
    layout = pipeline.resolved_layout(layout, rules, config)   # with the stage partition it plans with
    targets, tied = expand_targets(rules, config, tensors)
    # What planning cuts: a quantized checkpoint's companions (scales, packed tensors) travel with their weights.
    view = quantization.view(targets, tensors, rules, config)
    index = landing.served_index(view.targets, view.index, rules, config)   # reshapes
    match = match_checkpoint(view.targets, list(view.companions), tied, index, rules, config, strict)
    by_name = {t.name: t for t in match.targets}
    view = view.matched(by_name)

    placement = _placement(match.targets, rules, config, layout)
    # Every claimed tensor against the full shape and dtype the rules imply, before the cuts (which check only
    # the sizes they use, and would name a rule's dims where this names config.json's keys).
    expected_shapes.check_shapes(match.targets, index, rules, config)
    expected_shapes.check_dtypes(match.targets, index, quantization)
    planned = {t.name: layouts_for_target(t, index, rules, config, layout, placement) for t in match.targets}
    cuts = quantization.cut(view, planned, by_name, layout, lambda n, q: relayout(by_name[n], index, rules, config, q))
    specs = RankSpecs({name: as_rank_values(sp, layout) for name, (sp, _) in planned.items()}, layout.world)
    _add_aliases(specs, tied)
    final, post, quantized = quantization.finalize(view, specs, planned, cuts, by_name)
    specs, post = transpose.stage(specs, post, by_name)   # params stored transposed land, then turn
    post = landing.stage(post, by_name, rules, config, layout)   # rules' permute / transform after landing
    # Pipeline stages: a param's values only on its stages' ranks, so no rank reads or holds another stage's layers.
    stages = pipeline.with_step_outputs(pipeline.stages_of(layout, match.targets, view.companions, tied), post)
    final, specs, post = (pipeline.masked_specs(final, stages), pipeline.masked_specs(specs, stages),
                          pipeline.masked_steps(post, stages))
    claimed = set(_shares(planned, layout)) if stages is not None else set()
    planned = pipeline.masked_planned(planned, stages, as_rank_values)

    shares = _shares(planned, layout)
    pipeline.check_every_source_used(claimed, shares, stages)
    per_node = pipeline.split_by_node(shares, stages)
    home = layout.node(rank) // block_nodes(layout) if rank is not None and layout.reads_by_node else None
    # index: flat 4-bit tensors as their 2-D views
    lazy = [lays for _, lays in planned.values() if lazily_shared(lays)]
    planned_sources = _sources(shares, index, layout, per_node, home, lazy)
    sources = [s for s in planned_sources if type(s) is not Elsewhere]
    buckets, block_own_from = _buckets(planned_sources, layout, staging_bytes, home)
    notes = []
    if match.ignored:
        notes.append(f"ignored by rule: {names.describe(match.ignored)}")
    if quantized:
        notes.append(f"quantization: {quantized}")
    return LoadPlan(family=rules.name, layout=layout, specs=final if isinstance(final, RankSpecs) else tuple(final),
                    sources={s.name: s for s in sources},
                    buckets=buckets, missing=tuple(match.missing), unexpected=tuple(match.unexpected),
                    ignored=tuple(match.ignored), incomplete=match.incomplete, checkpoint_bytes=sum(s.nbytes for s in planned_sources),
                    notes=tuple(notes),
                    staging=tuple(specs) if any(post) else (), post=tuple(post), quantization=quantized,
                    digest=digest, planned_for=None if home is None else rank, block_own_from=block_own_from,
                    received=tuple(map(index.__getitem__, shares)))


def _buckets(sources: list, layout: Layout, staging_bytes: int, home: int | None) -> tuple[tuple, int]:
    """The readers' buckets: the job-wide ones, then the blocks' own (only block `home`'s, in a rank's plan); and
    the number of the first block-own bucket (the job-wide ones are numbered below it)."""
    runs, own = reader_spans(sources, layout)
    per_block = block_nodes(layout)

    def bucketed(reader, spans):
        return buckets_for(reader, spans, layout.world, staging_bytes, layout.same_node)
    job_wide = {r: bucketed(r, runs[r]) for r in layout.readers}
    buckets = interleaved(job_wide, layout.readers, layout.world,
                          {r: bucketed(r, spans) for r, spans in own.items()
                           if home is None or layout.node(r) // per_block == home})
    return buckets, sum(map(len, job_wide.values()))


def as_rank_values(values, layout: Layout) -> RankValues:
    """Per-rank `values` as RankValues, stored once per group of equal ranks (period 1, tp or the world)."""
    if isinstance(values, RankValues):
        return values
    values = list(values)
    for period in (1, layout.tp):
        if all(values[r] == values[r % period] for r in range(len(values))):
            return RankValues(values[:period], layout.world)
    return RankValues(values, layout.world)


def _shares(planned: dict[str, Planned], layout: Layout) -> dict[str, list]:
    """Per checkpoint source the shares of its pieces (in planning order): one per group of equal ranks. Layouts
    that make their shares per source (expert_layouts.py) stand for theirs, made only when the source's are asked."""
    shares: dict[str, list] = collections.defaultdict(list)
    new = tuple.__new__   # one Share per group and piece of the whole job: the tuple's own constructor
    for name, (_, lays) in planned.items():
        if lazily_shared(lays):
            sources = lays.sources()
            if shares.keys().isdisjoint(sources):   # the usual: a param's own experts, a list each, made by maps
                shares.update(zip(sources, map(list, itertools.repeat((lays,)))))
                continue
            for source in sources:
                shares[source].append(lays)
            continue
        lays = as_rank_values(lays, layout)
        for i, group in enumerate(lays.groups()):
            lay = lays.value(i)
            if lay is None:  # ranks of another pipeline stage
                continue
            for piece in lay.pieces:
                shares[piece.source].append(new(Share, (group, name, piece)))
    return dict(shares)


def _add_aliases(specs: RankSpecs, tied: dict[str, str]) -> None:
    """A tied alias is the spec of the param it aliases, marked alias_of: loaded once, never read twice."""
    for alias, to in tied.items():
        if to in specs.per_param:
            specs.per_param[alias] = specs.per_param[to].map(
                lambda base, alias=alias, to=to: ParamSpec(alias, base.style, base.dtype, base.global_shape,
                                                           base.local_shape, base.padding, alias_of=to))


def _file_order(entries: list) -> list[int]:
    """Positions of `entries` in file order (file, then offset), by one integer key each: sorting (file, offset)
    tuples compares the file names again and again (one file holds thousands of tensors)."""
    file_no = {f: i for i, f in enumerate(sorted({e.file for e in entries}))}
    keys = [(file_no[e.file] << 48) + e.offset for e in entries]
    return sorted(range(len(entries)), key=keys.__getitem__)


def _sources(shares: dict[str, list], tensors: dict, layout: Layout, per_node: frozenset = frozenset(),
             home: int | None = None, lazy_layouts=()) -> list:
    """The sources that anyone receives, in file order (file, then offset). Runs once per checkpoint tensor:
    geometry is worked out once per (dtype, shape), broadcast once per distinct takers. home (a rank's plan:
    its block): a source other blocks own (spans.away) is an Elsewhere, made without its shares; those of
    `lazy_layouts` (expert params) are found layer by layer (other_blocks.py)."""
    sources, geometries, broadcasts = [], {}, {}
    planned, of_layouts, world = Source.planned, SourceShares.of_layouts, layout.world
    decide = Away(layout, home) if home is not None else None
    in_bulk = elsewhere_in_bulk(lazy_layouts, shares, tensors, decide, per_node) if decide else {}
    names = list(shares)
    entries = list(map(tensors.__getitem__, names))
    run, merged = [], {}   # other blocks' fixed Elsewheres since the last source planned; runs merged, by ids
    for i in _file_order(entries):
        name, e = names[i], entries[i]
        gone = in_bulk.get(name)
        if gone is not None and gone.fixed:
            run.append(gone)
            continue
        if run:
            sources.append(_merged(run, merged))
            run = []
        if gone is not None:
            sources.append(gone)
            continue
        ss = shares[name]
        shape = tuple(e.shape)
        geometry = geometries.get((e.dtype, shape))
        if geometry is None:
            geometry = geometries[e.dtype, shape] = source_geometry(shape, e.dtype)
        rows, row_bytes, _, isz = geometry
        lone = ss[0] if len(ss) == 1 else None
        if lone is not None and type(lone) is not Share:   # one param's layouts make the shares (expert sources)
            takers = lone.takers(name, isz)
            ss = None
        elif type(ss[0]) is not Share or not all(type(s) is Share for s in ss):   # some layouts make their shares
            ss = SourceShares(name, _runs_of_shares(ss), isz)
            takers = ss.takers
        else:
            ss = tuple(ss)
            takers = interned(share_takers(ss, isz))
        twice = name in per_node if per_node else False
        if decide is not None and not twice:
            gone = decide(takers, rows, row_bytes)
            if gone is not None:   # (the run was merged above)
                (run if gone.fixed else sources).append(gone)
                continue
        if ss is None:
            ss = of_layouts(name, lone, takers)
        if type(ss) is tuple:
            broadcast = takers_broadcast(takers, rows, row_bytes, world)
        else:
            key = (id(takers), rows, row_bytes)   # alike expert sources: takers kept alive by their layouts' memo
            broadcast = broadcasts.get(key)
            if broadcast is None:
                broadcast = broadcasts[key] = takers_broadcast(takers, rows, row_bytes, world)
        sources.append(planned(name, e.file, e.offset, e.dtype, shape, ss, broadcast and not twice, twice,
                               geometry[:3], takers))
    if run:
        sources.append(_merged(run, merged))
    return sources


def _merged(run: list, memo: dict):
    """spans.merged_run of a run of Elsewheres, once per distinct run (layer after layer, the same experts')."""
    key = tuple(map(id, run))   # the memo's runs hold their Elsewheres: ids stay unique
    known = memo.get(key)
    if known is None:
        times = collections.Counter(key)
        known = memo[key] = (run, merged_run([(gone, times[id(gone)]) for gone in dict(zip(key, run)).values()]))
    return known[1]


def _runs_of_shares(entries: list) -> list:
    """A source's entries (Shares, or layouts standing for theirs) as SourceShares parts: runs of Shares as lists."""
    parts = []
    for x in entries:
        if isinstance(x, Share):
            if not parts or not isinstance(parts[-1], list):
                parts.append([])
            parts[-1].append(x)
        else:
            parts.append(x)
    return parts
