"""A packed checkpoint as planning sees it: a logical float weight in place of each quantized linear's packed tensors.

The logical weight [out, in] (0 bytes: never read) gets the rules' cut; its packed tensors become its companions
(companions.py), cut after it (packed_cuts.py). Which linears are quantized follows the checkpoint (lm_head and
`ignore` / `exclude_modules` layers simply have a float weight), all parts of one param alike; a packed tensor
of the layer input (GPTQ's g_idx) is the first part's. Every tensor's dtype and shape is checked against its
format's table row (packed_table.py) before any cut.
"""

from __future__ import annotations

import math
from dataclasses import replace

from ..errors import PlanError
from ..plan.expected_shapes import expected_sources, weight_dtype
from ..plan.quantization import View
from ..plan.shard import view2d
from ..rules import names
from .companions import Companion, with_suffix
from .packed_table import IN, ONE, OUT, Cut, expected_view
from .steps import part_of


LOGICAL = "{}[logical]"   # a logical weight's name where a packed tensor keeps the name X.weight (NVFP4)


def logical_view(scheme, targets, tensors: dict, rules, config: dict) -> View:
    """Logical weights for the targets whose parts are packed in `scheme`'s format (packed.PackedFormat), their
    packed tensors as companions; the other targets as they are."""
    marker = next(iter(scheme.cuts(1)))
    # a part with any of the format's own tensors is packed (its marker missing is then named, not the part)
    own = [suffix for suffix in scheme.cuts(1) if suffix != "weight"]
    quantized = {t.name for t in targets if t.name.endswith("weight") and all(s.endswith(".weight") for s in t.sources)
                 and any(with_suffix(s, suffix) in tensors for s in t.sources for suffix in own)}
    dtype = weight_dtype([t for t in targets if t.name not in quantized], tensors) or "BF16"
    rename = "weight" in scheme.cuts(1)
    index, out_targets, packed = dict(tensors), [], []  # names of the checkpoint, and of the logical weights
    for t in targets:
        if t.name not in quantized:
            out_targets.append(t)
            continue
        present = [s for s in t.sources if with_suffix(s, marker) in tensors]
        unsupported = t.rule.style == "vocab" or (t.rule.style == "expert" and (t.rule.stacked or
                                                                                 not scheme.experts_supported))
        if unsupported or len(present) != len(t.sources):
            lacking = [with_suffix(s, marker) for s in t.sources if s not in present
                       and any(with_suffix(s, suffix) in tensors for suffix in own)]
            what = (f"packed 4-bit vocab params, stacked experts and {scheme.name} experts are not planned; "
                    "dequantize them first" if len(present) == len(t.sources) else
                    f"the checkpoint lacks {names.describe(lacking)}, which every packed {scheme.name} linear has "
                    f"beside its other tensors; the checkpoint is incomplete" if lacking else
                    f"only {names.describe(present)} of its parts are packed; the checkpoint is incomplete")
            raise PlanError(f"{t.name} (rule {t.rule.style}, {scheme.label()}): {what}")
        shapes = _logical_shapes(t, tensors, scheme, rules, config)
        logical = t if not rename else replace(
            t, sources=tuple(LOGICAL.format(s) for s in t.sources),
            expert_sources=tuple(tuple(LOGICAL.format(s) for s in ss) for ss in t.expert_sources))
        for s, v in zip(t.sources, logical.sources):
            index[v] = replace(tensors[with_suffix(s, marker)], name=v, dtype=dtype, shape=shapes[s], nbytes=0)
        found = _packed_of(t, logical, tensors, scheme, shapes)
        if t.rule.style == "expert":  # an expert's 1-D tensor (g_idx) is one row of the [experts, n] param
            found = [replace(p, cut=replace(p.cut, rows=(ONE, 1), cols=p.cut.rows, flat=True))
                     if p.cut.cols[0] == ONE and not p.cut.per_part else p for p in found]
        for p in found:
            if t.rule.style == "expert" and p.cut.per_part:  # one row of [local experts, parts * numel]
                for n in p.sources:
                    index[n] = replace(tensors[n], shape=(1, math.prod(tensors[n].shape)))
        source_of = dict(zip(logical.sources, t.sources))
        for p in found:  # a flat tensor is read as its [rows, cols] view: the same bytes
            if p.cut.flat:
                for v, n in p.scale_of:
                    index[n] = replace(tensors[n], shape=expected_view(p.cut, *shapes[source_of[v]]))
        packed += found
        out_targets.append(logical)
    return View(out_targets, index, tuple(packed))


