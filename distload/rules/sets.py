"""Subsets of a loop's values from config.json (`[sets]` of a family file), and tensors past a loop's end.

    [sets.moe_layers]
    loop = "layer"
    every = "sparse_step"      # dim n: values v with (v + 1) % n == 0 (Qwen's decoder_sparse_step)
    stride = "moe_freq"        # dim n: values v with v % n == 0 (DeepSeek's moe_layer_freq)
    from = "first_dense"       # dim k: values v >= k (DeepSeek's first_k_dense_replace)
    upto = "moe_end"           # dim k: values v <= k (Ernie-4.5's moe_layer_end_index)
    skip = "mlp_only_layers"   # config.json key holding a list of values left out (absent: none)
    [sets.attention]
    loop = "layer"
    period = "attn_period"     # dims n, k: values v with v % n == k (Jamba's attn_layer_period / _offset)
    offset = "attn_offset"
    [sets.full_attention]
    loop = "layer"
    list = "layer_types"       # config.json key holding one entry per loop value ...
    equals = "full_attention"  # ... and the entry of the members (hybrid models' layer_types)

`drop_past = ["model.layers.{layer}"]` ignores every tensor under that template whose loop values are outside
the loop's range: past it (GLM-4.5's and DeepSeek's multi-token-prediction layers after the decoder layers), or
before a span's first value (the decoder layers when only the MTP layers are loaded, mtp.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from . import names
from .dims import config_value
from ..errors import RuleError

SET_KEYS = {"loop", "every", "stride", "from", "upto", "period", "offset", "skip", "list", "equals"}


@dataclass(frozen=True)
class LoopSet:
    """A subset of one loop's values, from config.json (e.g. the MoE layers of a partly dense model)."""
    name: str
    loop: str
    every: str | None = None        # dim n: (v + 1) % n == 0
    start: str | None = None        # dim k: v >= k            (TOML key `from`)
    skip: str | None = None         # config.json key of a list of values left out
    per_value: str | None = None    # config.json key of a list with one entry per value (TOML key `list`)
    equals: str | None = None       # members: the values whose per_value entry equals this
    stride: str | None = None       # dim n: v % n == 0
    upto: str | None = None         # dim k: v <= k
    period: str | None = None       # dim n: v % n == offset ...
    offset: str | None = None       # ... dim k (0 when absent)


def parse_sets(data: dict, where: str) -> dict[str, LoopSet]:
    out = {}
    for set_name, table in data.get("sets", {}).items():
        if not isinstance(table, dict) or set(table) - SET_KEYS or "loop" not in table:
            raise RuleError(f"{where}: [sets.{set_name}] needs 'loop' and may have {sorted(SET_KEYS - {'loop'})}; "
                            f"got {sorted(table) if isinstance(table, dict) else table!r}")
        if table["loop"] not in data.get("loops", {}):
            raise RuleError(f"{where}: [sets.{set_name}] loop {table['loop']!r} is not in [loops]")
        for key in ("every", "stride", "from", "upto", "period", "offset"):
            if key in table and table[key] not in data.get("dims", {}):
                raise RuleError(f"{where}: [sets.{set_name}] {key} names dim {table[key]!r}, not in [dims]")
        if "offset" in table and "period" not in table:
            raise RuleError(f"{where}: [sets.{set_name}] offset needs period (members: v % period == offset)")
        if ("list" in table) != ("equals" in table):
            raise RuleError(f"{where}: [sets.{set_name}] 'list' and 'equals' go together (the config.json list "
                            f"and the entry of the members)")
        out[set_name] = LoopSet(set_name, table["loop"], table.get("every"), table.get("from"), table.get("skip"),
                                table.get("list"), table.get("equals"), table.get("stride"), table.get("upto"),
                                table.get("period"), table.get("offset"))
    return out


def members(s: LoopSet, dim, config: dict, values: range, where: str) -> set[int]:
    """The values of `values` in set `s`; dim(name) evaluates a [dims] name against config.json."""
    every = dim(s.every) if s.every else 1
    stride = dim(s.stride) if s.stride else 1
    start = dim(s.start) if s.start else 0
    upto = dim(s.upto) if s.upto else max(values, default=0)
    period = dim(s.period) if s.period else 1
    offset = dim(s.offset) if s.offset else 0
    skipped = (config_value(config, s.skip) or []) if s.skip else []
    if every < 1 or stride < 1 or period < 1 or not 0 <= offset < period or not isinstance(skipped, list) or \
            not all(isinstance(v, int) for v in skipped):
        raise RuleError(f"{where}: [sets] {s.name}: config.json gives every={every}, stride={stride}, period={period}, "
                        f"offset={offset}, {s.skip}={skipped!r}; expected every, stride, period >= 1, "
                        f"0 <= offset < period and a list of integers")
    chosen = {v for v in values if start <= v <= upto and (v + 1) % every == 0 and v % stride == 0 and
              v % period == offset and v not in skipped}
    if s.per_value is None:
        return chosen
    entries = config_value(config, s.per_value)
    if not isinstance(entries, list) or len(entries) < len(values):
        raise RuleError(f"{where}: [sets] {s.name}: config.json {s.per_value} should be a list with one entry per "
                        f"{s.loop} ({len(values)}), got {entries!r}")
    return {v for v in chosen if entries[v] == s.equals}


def past_loops(templates, tensor_names, ranges: dict[str, range]) -> set[str]:
    """The names under one of `templates` (the name itself or `name.<anything>`) with a loop value outside its
    range: tensors after the layer loop (or before its span), declared by template rather than by name."""
    out = set()
    for template in templates:
        # A name's leading part (`model.layers.61`) decides: each distinct one is judged once, and only the
        # names under an outside one are matched whole (`name.<anything>`: no line break, as the regex's `.`).
        outside = {lead for lead in names.leads(template, tensor_names)
                   if any(v not in ranges[k] for k, v in names.match(template, lead).items())}
        if outside:
            leading = names.leading(template)
            under = re.compile(leading.pattern + r"(?:\..*)?")
            out.update(n for n in tensor_names if under.fullmatch(n) and leading.match(n)[0] in outside)
    return out
