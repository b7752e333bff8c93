"""Rules -> targets: the family's templates expanded over config.json's loops, matched to the checkpoint.

A target is one serving param and the checkpoint tensors it is made of. Matching says which checkpoint
tensors no target claims (`unexpected`), which a target needs but the checkpoint lacks (`missing`), and
which are dropped on purpose (`ignored`: a `drop` rule, or a tied alias's own copy).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from ..rules import sets as loop_sets, names
from ..errors import PlanError, RuleError
from ..rules import FamilyRules, ParamRule, flag_holds
from .types import Target


def loop_ranges(rules: FamilyRules, config: dict) -> dict[str, range]:
    return {var: rules.loop_range(config, var) for var in rules.loops}


def expand_all(template: str, ranges: dict[str, range], fixed: dict[str, int] | None = None) -> list[tuple[dict, str]]:
    """Every (loop values, name) of `template` over `ranges`, with `fixed` variables held."""
    fixed = fixed or {}
    free = [v for v in names.variables(template) if v not in fixed]
    out = []
    for combo in itertools.product(*(ranges[v] for v in free)):
        values = {**fixed, **dict(zip(free, combo))}
        out.append((values, names.expand(template, **values)))
    return out


def _in_sets(rule: ParamRule, rules: FamilyRules, config: dict, ranges: dict[str, range]):
    """A predicate on a target's loop values: does the target exist there (`only` / `unless` a [sets] name)?"""
    checks = []
    for set_name, want in ((rule.only, True), (rule.unless, False)):
        if set_name is not None:
            loop = rules.sets[set_name].loop
            checks.append((loop, rules.members(config, set_name, ranges[loop]), want))
    return lambda values: all((values[loop] in members) == want for loop, members, want in checks)


def _expand_form(form: ParamRule, name: str, values: dict, ranges: dict[str, range]) -> Target:
    if form.style == "expert" and not form.stacked:
        experts = ranges["expert"]
        if "expert" in values:   # a target named per expert: expanded name by name, which refuses the second value
            per_expert = tuple(tuple(names.expand(p, **values, expert=e) for p in form.parts) for e in experts)
        else:   # each part's names over all experts at once
            per_expert = tuple(zip(*(names.expand_each(p, "expert", experts, **values) for p in form.parts)))
        return Target(name, form, tuple(itertools.chain.from_iterable(per_expert)), per_expert)
    return Target(name, form, tuple(names.expand(p, **values) for p in form.parts))


def expand_targets(rules: FamilyRules, config: dict, tensors) -> tuple[list[Target], dict[str, str]]:
    """Expanded targets, and the tied targets {alias: param it aliases} active for this config.

    A rule with alternative checkpoint forms (per-expert or stacked experts, ...) takes, per target, the
    first form whose tensors are all in the checkpoint, else the most complete one (so `missing` names
    what is really absent).
    """
    ranges = loop_ranges(rules, config)
    tied = {t.target: t.to for t in rules.ties if flag_holds(t.when, config)}
    targets = []
    for rule in rules.params:
        if rule.when is not None and not flag_holds(rule.when, config):
            continue  # e.g. Cohere's q/k norms exist only with use_qk_norm
        exists = _in_sets(rule, rules, config, ranges)
        for values, name in expand_all(rule.target, ranges):
            if name in tied or not exists(values):
                continue
            forms = [_expand_form(form, name, values, ranges) for form in rule.forms]
            present = [sum(map(tensors.__contains__, t.sources)) for t in forms]
            complete = [t for t, n in zip(forms, present) if n == len(t.sources)]
            targets.append(complete[0] if complete else forms[present.index(max(present))])
    return targets, tied


def _dropped(tensors, templates) -> set[str]:
    """The names some `drop` template takes: the name it spells (with loop variables), or with a trailing `.*`
    every name under that prefix (Qwen3-Next's `mtp.*` speculative-decoding head, not part of the serving
    model). One regex filter over the names per template."""
    out = set()
    for template in templates:
        if template.endswith(".*"):
            head = template[:-1]
            out.update(n for n in tensors if n.startswith(head))
        else:
            out.update(filter(names.fullmatcher(template), tensors))
    return out


