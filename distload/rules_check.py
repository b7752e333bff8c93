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
from .errors import CheckpointError, DistloadError
from .plan import build_plan
from .quant import for_load
from .rules import FamilyRules, parse_rules
from .rules.landing import TRANSFORMS
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


# What each head style assumes of its source's rows (README, "The fused-qkv styles"), for one line of the check.
ASSUMES = {"qkv": "[q heads; k heads; v heads] (or q, k, v apart)",
           "qkv_packed": "packed per kv head: [its q heads, k, v] for kv head 0, then 1, ...",
           "qkv_grouped": "packed per kv head: [its q heads, k, v] for kv head 0, then 1, ...",
           "kv": "[kv head 0; kv head 1; ...]"}


def _local_heads(style: str, spec, heads: int, kv_heads: int, tp: int) -> tuple[int, list[tuple[str, int]]]:
    """(head_dim, [(part, first local row of its first head)]) of rank 0's shard of a head-style param."""
    per_group = heads // kv_heads
    rows = spec.global_shape[0] // (kv_heads if style == "kv" else heads + 2 * kv_heads)
    if style == "kv":
        return rows, [("kv", 0)]
    if style == "qkv_grouped":
        q_local = per_group if tp <= kv_heads else heads // tp
    else:
        q_local = heads // tp
    kv_local = 1 if style == "qkv_grouped" else max(1, kv_heads // tp)
    return rows, [("q", 0), ("k", q_local * rows), ("v", (q_local + kv_local) * rows)]


def _head_order(pieces: list, spec, rule, rules: FamilyRules, config: dict, tp: int) -> list[str]:
    """The source rows of the first head of each part on rank 0, and the rule's intra-head order: a wrong head
    style (qkv for a packed source) plans with the right shapes, and shows here."""
    style = rule.style
    head_dim, firsts = _local_heads(style, spec, rules.dim(config, "heads"), rules.dim(config, "kv_heads"), tp)
    shown = []
    for part, row in firsts:
        pc = next((pc for pc in pieces if pc.dst_row <= row < pc.dst_row + pc.rows[1] - pc.rows[0]), None)
        if pc is not None:
            first = pc.rows[0] + row - pc.dst_row
            shown.append(f"{part} <- {pc.source} rows [{first}, {first + head_dim})")
    out = [f"    {style} assumes the source rows are {ASSUMES[style]}",
           f"    rank 0's first head of each part ({head_dim} rows): " + "; ".join(shown)]
    if rule.permute == "rotary_halves":
        out.append("    inside each q / k head: stored rows 0, 2, 4, ..., then 1, 3, 5, ... (permute = rotary_halves, "
                   "after landing)")
    return out


def _landing_lines(rule, spec) -> list[str]:
    out = []
    if rule.stored_shape:
        out.append(f"    stored as [{', '.join(rule.stored_shape)}], served as {list(spec.global_shape)} (stored_shape)")
    if rule.permute is not None and rule.style not in ASSUMES:
        out.append(f"    inside each head of head_dim rows: stored rows 0, 2, 4, ..., then 1, 3, 5, ... "
                   f"(permute = {rule.permute}, after landing)")
    if rule.transform is not None:
        out.append(f"    served as {TRANSFORMS[rule.transform]} of the stored x (transform = {rule.transform}, "
                   f"after landing)")
    return out


def _param_lines(plan, rules: FamilyRules, config: dict) -> list[str]:
    first_row: dict[str, dict] = {}   # param -> {source: its first destination row on rank 0}: parts in order
    pieces: dict[str, list] = {}      # param -> rank 0's pieces
    for src in plan.sources.values():
        for d in src.deliveries:
            if d.rank == 0:
                rows = first_row.setdefault(d.param, {})
                rows[src.name] = min(rows.get(src.name, d.piece.dst_row), d.piece.dst_row)
                pieces.setdefault(d.param, []).append(d.piece)
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
        if rule is not None and rule.style in ASSUMES and not rule.transposed:
            out += _head_order(pieces.get(example, []), spec, rule, rules, config, plan.layout.tp)
        if rule is not None:
            out += _landing_lines(rule, spec)
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
    if not (Path(checkpoint_dir) / "config.json").is_file():   # else every dim reads "config.json has no <key>"
        raise CheckpointError(f"{checkpoint_dir}: no config.json; rules check takes the model's sizes from it (the "
                              f"Hugging Face config.json saved beside the weights): put it there")
    return explain(parse_rules(Path(rules_file)), dict(index.tensors), dict(index.config), tp)
