"""Packed 4-bit checkpoints in the plan: which packed tensors stand for each linear weight, on what logical weight.

A 4-bit checkpoint has no `X.weight` of the float shape [out, in] for a quantized linear: it stores packed
words and their groups' scales and zeros, each a rectangle over that logical weight (kernels/int4_format.py
and fp4_format.py define the formats). Planning therefore works on the *logical* weight — the family's
rules cut it as usual (column, row, merged, qkv with kv replication) — and every packed tensor follows it
through one table row: which logical axis its rows and its columns run along, and how many logical values
one row or column stands for (8 per int32 word, 2 per byte, g per group). The serving params are vLLM's
before post-processing: `X.qweight`, `X.qzeros`, `X.scales`, `X.g_idx` (GPTQ) and so on.

GPT-OSS MXFP4 experts (stacked X_blocks / X_scales in place of a BF16 X) get a logical weight the same way;
their cut is vLLM's uneven, padded one (mxfp4.py).
The formats and their tables are in packed4_formats.py; the cuts in packed4_layouts.py. Which linears are quantized
follows the checkpoint (lm_head and `ignore` / `exclude_modules` layers simply
have a float weight), all parts of one param alike.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from ..rules import names
from ..errors import PlanError
from ..plan.expected_shapes import expected_sources, weight_dtype
from .fp8 import with_suffix
from .packed4_formats import IN, ONE, OUT, Cut, Packed4, expected_view
from ..plan.shard import view2d


@dataclass(frozen=True)
class PackedTensor:
    """One packed serving param of a quantized linear target, and the checkpoint tensors it is cut from."""
    name: str                        # serving name: the target's with 'weight' -> the suffix
    weight: str                      # the logical weight target it stands for
    suffix: str
    cut: Cut
    scale_of: tuple[tuple[str, str], ...]   # (logical weight source, its packed tensor), in source order

    @property
    def sources(self) -> tuple[str, ...]:
        return tuple(s for _, s in self.scale_of)


@dataclass(frozen=True)
class Logical:
    """What planning sees of a packed checkpoint: the index with a float logical weight in place of each
    quantized linear's packed tensors (0 bytes: never read), the targets over it, and the packed tensors,
    cut after their weights."""
    index: dict
    targets: list
    packed: tuple[PackedTensor, ...]


def by_weight(packed, weights=None) -> dict[str, list[PackedTensor]]:
    """The packed tensors grouped by the logical weight they stand for (only those in `weights`, when given)."""
    out: dict[str, list[PackedTensor]] = {}
    for p in packed:
        if weights is None or p.weight in weights:
            out.setdefault(p.weight, []).append(p)
    return out


LOGICAL = "{}[logical]"   # a logical weight's name where a packed tensor keeps the name X.weight (NVFP4)


def logical_index(targets, tensors: dict, scheme: Packed4 | None, rules, config: dict) -> Logical:
    """Logical weights for the targets whose parts are packed; the checkpoint unchanged for other checkpoints."""
    if scheme is None:
        return Logical(tensors, targets, ())
    if scheme.name == "mxfp4":
        return _mxfp4_logical(targets, tensors, scheme)
    marker = next(iter(scheme.cuts(1)))
    quantized = {t.name for t in targets if t.name.endswith("weight") and all(s.endswith(".weight") for s in t.sources)
                 and any(with_suffix(s, marker) in tensors for s in t.sources)}
    dtype = weight_dtype([t for t in targets if t.name not in quantized], tensors) or "BF16"
    rename = "weight" in scheme.cuts(1)
    index, out_targets, packed = dict(tensors), [], []  # names of the checkpoint, and of the logical weights
    for t in targets:
        if t.name not in quantized:
            out_targets.append(t)
            continue
        present = [s for s in t.sources if with_suffix(s, marker) in tensors]
        unsupported = t.rule.style == "vocab" or (t.rule.style == "expert" and (t.rule.stacked or scheme.name == "bnb"))
        if unsupported or len(present) != len(t.sources):
            what = ("packed 4-bit vocab params, stacked experts and bitsandbytes experts are not planned yet; "
                    "dequantize them first" if len(present) == len(t.sources) else
                    f"only {names.describe(present)} of its parts are packed; the checkpoint is incomplete")
            raise PlanError(f"{t.name} (rule {t.rule.style}, {scheme.describe()}): {what}")
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
    return Logical(index, out_targets, tuple(packed))


MXFP4_PARTS = ("_blocks", "_scales")   # how GPT-OSS stores a stacked expert tensor X in MXFP4


def _mxfp4_logical(targets, tensors: dict, scheme: Packed4) -> Logical:
    """GPT-OSS MXFP4: a stacked expert target whose source X is stored as X_blocks [E, out, in/32, 16] and X_scales
    [E, out, in/32] (not transposed, unlike the BF16 X) plans a logical weight [E, out, in] (0 bytes), and the
    blocks are read as their [E, out, in/2] view (the same bytes): both then run along out and in like the weight."""
    index, out_targets, packed = dict(tensors), [], []
    cuts = scheme.cuts(0)
    dtype = weight_dtype([t for t in targets if all(s in tensors for s in t.sources)], tensors) or "BF16"
    for t in targets:
        src = t.sources[0]
        blocks, scales = (src + suffix for suffix in MXFP4_PARTS)
        if not (t.rule.style == "expert" and t.rule.stacked and len(t.sources) == 1 and blocks in tensors):
            out_targets.append(t)
            continue
        if scales not in tensors:
            raise PlanError(f"{t.name} ({scheme.describe()}): the checkpoint has {blocks} but lacks {scales}; "
                            f"every MXFP4 tensor has its E8M0 scales: the checkpoint is incomplete")
        b, s = tensors[blocks], tensors[scales]
        # [E, out, in/2] too: the same bytes as vLLM's w13_weight, which a sharded save records
        view = tuple(b.shape[:2]) + (math.prod(b.shape[2:]),) if len(b.shape) in (3, 4) else (0, 0, 1)
        if ((b.dtype, s.dtype) != ("U8", "U8") or (len(b.shape) == 4 and b.shape[3] != 16) or view[2] % 16
                or tuple(s.shape) != view[:2] + (view[2] // 16,)):
            raise PlanError(f"{blocks} {b.dtype} {list(b.shape)}, {scales} {s.dtype} {list(s.shape)}: MXFP4 stores "
                            f"X_blocks uint8 [experts, out, in/32, 16] and X_scales uint8 [experts, out, in/32] "
                            f"({scheme.describe()}); the checkpoint does not match its config")
        experts, rows, half = view
        logical_name = LOGICAL.format(src)
        logical = replace(t, sources=(logical_name,), rule=replace(t.rule, transposed=False))
        index[logical_name] = replace(b, name=logical_name, dtype=dtype, shape=(experts, rows, half * 2), nbytes=0)
        index[blocks] = replace(b, shape=view)
        out_targets.append(logical)
        packed += [PackedTensor(t.name, t.name, "weight", cuts["weight"], ((logical_name, blocks),)),
                   PackedTensor(with_suffix(t.name, "weight_scale"), t.name, "weight_scale", cuts["weight_scale"],
                                ((logical_name, scales),))]
    return Logical(index, out_targets, tuple(packed))


def _logical_shapes(t, tensors: dict, scheme: Packed4, rules, config: dict) -> dict[str, tuple[int, int]]:
    """Each part's logical [out, in]: from the rules' shapes, else from its marker tensor's."""
    expected = {e.source: tuple(e.shape) for e in expected_sources(t, rules, config)}
    out = {}
    for s in t.sources:
        if s in expected and len(expected[s]) == 2:
            out[s] = expected[s]
            continue
        marker, cut = next(iter(scheme.cuts(1).items()))
        if cut.flat:
            raise PlanError(f"{t.name} ({scheme.describe()}): {s} is stored flat and the rules "
                            f"({rules.source}) give no shape for it; add `shape` to the rule")
        rows, cols = tensors[with_suffix(s, marker)].shape
        sizes = {cut.rows[0]: rows * cut.rows[1], cut.cols[0]: cols * cut.cols[1]}
        out[s] = (sizes[OUT], sizes[IN])
    return out


