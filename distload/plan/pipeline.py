"""Pipeline stages in the plan: which stages hold each param, and per-rank values kept on those stages only.

vLLM builds on a stage only that stage's layers (the others are PPMissingLayer), the embedding on the first stage
and the final norm and lm_head on the last; with tied embeddings the last stage builds the embedding too, and its
lm_head is that tensor. Layers past the partition (the MTP draft layers, loaded on request: mtp.py) are the last
stage's, where vLLM runs the drafter. So each param's per-rank values (ranks.RankValues) keep their value on the ranks of the
stages that hold it and None on the others (the rank lacks the param): the shares, and with them the reads and the
wire, follow, and a rank reads, receives and holds nothing of another stage's layers.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace

from ..rules import names
from ..errors import PlanError
from ..rules import FamilyRules
from ..topology import Layout
from .ranks import RankSpecs, RankValues
from .types import Share

DEFAULT_SPLIT = "default"   # pp_layers_from of a partition nobody gave: vLLM's get_pp_indices split
LAYER_LOOP = "layer"   # the rules files' loop variable of the decoder layers ({layer})
# Non-layer params on the input side (token and position embeddings), held by the first stage; every other
# non-layer param (final norm, head) is the last stage's. (BLOOM and Falcon: word_embeddings, BLOOM its LayerNorm.)
INPUT_SIDE = re.compile(r"(^|\.)(embed\w*|word_embeddings\w*|tok_embeddings|embedding|wte|wpe)\.")


def draft_stage(layout: Layout) -> int:
    """The stage of the layers past the decoder's (the MTP draft layers, mtp.py): the last, as vLLM runs the
    drafter with the last stage (it takes the last stage's hidden states)."""
    return layout.pp - 1


def num_layers(rules: FamilyRules, config: dict) -> int | None:
    """The decoder layer count the rules loop over (None: the rules have no layer loop)."""
    if LAYER_LOOP not in rules.loops:
        return None
    return rules.dim(config, rules.loops[LAYER_LOOP])


def resolved_layout(layout: Layout, rules: FamilyRules, config: dict) -> Layout:
    """`layout` with the stage partition it plans with (checked against config.json's layer count), so that the
    plan, its report and a save say which layers each stage holds."""
    layers = num_layers(rules, config)
    if layers is None:
        if layout.pp > 1:
            raise PlanError(f"--pp {layout.pp}: the rules {rules.source} have no {{{LAYER_LOOP}}} loop to split into "
                            f"pipeline stages; use --pp 1")
        return layout
    if layers < 1 and layout.pp == 1:
        return layout
    source = layout.pp_layers_from if layout.pp_layers is not None else DEFAULT_SPLIT
    return replace(layout, pp_layers=layout.stage_partition(layers), pp_layers_from=source)


@dataclass(frozen=True)
class Stages:
    """Which pipeline stages hold each param of one plan (a name it does not list: every stage)."""
    layout: Layout
    held: dict

    def of(self, name: str) -> frozenset:
        return self.held.get(name, frozenset(range(self.layout.pp)))

    def holds(self, name: str, rank: int) -> bool:
        return self.layout.pp_rank(rank) in self.of(name)


def stages_of(layout: Layout, targets, companions, tied: dict[str, str]) -> Stages | None:
    """The stages of every target, tied alias and quantization companion; None without pipeline stages.
    `layout` is resolved (resolved_layout: pp_layers is the partition)."""
    if layout.pp == 1:
        return None
    stage_of_layer = [s for s, n in enumerate(layout.pp_layers) for _ in range(n)]
    first_and_last = frozenset({0, layout.pp - 1})

    def place(name: str, template: str) -> frozenset:
        values = names.match(template, name) or {}
        if LAYER_LOOP in values:
            return frozenset({stage_of_layer[values[LAYER_LOOP]] if values[LAYER_LOOP] < len(stage_of_layer)
                              else draft_stage(layout)})
        if name in tied.values():
            return first_and_last          # the embedding, and the last stage's tied head
        return frozenset({0 if INPUT_SIDE.search(name) else layout.pp - 1})

    held = {t.name: place(t.name, t.rule.target) for t in targets}
    held.update({alias: place(alias, alias) for alias in tied})
    for c in companions:
        held[c.name] = held.get(c.weight, frozenset(range(layout.pp)))
    return Stages(layout, held)


def with_step_outputs(stages: Stages | None, post) -> Stages | None:
    """`stages`, with every param a post-load step makes beside its weight (online quantization's scales) held by
    that weight's stages: listed nowhere, a scale would be expected on every stage, and written only on one."""
    if stages is None:
        return None
    held = dict(stages.held)
    for steps in post:
        for step in steps:
            placed = held.get(step.outputs[0])
            for name in step.outputs[1:] if placed is not None else ():
                held.setdefault(name, placed)
    return Stages(stages.layout, held)


def masked(values: RankValues, stages: frozenset, layout: Layout) -> RankValues:
    """`values` on the ranks of `stages`, None on every other rank (period: a multiple of pp x tp)."""
    if len(stages) == layout.pp:
        return values
    period = math.lcm(values.period, layout.pp * layout.tp)
    base = values.period
    return RankValues((), layout.world, period=period,
                      make=lambda i: values.value(i % base) if layout.pp_rank(i) in stages else None)


def masked_planned(planned: dict, stages: Stages | None, as_rank_values) -> dict:
    """Each planned param's (specs, layouts) kept on its stages' ranks."""
    if stages is None:
        return planned
    layout = stages.layout
    return {name: tuple(masked(as_rank_values(v, layout), stages.of(name), layout) for v in pair)
            for name, pair in planned.items()}


def masked_specs(specs, stages: Stages | None):
    """Per-rank specs (RankSpecs, or a list of {name: spec}) without other stages' params."""
    if stages is None:
        return specs
    if isinstance(specs, RankSpecs):
        return RankSpecs({n: masked(v, stages.of(n), stages.layout) for n, v in specs.per_param.items()}, specs.world)
    return [{n: s for n, s in rank_specs.items() if stages.holds(n, r)} for r, rank_specs in enumerate(specs)]


def masked_steps(post, stages: Stages | None):
    """Per-rank post-load steps without those that make another stage's params."""
    if stages is None:
        return post
    return [tuple(step for step in steps if stages.holds(step.outputs[0], r)) for r, steps in enumerate(post)]


def check_every_source_used(claimed: set, shares: dict, stages: Stages | None) -> None:
    """Every checkpoint tensor a target claims is delivered to some stage (so none is silently left unread)."""
    if stages is None:
        return
    unused = sorted(claimed - set(shares))
    if unused:
        raise PlanError(f"--pp {stages.layout.pp}: no pipeline stage holds {names.describe(unused)}, which the "
                        f"rules claim; the stage assignment lost them (report this with the rules file)")


def split_by_node(shares: dict[str, list], stages: Stages | None) -> frozenset:
    """Sources of params that several stages hold (a tied embedding: the first and the last stage), when their
    ranks sit on several nodes that each have a reader: their shares are split by node in place, and the names
    returned are read on each such node for its own ranks (vLLM's engines read per stage; sending the embedding
    from one stage's node to the other's would be the only weight bytes to cross between them)."""
    if stages is None or not stages.layout.reads_by_node:
        return frozenset()
    layout = stages.layout
    nodes = range(layout.world // layout.local_world)
    if set(layout.reader_nodes) != set(nodes):
        return frozenset()
    split = set()
    for name, ss in shares.items():
        if not all(len(stages.of(s.param)) > 1 for s in ss):
            continue
        parts = [Share(part, s.param, s.piece) for s in ss for n in nodes
                 if (part := s.ranks.part_on_node(n, layout.local_world)) is not None]
        if len(parts) > len(ss):
            shares[name] = parts
            split.add(name)
    return frozenset(split)
