"""Planning bounded by the tensors that exist: a config.json whose loop range (num_hidden_layers,
num_local_experts, ...) is far beyond what the checkpoint holds is refused before the templates are
expanded, since expanding them costs time and memory per claimed value (200000 claimed layers kept
every rank planning for minutes) only to report each missing name.

Pure: (tensors, rules, config) -> None or PlanError naming the config key, its value and the real count.
"""

from __future__ import annotations

from ..rules import names
from ..errors import PlanError
from ..rules import FamilyRules


def check_loop_bounds(tensors, rules: FamilyRules, config: dict) -> None:
    """PlanError if a loop claims more values than the checkpoint holds by more names than it has tensors
    (a small excess is left to the missing-names check, which says which tensors are absent)."""
    for var, dim in sorted(rules.loops.items()):
        templates = loop_templates(rules, var)
        if not templates:
            continue
        claimed, keys = rules.dim_keys(config, dim)
        found = values_in_checkpoint(tensors, templates, var)
        if not found or claimed <= len(found):  # no evidence (e.g. stacked experts), or nothing past it
            continue
        if (claimed - len(found)) * len(templates) <= len(tensors):
            continue
        shown = ", ".join(f"{k}={config.get(k)!r}" for k in keys) or f"[dims] {dim}"
        example = sorted(templates)[0]
        raise PlanError(f"config.json {shown} ({{{var}}} in 0..{claimed - 1}), but the checkpoint holds "
                        f"{len(found)} (e.g. {names.describe(expand_found(example, var, found))}); the config "
                        f"does not describe these weights: fix {' / '.join(keys) or dim} in config.json (or "
                        "pass --hf-config DIR with the model's own config.json)")


def loop_templates(rules: FamilyRules, var: str) -> set[str]:
    """Every checkpoint-name template of the rules, all forms, that uses the loop variable `var`."""
    return {part for rule in rules.params for form in rule.forms for part in form.parts
            if var in names.variables(part)}


def values_in_checkpoint(tensors, templates: set[str], var: str) -> set[int]:
    """The values of `var` that checkpoint names take under the templates' prefixes up to `{var}`: one pass
    over the names per distinct prefix, each distinct leading part (a layer's) matched once."""
    prefixes = {t[:t.index("{" + var + "}") + len(var) + 2] for t in templates}
    found: set[int] = set()
    for prefix in prefixes:
        found.update(names.match(prefix, lead)[var] for lead in names.leads(prefix, tensors))
    return found


def expand_found(template: str, var: str, found: set[int]) -> list[str]:
    """The template's names at the found values (its other variables at 0), for the message."""
    others = {v: 0 for v in names.variables(template) if v != var}
    return [names.expand(template, **others, **{var: value}) for value in sorted(found)]