def _packed_of(t, logical, tensors: dict, scheme: Packed4, shapes: dict) -> list[PackedTensor]:
    out = []
    for suffix, cut in scheme.cuts(shapes[t.sources[0]][1]).items():
        names_ = [with_suffix(s, suffix) for s in t.sources]
        present = [n for n in names_ if n in tensors]
        if not present and cut.optional:
            continue
        # A tensor of the layer input (g_idx) is the first part's (packed4_layouts._merge): the others may be
        # absent (a sharded save keeps only what was delivered).
        shared_input = OUT not in (cut.rows[0], cut.cols[0]) and not cut.per_part
        needed = names_[:1] if shared_input else names_
        if any(n not in tensors for n in needed):
            missing = sorted(set(names_) - set(present))
            raise PlanError(f"{t.name} ({scheme.describe()}): the checkpoint lacks {names.describe(missing)}; "
                            f"every quantized linear of this format has its {suffix}: the checkpoint is incomplete")
        pairs = tuple((v, n) for s, v, n in zip(t.sources, logical.sources, names_) if n in tensors)
        for s, n in zip(t.sources, names_):
            if n in tensors:
                _check_tensor(tensors[n], cut, shapes[s], scheme, t.name)
        out.append(PackedTensor(with_suffix(t.name, suffix), t.name, suffix, cut, pairs))
    return out


def _check_tensor(entry, cut: Cut, shape: tuple[int, int], scheme: Packed4, target: str) -> None:
    if entry.dtype not in cut.dtypes:
        raise PlanError(f"{entry.name}: stored as {entry.dtype}, but {scheme.name} stores it as "
                        f"{' or '.join(cut.dtypes)} ({scheme.describe()}); the checkpoint does not match its config")
    if cut.per_part:
        return
    out_f, in_f = shape
    for axis, unit in (cut.rows, cut.cols):
        size = {OUT: out_f, IN: in_f, ONE: 1}[axis]
        if size % unit:
            raise PlanError(f"{entry.name}: the {axis}put size {size} of {target} is not a multiple of {unit} "
                            f"({scheme.describe()}); config.json and the checkpoint disagree")
    want = expected_view(cut, out_f, in_f)
    if cut.flat:
        if len(entry.shape) not in (1, 2) or math.prod(entry.shape) != math.prod(want) or view2d(entry.shape)[1] != 1:
            raise PlanError(f"{entry.name}: shape {list(entry.shape)}, but a {scheme.name} weight [{out_f}, {in_f}] "
                            f"stores {math.prod(want)} values flat ({scheme.describe()}); config.json and the "
                            f"checkpoint disagree")
        return
    if view2d(tuple(entry.shape)) != want or len(entry.shape) != (1 if cut.cols[0] == ONE else 2):
        raise PlanError(f"{entry.name}: shape {list(entry.shape)}, but a {scheme.name} weight [{out_f}, {in_f}] "
                        f"needs {list(want[:1] if cut.cols[0] == ONE else want)} ({scheme.describe()}); "
                        f"config.json and the checkpoint disagree")
