"""The rule keys stored_shape, permute and transform (rules/landing.py), carried out in the plan.

stored_shape: the source is seen in its served shape (the same bytes, row major) once its stored shape is checked,
so every cut, piece and read works on the served shape. permute and transform: a post-load step per param on
every rank holding it (postprocess.py runs them), after the shard has landed: the transfer still moves plain
rectangles of the stored tensor, and a rank rewrites only its own shard, once.

    rotary_halves  runs ((rows, head_dim),): the first `rows` rows of the local shard (0: all), head by head, pairs
                   to halves (a qkv shard is cat[q_r, k_r, v_r]: its q and k heads; v is left as stored)
    neg_exp        every value x -> -exp(x)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from ..errors import PlanError
from ..rules import dims as dim_expr
from .ranks import RankValues, per_group
from .types import Step


@dataclass(frozen=True)
class LandingStep(Step):
    """A permute or transform step; runs: rotary_halves' ((rows, head_dim),), nothing for a transform."""
    runs: tuple[tuple[int, int], ...] = ()


def _shape(exprs: tuple[str, ...], rules, config: dict, where: str) -> tuple[int, ...]:
    return tuple(dim_expr.evaluate(e, lambda name: rules.dim(config, name), where)[0] for e in exprs)


def served_index(targets, index: dict, rules, config: dict) -> dict:
    """`index` with each stored_shape source seen in its served shape; PlanError naming a source stored otherwise."""
    reshaped = [t for t in targets if t.rule.stored_shape and t.sources[0] in index]
    if not reshaped:
        return index
    out = dict(index)
    for t in reshaped:
        (src,) = t.sources
        where = f"{rules.source}: params.{t.rule.target!r}"
        stored = _shape(t.rule.stored_shape, rules, config, f"{where} stored_shape")
        served = _shape(t.rule.shape, rules, config, f"{where} shape")
        found = tuple(index[src].shape)
        if found != stored:
            raise PlanError(f"{src} has shape {list(found)}, but param {t.name} (rules {rules.source}) says it is "
                            f"stored as {list(stored)} = [{', '.join(t.rule.stored_shape)}]; config.json and the "
                            f"checkpoint disagree, or the rule is wrong for this checkpoint")
        if math.prod(served) != math.prod(stored):
            raise PlanError(f"{where}: stored_shape {list(stored)} and shape {list(served)} hold different numbers "
                            f"of elements; a reshape keeps them")
        out[src] = replace(index[src], shape=served)
    return out


def _rows_to_permute(rule, rules, config: dict, tp: int) -> int:
    """Rows of a rank's shard that are q or k heads (a qkv shard), or 0: all of them (kv, column)."""
    if rule.style != "qkv":
        return 0
    heads, kv_heads = rules.dim(config, "heads"), rules.dim(config, "kv_heads")
    return (heads // tp + max(1, kv_heads // tp)) * rules.dim(config, "head_dim")


def steps_of(targets: dict, rules, config: dict, tp: int) -> tuple[LandingStep, ...]:
    """The post-load steps the rules' permute / transform keys ask for, the same on every rank holding the params."""
    steps = []
    for name in sorted(targets):
        rule = targets[name].rule
        if rule.permute is not None:
            head_dim = rules.dim(config, "head_dim")
            steps.append(LandingStep(rule.permute, (name,), (name,),
                                     runs=((_rows_to_permute(rule, rules, config, tp), head_dim),)))
        if rule.transform is not None:
            steps.append(LandingStep(rule.transform, (name,), (name,)))
    return tuple(steps)


def stage(post, targets: dict, rules, config: dict, layout):
    """Each rank's post-load steps with the landing steps appended (after any transpose); refused on a param that
    is also quantized or dequantized while loading (its scales would not follow the rows)."""
    steps = steps_of(targets, rules, config, layout.tp)
    if not steps:
        return post
    mine = {s.inputs[0] for s in steps}

    def appended(rank_steps) -> tuple:
        clash = sorted(n for s in rank_steps if s.op != "transpose" for n in s.inputs + s.outputs if n in mine)
        if clash:
            raise PlanError(f"{clash[0]}: a param the rules permute or transform cannot also be quantized or "
                            f"dequantized while loading; load the checkpoint unquantized")
        return tuple(rank_steps) + steps
    return per_group(appended, post if isinstance(post, RankValues) else RankValues(list(post), layout.world))