def _logical_shapes(t, tensors: dict, scheme, rules, config: dict) -> dict[str, tuple[int, int]]:
    """Each part's logical [out, in]: from the rules' shapes, else from its marker tensor's."""
    expected = {e.source: tuple(e.shape) for e in expected_sources(t, rules, config)}
    out = {}
    for s in t.sources:
        if s in expected and len(expected[s]) == 2:
            out[s] = expected[s]
            continue
        marker, cut = next(iter(scheme.cuts(1).items()))
        if cut.flat:
            raise PlanError(f"{t.name} ({scheme.label()}): {s} is stored flat and the rules "
                            f"({rules.source}) give no shape for it; add `shape` to the rule")
        rows, cols = tensors[with_suffix(s, marker)].shape
        sizes = {cut.rows[0]: rows * cut.rows[1], cut.cols[0]: cols * cut.cols[1]}
        out[s] = (sizes[OUT], sizes[IN])
    return out


def _packed_of(t, logical, tensors: dict, scheme, shapes: dict) -> list[Companion]:
    out = []
    for suffix, cut in scheme.cuts(shapes[t.sources[0]][1]).items():
        names_ = [with_suffix(s, suffix) for s in t.sources]
        present = [n for n in names_ if n in tensors]
        if not present and cut.optional:
            continue
        # A tensor of the layer input (g_idx) is the first part's (packed_cuts.merged): the others may be
        # absent (a sharded save keeps only what was delivered).
        shared_input = OUT not in (cut.rows[0], cut.cols[0]) and not cut.per_part
        needed = names_[:1] if shared_input else names_
        if any(n not in tensors for n in needed):
            missing = sorted(set(names_) - set(present))
            raise PlanError(f"{t.name} ({scheme.label()}): the checkpoint lacks {names.describe(missing)}; "
                            f"every quantized linear of this format has its {suffix}: the checkpoint is incomplete")
        pairs = tuple((v, n) for s, v, n in zip(t.sources, logical.sources, names_) if n in tensors)
        for s, n in zip(t.sources, names_):
            if n in tensors:
                _check_tensor(tensors[n], cut, shapes[s], scheme, t.name)
        if shared_input and not cut.optional:
            out += _each_part(t, logical, suffix, pairs, cut)
            continue
        out.append(Companion(with_suffix(t.name, suffix), t.name, suffix, pairs, cut))
    return out


def _each_part(t, logical, suffix: str, pairs: tuple, cut: Cut) -> list[Companion]:
    """A tensor of the layer input that the format needs (GPTQ act-order g_idx): the first part's is the param's;
    each later part's is read too, into a staging-only companion (suffix `<suffix>.part<k>`), so that the format's
    step checks its values (an up_proj g_idx out of range would otherwise be claimed and never read)."""
    part = part_of(logical)
    by_part: dict[int, list] = {}
    for v, n in pairs:
        by_part.setdefault(part[v], []).append((v, n))
    named = [(suffix + (f".part{k}" if k else ""), tuple(ps)) for k, ps in sorted(by_part.items())]
    return [Companion(with_suffix(t.name, sfx), t.name, sfx, ps, cut, check_only=sfx != suffix) for sfx, ps in named]


def _check_tensor(entry, cut: Cut, shape: tuple[int, int], scheme, target: str) -> None:
    if entry.dtype not in cut.dtypes:
        raise PlanError(f"{entry.name}: stored as {entry.dtype}, but {scheme.name} stores it as "
                        f"{' or '.join(cut.dtypes)} ({scheme.label()}); the checkpoint does not match its config")
    if cut.scalar and math.prod(entry.shape) != 1:
        raise PlanError(f"{entry.name}: shape {list(entry.shape)}, but {scheme.name} stores one number per part "
                        f"there (shape [] or [1]) ({scheme.label()}); the checkpoint does not match its format: "
                        f"export it again")
    if cut.per_part:
        return
    out_f, in_f = shape
    for axis, unit in (cut.rows, cut.cols):
        size = {OUT: out_f, IN: in_f, ONE: 1}[axis]
        if size % unit:
            what = (f"{'group_size' if scheme.unit_name == 'group' else scheme.unit_name} {unit}"
                    if axis == IN and unit == scheme.group else str(unit))
            raise PlanError(f"{entry.name}: the {axis}put size {size} of {target} is not a multiple of {what} "
                            f"({scheme.label()}); config.json and the checkpoint disagree")
    want = expected_view(cut, out_f, in_f)
    if cut.flat:
        if len(entry.shape) not in (1, 2) or math.prod(entry.shape) != math.prod(want) or view2d(entry.shape)[1] != 1:
            raise PlanError(f"{entry.name}: shape {list(entry.shape)}, but a {scheme.name} weight [{out_f}, {in_f}] "
                            f"stores {math.prod(want)} values flat ({scheme.label()}); config.json and the "
                            f"checkpoint disagree")
        return
    if view2d(tuple(entry.shape)) != want or len(entry.shape) != (1 if cut.cols[0] == ONE else 2):
        raise PlanError(f"{entry.name}: shape {list(entry.shape)}, but a {scheme.name} weight [{out_f}, {in_f}] "
                        f"needs {list(want[:1] if cut.cols[0] == ONE else want)} ({scheme.label()}); "
                        f"config.json and the checkpoint disagree")
