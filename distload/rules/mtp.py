"""Multi-token-prediction (MTP) layers: the speculative-decoding draft that DeepSeek-V3/R1 and GLM-4.5 ship
after their decoder layers, loaded on request (`--mtp`, `mtp=`).

A family file declares them as data (configs/_deepseek_moe.toml):

    [mtp]
    count = "nextn"      # [dims] entry: how many MTP layers follow the decoder layers (0: none)
    loop = "layer"       # the loop they continue: model.layers.{layer} for layer in [layers, layers + count)

Each MTP layer is a decoder block (the family's {layer} params, cut as a decoder layer's) plus params only it
has, declared in [params] with `only = "<a [sets] entry from the decoder layer count>"`, so that they expand to
nothing while the loop stops at the decoder layers. The modes (vLLM serves the draft as DeepSeekMTP):

    off      the loop stops at the decoder layers; the MTP tensors are ignored by the family's drop_past
    include  the target model and its MTP layers (one load serves the target and its drafter)
    only     the MTP layers alone: what vLLM's drafter load asks for; the rest is ignored

Pure: (rules, config, mode) -> rules with the loop's span set (FamilyRules.loop_spans); no per-model code.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from . import names
from ..errors import DistloadError, PlanError, RuleError

MODES = ("off", "include", "only")
MTP_KEYS = {"count", "loop"}
MTP_HINT = "--mtp include (or mtp=\"include\"; \"only\" for the draft alone)"


@dataclass(frozen=True)
class MtpRule:
    """A family's [mtp] table: the count of MTP layers and the loop they continue."""
    count: str                      # [dims] entry: MTP layers after the decoder layers
    loop: str = "layer"             # [loops] variable they continue


def check_mode(mode) -> None:
    """DistloadError naming the option unless `mode` is one of MODES."""
    if mode not in MODES:
        raise DistloadError(f"--mtp {mode!r} (mtp=): choose one of {', '.join(MODES)} (off: the default, the MTP "
                            f"layers read not at all)")


def parse_mtp(table, where: str, dims: dict, loops: dict) -> MtpRule | None:
    """The [mtp] table of a family file, validated (None: the family declares no MTP layers)."""
    if not table:
        return None
    if not isinstance(table, dict) or set(table) - MTP_KEYS or "count" not in table:
        raise RuleError(f"{where}: [mtp] needs 'count' (a [dims] entry) and may have 'loop'; got {table!r}")
    rule = MtpRule(count=table["count"], loop=table.get("loop", "layer"))
    if rule.count not in dims:
        raise RuleError(f"{where}: [mtp] count names dim {rule.count!r}, not in [dims]")
    if rule.loop not in loops:
        raise RuleError(f"{where}: [mtp] loop {rule.loop!r} is not in [loops]")
    return rule


def layer_span(rules, config: dict) -> range:
    """The MTP layers' loop values for this config: [decoder layers, decoder layers + count) (empty: none)."""
    if rules.mtp is None:
        return range(0)
    first = rules.dim(config, rules.loops[rules.mtp.loop])
    return range(first, first + rules.dim(config, rules.mtp.count))


def with_mtp(rules, config: dict, mode: str):
    """`rules` for a load with `--mtp mode`; PlanError naming num_nextn_predict_layers when the checkpoint has no
    MTP layers to load."""
    check_mode(mode)
    if mode == "off":
        return rules
    span = layer_span(rules, config)
    if not span:
        declared = "declare none" if rules.mtp is None else f"count them by [dims] {rules.mtp.count}"
        raise PlanError(f"--mtp {mode}: this checkpoint has no multi-token-prediction layers (config.json "
                        f"num_nextn_predict_layers={config.get('num_nextn_predict_layers')!r}; the rules "
                        f"{rules.source} (family {rules.name}) {declared}); load it with --mtp off (the default)")
    loop = rules.mtp.loop
    changes = dict(mtp_mode=mode, loop_spans={**rules.loop_spans, loop: (0, span.stop)})
    if mode == "only":
        changes["loop_spans"][loop] = (span.start, span.stop)
        kept = [p for p in rules.params if loop in names.variables(p.target)]
        gone = [p for p in rules.params if p not in kept]
        changes.update(params=tuple(kept), ties=(),
                       drop=rules.drop + tuple(sorted({part for p in gone for f in p.forms for part in f.parts})))
    return dataclasses.replace(rules, **changes)


def report_fields(rules, config: dict, layout) -> dict:
    """The report's `mtp`: the MTP layers of the checkpoint, whether they were loaded, and on which stage."""
    span = layer_span(rules, config)
    mode = rules.mtp_mode
    out = {"mode": mode, "layers": list(span)}
    if not span:
        return out
    if mode == "off":
        out["skipped"] = f"read 0 bytes (not part of the serving model); to load them for speculative decoding: " \
                         f"{MTP_HINT}"
    else:
        out["stage"] = layout.pp - 1   # vLLM runs the drafter with the last pipeline stage
    return out


def describe(fields: dict) -> str | None:
    """One line for `distload inspect` (None: the checkpoint has no MTP layers)."""
    if not fields.get("layers"):
        return None
    layers = ", ".join(str(v) for v in fields["layers"])
    if fields["mode"] == "off":
        return f"MTP layers {layers}: skipped, {fields['skipped']}"
    return f"MTP layers {layers}: loaded ({fields['mode']}) on pipeline stage {fields['stage']}"
