"""Every checkpoint tensor a rule claims, checked against the full shape and dtype the rules and config.json
imply, before any byte is read (DESIGN §4.5: shape-blind loads are silent wrong loads).

A param's *logical* shape is its `shape` in the rules (one dim expression per axis; for style expert the shape
of one expert), or, where a style fixes it, derived: vocab = [vocab, hidden], qkv = [(heads + 2 * kv_heads) *
head_dim, hidden] (a bias: no hidden). Each source's expected shape follows from the form: one source holds the
whole param (stacked experts: [experts, *shape]); several sources split its dim 0 (q/k/v by heads, `split`
dims, else equal parts); `transposed` sources store it with the last two axes swapped.

Dtype policy (one place, explicit): a param is floating point. `dtype = "float"` (the default) takes the
checkpoint's weight dtype, the float dtype holding the most bytes, and no other width: distload never casts,
so a param of another width would load as stored. `dtype = "any-float"` accepts any float width (norms or
routers some checkpoints keep in F32); `dtype = "float32"` accepts any float width and delivers the param as F32
(converted while its pieces land: vLLM keeps DeepSeek's e_score_correction_bias in fp32 whatever is stored).
A quantized weight only in what its quantization stores (fp8, int8 codes: quant/ checks the scales); other
integer and bool dtypes are always refused.
"""

from __future__ import annotations

import math
import operator
from collections import Counter
from dataclasses import dataclass

from ..rules import dims as dim_expr
from ..errors import PlanError, RuleError

FLOATS = ("F64", "F32", "F16", "BF16")
FP8S = ("F8_E4M3", "F8_E5M2")
_DTYPE, _NBYTES = operator.attrgetter("dtype"), operator.attrgetter("nbytes")


@dataclass(frozen=True)
class Expected:
    """What one checkpoint tensor must look like, and where each number came from."""
    source: str
    shape: tuple[int, ...]
    formula: tuple[str, ...]        # per axis, the expression that gave it
    keys: tuple[str, ...]           # config.json keys used
    transposed: bool = False        # stored with the last two axes swapped


@dataclass(frozen=True)
class LogicalShape:
    shape: tuple[int, ...]
    formula: tuple[str, ...]
    keys: tuple[str, ...]
    values: dict                    # dim name -> value, for messages


def shape_exprs(rule, target_name: str, rules) -> tuple[str, ...]:
    """The rule's declared shape, or the one its style implies; () when neither gives one."""
    if rule.shape:
        return rule.shape
    style = rule.inner if rule.style == "expert" else rule.style
    have = set(rules.dims)
    if style == "vocab" and {"vocab", "hidden"} <= have:
        return ("vocab", "hidden")
    if style in ("qkv", "qkv_grouped", "qkv_packed") and {"heads", "kv_heads", "head_dim", "hidden"} <= have:
        rows = "(heads + 2 * kv_heads) * head_dim"
        return (rows,) if target_name.endswith(".bias") else (rows, "hidden")
    return ()


def logical_shape(rule, target_name: str, rules, config: dict, memo: dict | None = None) -> LogicalShape | None:
    """The param's full logical shape from its rule and config.json; None when the rule gives none. `memo`
    keeps the shapes evaluated per rule and expressions (a rule's targets over the layers share theirs)."""
    exprs = shape_exprs(rule, target_name, rules)
    if not exprs:
        return None
    if memo is not None:
        key = (id(rule), exprs)
        if key not in memo:
            memo[key] = logical_shape(rule, target_name, rules, config)
        return memo[key]
    keys, values = [], {}

    def lookup(dim_name: str):
        value, used = rules.dim_keys(config, dim_name)
        keys.extend(used)
        values[dim_name] = value
        return value

    where = f"{rules.source}: params.{rule.target!r} shape"
    shape = tuple(dim_expr.evaluate(e, lookup, where)[0] for e in exprs)
    return LogicalShape(shape, tuple(exprs), tuple(dict.fromkeys(keys)), values)


