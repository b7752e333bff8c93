"""`distload rules check FILE CKPT`: how a rules file maps a checkpoint, for a person writing a family.

It plans the load (metadata only, no byte read) on one rank at the given tp and explains: every [dims] value
and the config.json keys it came from; per param template, its style, the checkpoint tensors it takes (with
their shapes and dtypes), the full shape the rules expect and the dims used; then what the rules ignore, what
they miss, and what is left unmapped. An error (a shape the rules refuse, a tp that splits a head) is shown
with the mapping up to it, so a wrong rule is caught before any load.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .rules import names
from .plan import expected_shapes
from .checkpoint import discover
from .errors import DistloadError
from .plan import build_plan
from .quant import for_load
from .rules import FamilyRules, parse_rules
from .topology import Layout


@dataclass(frozen=True)
class CheckResult:
    ok: bool                     # planned, nothing missing, nothing unmapped
    lines: tuple[str, ...]

    @property
    def text(self) -> str:
        return "\n".join(self.lines)


def _dims_lines(rules: FamilyRules, config: dict) -> list[str]:
    out = ["dims:"]
    for name, expr in rules.dims.items():
        try:
            value, keys = rules.dim_keys(config, name)
            out.append(f"  {name} = {value}   ({expr!r}: " + ", ".join(f"{k}={config[k]}" for k in keys) + ")")
        except DistloadError as exc:
            out.append(f"  {name}: not available ({exc})")
    return out


def _rule_of(rules: FamilyRules, param: str):
    return next((r for r in rules.params if names.match(r.target, param) is not None), None)


def _param_lines(plan, rules: FamilyRules, config: dict) -> list[str]:
    first_row: dict[str, dict] = {}   # param -> {source: its first destination row on rank 0}: parts in order
    for src in plan.sources.values():
        for d in src.deliveries:
            if d.rank == 0:
                rows = first_row.setdefault(d.param, {})
                rows[src.name] = min(rows.get(src.name, d.piece.dst_row), d.piece.dst_row)
    takes = {param: [plan.sources[s] for s in sorted(rows, key=rows.get)] for param, rows in first_row.items()}
    by_rule: dict[str, list[str]] = {}
    for param in plan.specs[0]:
        rule = _rule_of(rules, param)
        by_rule.setdefault(rule.target if rule else param, []).append(param)
    out = ["params (rank 0 of the plan; one example per template):"]
    for template, params in by_rule.items():
        example = params[0]
        spec = plan.specs[0][example]
        rule = _rule_of(rules, example)
        style = f"{spec.style}/{rule.inner}" if rule and rule.inner else spec.style
        head = f"  {template}  [{style}] x{len(params)}: global {list(spec.global_shape)}, rank 0 holds {list(spec.local_shape)}"
        if spec.alias_of:
            out.append(f"{head}, tied to {spec.alias_of}")
            continue
        out.append(head)
        sources = takes.get(example, [])
        shown = ", ".join(f"{s.name} {list(s.shape)} {s.dtype}" for s in sources[:4])
        more = f", ... ({len(sources) - 4} more)" if len(sources) > 4 else ""
        out.append(f"    from {shown}{more}")
        if rule is not None and rule.transposed:
            out.append("    stored transposed (last two axes swapped): cut as stored, turned on landing")
        if rule is not None:
            logical = expected_shapes.logical_shape(rule, example, rules, config)
            if logical is None:
                out.append("    shape: not declared (add shape = [...] so the plan checks it)")
            else:
                used = ", ".join(f"{k}={config.get(k)}" for k in logical.keys)
                out.append(f"    shape [{', '.join(logical.formula)}] = {list(logical.shape)}   ({used})")
    return out


def explain(rules: FamilyRules, tensors: dict, config: dict, tp: int = 1) -> CheckResult:
    """The explanation of how `rules` map a checkpoint's `tensors` (entries) under `config` at `tp`."""
    lines = [f"rules {rules.source} (family {rules.name}) over {len(tensors)} checkpoint tensors at tp {tp}"]
    lines += _dims_lines(rules, config)
    try:
        plan = build_plan(tensors, config, rules, Layout(world=tp, tp=tp), strict=False, quantization=for_load(config))
    except DistloadError as exc:
        return CheckResult(False, tuple(lines + [f"error: {exc}"]))
    lines += _param_lines(plan, rules, config)
    for label, found in (("ignored by rule", plan.ignored), ("missing (the rules want, the checkpoint lacks)",
                         plan.missing), ("unmapped (no rule takes them)", plan.unexpected)):
        lines.append(f"{label}: {len(found)}" + (f": {names.describe(found, limit=20)}" if found else ""))
    ok = not plan.missing and not plan.unexpected
    lines.append("OK: every checkpoint tensor is mapped, and every expected shape and dtype holds" if ok else
                 "NOT OK: fix the rules (params, drop, drop_past) or check that this is the right checkpoint")
    return CheckResult(ok, tuple(lines))


def check(rules_file: str, checkpoint_dir: str, tp: int = 1) -> CheckResult:
    """`distload rules check FILE CKPT [--tp N]`: parse FILE, index CKPT (headers only), explain."""
    index = discover(checkpoint_dir)
    return explain(parse_rules(Path(rules_file)), dict(index.tensors), dict(index.config), tp)