@dataclass(frozen=True)
class Match:
    """The checkpoint against the targets: what is planned and what is not, each name list sorted."""
    targets: list[Target]               # the targets whose every source is in the checkpoint
    missing: list[str]
    unexpected: list[str]
    ignored: list[str]
    # (target, its sources present, its sources absent) for each target the checkpoint holds only part of: a
    # fused param (gate_up_proj) cannot be written from some of its parts
    incomplete: tuple[tuple[str, tuple[str, ...], tuple[str, ...]], ...] = ()


def match_checkpoint(targets: list[Target], claimants: list, tied: dict[str, str], tensors, rules: FamilyRules,
                     config: dict, strict: bool) -> Match:
    """Match the checkpoint's tensors to `targets` (and `claimants`, e.g. scale companions, which claim
    sources too); strict: refuse any missing or unexpected tensor, naming them and the fix."""
    claimed: dict[str, str] = {}
    for t in targets + claimants:
        mine = dict.fromkeys(t.sources, t.name)
        if len(mine) < len(t.sources) or not claimed.keys().isdisjoint(mine):
            _refuse_double_claim(claimed, t, rules)
        claimed.update(mine)
    # Sources of a tied alias that the checkpoint still carries are read by nobody: the alias is the embedding.
    tied_sources = set()
    for alias in tied:
        for rule in rules.params:
            if rule.target == alias:
                tied_sources.update(p for form in rule.forms for p in form.parts)
    dropped = _dropped(tensors, rules.drop)
    dropped |= loop_sets.past_loops(rules.drop_past, tensors, loop_ranges(rules, config))
    ignored = sorted(dropped | {s for s in tied_sources if s in tensors})
    missing_by_target = {t.name: list(itertools.filterfalse(tensors.__contains__, t.sources)) for t in targets}
    missing = sorted(s for ss in missing_by_target.values() for s in ss)
    absent = len(missing) + sum(len(list(itertools.filterfalse(tensors.__contains__, c.sources))) for c in claimants)
    unexpected = _unexpected(tensors, claimed, ignored, absent)
    if strict and (missing or unexpected):
        msg = [f"checkpoint does not match rules {rules.source} (family {rules.name})"]
        if missing:
            msg.append(f"missing {len(missing)} tensor(s): {names.describe(missing)}")
        if unexpected:
            msg.append(f"unexpected {len(unexpected)} tensor(s): {names.describe(unexpected)}")
        msg.append("fix: use the rules file for this architecture (--config PATH), or pass --no-strict to load what matches")
        raise PlanError("; ".join(msg))
    incomplete = tuple((t.name, tuple(s for s in t.sources if s in tensors), tuple(missing_by_target[t.name]))
                       for t in targets if 0 < len(missing_by_target[t.name]) < len(t.sources))
    return Match([t for t in targets if not missing_by_target[t.name]], missing, unexpected, ignored, incomplete)


def _unexpected(tensors, claimed: dict[str, str], ignored: list[str], absent: int) -> list[str]:
    """The checkpoint's tensors that nothing claims or ignores, sorted. `absent` claimed names are not in the
    checkpoint and every ignored one is: when the counts say each tensor is covered (the usual case), the
    names need no set difference."""
    covered = len(claimed) - absent + sum(1 for n in ignored if n not in claimed)
    if covered == len(tensors):
        return []
    return sorted(set(tensors).difference(claimed, ignored))


def _refuse_double_claim(claimed: dict[str, str], target, rules: FamilyRules) -> None:
    """RuleError naming the first of the target's sources that is claimed already (by another target, or twice
    by this one)."""
    for s in target.sources:
        if s in claimed:
            raise RuleError(f"{rules.source}: checkpoint tensor {s!r} is claimed by both {claimed[s]!r} and "
                            f"{target.name!r}")
        claimed[s] = target.name