def _row_splits(rule, sources: int, logical: LogicalShape, rules, config: dict) -> list[tuple[int, str]]:
    """(rows, formula) of each of `sources` parts that split dim 0 of the logical shape."""
    style = rule.inner if rule.style == "expert" else rule.style
    if style == "qkv" and sources == 3:
        heads, kv, hd = (rules.dim(config, d) for d in ("heads", "kv_heads", "head_dim"))
        return [(heads * hd, "heads * head_dim"), (kv * hd, "kv_heads * head_dim"), (kv * hd, "kv_heads * head_dim")]
    if rule.split and len(rule.split) == sources:
        return [(rules.dim(config, d), d) for d in rule.split]
    total, formula = logical.shape[0], logical.formula[0]
    if total % sources:
        raise RuleError(f"{rules.source}: params.{rule.target!r}: {sources} parts split dim 0 = {total} ({formula}) "
                        f"unevenly; give `split` with the rows of each part")
    return [(total // sources, f"({formula}) / {sources}")] * sources


def _expected_groups(target, rules, config: dict, memo: dict | None = None):
    """The target's sources by group (one group; per expert one each) with, per position in a group, the
    (shape, formula) its source must have; and the config.json keys used. None: the rule gives no shape.
    Groups of one length share their positions (the experts of a layer are alike): worked out once."""
    rule = target.rule
    logical = logical_shape(rule, target.name, rules, config, memo)
    if logical is None:
        return None
    if rule.style == "expert" and rule.stacked:
        experts, used = rules.dim_keys(config, "experts")
        (src,) = target.sources
        positions = [((experts,) + logical.shape, ("experts",) + logical.formula)]
        return [((src,), positions)], tuple(dict.fromkeys(used + logical.keys))
    groups = target.expert_sources if rule.style == "expert" else (target.sources,)
    by_length, out = {}, []
    for sources in groups:
        n = len(sources)
        if n not in by_length:
            by_length[n] = [(logical.shape, logical.formula)] if n == 1 else [
                ((rows,) + logical.shape[1:], (formula,) + logical.formula[1:])
                for rows, formula in _row_splits(rule, n, logical, rules, config)]
        out.append((sources, by_length[n]))
    return out, logical.keys


def expected_sources(target, rules, config: dict) -> list[Expected]:
    """The expected shape of every checkpoint tensor of one expanded target (empty: the rule gives no shape)."""
    grouped = _expected_groups(target, rules, config)
    if grouped is None:
        return []
    groups, keys = grouped
    transposed = target.rule.transposed
    return [Expected(src, shape, formula, keys, transposed)
            for sources, positions in groups for src, (shape, formula) in zip(sources, positions)]


def _on_disk(shape: tuple[int, ...], transposed: bool) -> tuple[int, ...]:
    if transposed and len(shape) >= 2:
        return shape[:-2] + (shape[-1], shape[-2])
    return shape


def stored_shape(expected: Expected) -> tuple[int, ...]:
    """The shape on disk: the logical one, or with its last two axes swapped for a transposed source."""
    return _on_disk(expected.shape, expected.transposed)


def _config_values(keys, config: dict) -> str:
    return ", ".join(f"{k}={config.get(k)}" for k in keys) or "no config.json keys"


def mismatch_message(target_name: str, expected: Expected, found: tuple[int, ...], rules, config: dict) -> str:
    want = stored_shape(expected)
    formula = list(expected.formula)
    if expected.transposed and len(formula) >= 2:
        formula[-2:] = formula[-1], formula[-2]
    src = expected.source
    if len(found) != len(want):
        detail = f"{src} has {len(found)} dims but the rule gives {len(want)}"
    else:
        axis = next(i for i, (f, w) in enumerate(zip(found, want)) if f != w)
        what = "rows" if axis == 0 else f"in dim {axis}"
        detail = f"{src} has {found[axis]} {what} but config.json says {formula[axis]} = {want[axis]}"
    detail += (f"; param {target_name} (rules {rules.source}) expects {list(want)} = [{', '.join(formula)}] "
               f"(from config.json {_config_values(expected.keys, config)}), found {list(found)}")
    hint = "config.json and the checkpoint disagree, or the rule is wrong for this checkpoint"
    if len(found) >= 2 and tuple(found[:-2]) + (found[-1], found[-2]) == tuple(want):
        hint = ("the tensor looks transposed ([in, out] storage): re-save it, or declare the part "
                "`transposed = true` in the rule if the checkpoint always stores it that way")
    elif math.prod(found) == math.prod(want) and len(found) == len(want):
        hint = "same number of elements in another arrangement: " + hint
    return f"{detail}: {hint}"


def check_shapes(targets, tensors: dict, rules, config: dict) -> int:
    """PlanError at the first claimed tensor whose shape is not what the rules imply; returns how many were checked.
    A target's shapes are compared as one list; only a target that fails is walked source by source."""
    checked, logical = 0, {}
    for t in targets:
        grouped = _expected_groups(t, rules, config, logical)
        if grouped is None:
            continue
        groups, _ = grouped
        on_disk, want = {}, []
        for _, positions in groups:
            if id(positions) not in on_disk:
                on_disk[id(positions)] = [_on_disk(shape, t.rule.transposed) for shape, _ in positions]
            want += on_disk[id(positions)]
        try:
            found = [tuple(tensors[s].shape) for sources, _ in groups for s in sources]
        except KeyError:
            found = None   # the walk below fails where the unclaimed source is
        if found != want:
            _first_mismatch(t, tensors, rules, config)
        checked += len(want)
    return checked


def _first_mismatch(target, tensors: dict, rules, config: dict) -> None:
    """PlanError at the target's first source whose shape is not what the rules imply."""
    for expected in expected_sources(target, rules, config):
        found = tuple(tensors[expected.source].shape)
        if found != stored_shape(expected):
            raise PlanError(mismatch_message(target.name, expected, found, rules, config))


def delivered_dtype(rule, stored: str) -> str:
    """The dtype a param is delivered in: as stored, or F32 for `dtype = "float32"` rules."""
    return "F32" if rule.dtype == "float32" and stored in FLOATS else stored


def weight_dtype(targets, tensors: dict) -> str | None:
    """The checkpoint's weight dtype: the float dtype holding the most bytes of the claimed tensors."""
    return _weight_dtype(_dtype_census(targets, tensors)[0])


def _weight_dtype(nbytes: Counter) -> str | None:
    return nbytes.most_common(1)[0][0] if nbytes else None


def _dtype_census(targets, tensors: dict) -> tuple[Counter, list[set[str]]]:
    """The bytes per float dtype of the `float` targets' sources (keys in order of first appearance), and per
    target its sources' distinct dtypes: one pass over the sources for both."""
    nbytes, distinct = Counter(), []
    for t in targets:
        entries = list(map(tensors.__getitem__, t.sources))
        dtypes = set(map(_DTYPE, entries))
        distinct.append(dtypes)
        if t.rule.dtype != "float":
            continue
        if len(dtypes) == 1:   # the usual target (a layer's experts): summed at once
            (dtype,) = dtypes
            if dtype in FLOATS:
                nbytes[dtype] += sum(map(_NBYTES, entries))
            continue
        for e in entries:
            if e.dtype in FLOATS:
                nbytes[e.dtype] += e.nbytes
    return nbytes, distinct


def check_dtypes(targets, tensors: dict, quantization) -> None:
    """PlanError at the first claimed tensor whose dtype the policy above refuses (a quantized weight: in the
    dtypes `quantization` stores weights in). Whether a source is refused depends on its dtype alone (within its
    target), so each target's distinct dtypes are judged first and only a target with a refused one is walked
    source by source."""
    nbytes, distinct = _dtype_census(targets, tensors)
    main = _weight_dtype(nbytes)
    for t, dtypes in zip(targets, distinct):
        mixed = len(dtypes) > 1   # the plan names both parts' dtypes
        if any(_refusal(t, None, d, main, mixed, quantization) for d in dtypes):
            for s in t.sources:
                refusal = _refusal(t, s, tensors[s].dtype, main, mixed, quantization)
                if refusal:
                    raise PlanError(refusal)


def _refusal(t, s: str | None, dtype: str, main: str | None, mixed: bool, quantization) -> str | None:
    """Why the policy refuses source `s` of target `t` stored as `dtype`; None: accepted."""
    if dtype in quantization.weight_dtypes:
        return None
    if dtype in FP8S:
        declared = quantization.describe()
        return (f"{s}: stored as {dtype}, but " + (f"its quantization ({declared}) stores no {dtype} weights"
                                                   if declared else "config.json declares no quantization_config")
                + "; an FP8 weight without its scheme would load as raw FP8 values: add the checkpoint's "
                  "quantization_config or re-save it in a float dtype")
    if dtype not in FLOATS:
        return (f"{s}: stored as {dtype}, but param {t.name} is floating point; integer and bool dtypes are "
                f"refused (the checkpoint is damaged or mislabelled): re-save it")
    if t.rule.dtype == "float" and dtype != main and not mixed:
        return (f"{s}: stored as {dtype}, but the checkpoint's weights are {main} and the rule for {t.name} allows "
                f"no other width (distload does not cast): re-save the checkpoint in one dtype, or declare "
                f"dtype = \"any-float\" for this param in the rules")
    return None
