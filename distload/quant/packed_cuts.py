"""Packed 4-bit tensors' layouts, derived from their logical weight's, so every packed shard matches its weight's.

A logical piece — rows [a, b) of a weight's outputs, columns [c, d) of its inputs, placed at (dst_row,
dst_col) — becomes, in a packed tensor whose rows run along axis X in units of u and whose columns along
Y in units of v, the rectangle X-range / u by Y-range / v at (X-dst / u, Y-dst / v). Every edge must fall
on a unit: a cut inside an int32 word, a byte of two fp4 values or a scale group is refused while planning,
naming the tensor, the numbers and the tp values that work. Exceptions, as vLLM has them: GPTQ scales and
zeros with desc_act (or one group per row) are not cut along the input, every rank holds all groups (its
g_idx, cut, indexes them); per-part tensors (NVFP4 weight_scale_2, compressed-tensors weight_shape) are
held whole, every part's, in part order.
"""

from __future__ import annotations

import math

from ..errors import PlanError
from ..plan.ranks import per_group, unzipped
from ..plan.shard import LocalLayout, Piece, view2d
from ..plan.types import ParamSpec
from .companions import Companion, by_weight
from .format import hint_sizes
from .packed_table import IN, ONE, OUT, expected_view
from .per_part import per_part_layouts


class _Split(Exception):
    """A logical piece edge inside a pack or group (internal: becomes a PlanError with hints)."""


def packed_layouts(scheme, planned: dict, packed: tuple[Companion, ...], targets: dict, index: dict, group: int,
                   relayout) -> dict:
    """Replace each packed target's logical (specs, layouts) in `planned` by its packed tensors'; return the
    logical ones (what a dequantization step produces). relayout(name, q): the logical ones at tp q."""
    logical = {}
    for weight, tensors in by_weight(packed).items():
        if weight not in planned:
            continue  # not matched (non-strict load): nothing to cut
        specs, lays = logical[weight] = planned.pop(weight)
        try:  # once per group of ranks that hold the same logical shard
            per_group(lambda spec, lay: _check_edges(tensors, spec, lay, scheme), specs, lays)
        except _Split as split:
            raise _split_error(weight, targets[weight], tensors, split, scheme, group, relayout) from None
        for p in tensors:
            planned[p.name] = (per_part_layouts(p, targets[weight], specs, index, every_expert=p.is_input)
                               if p.cut.per_part else _cut(p, specs, lays, index))
    return logical


def _units(tensors: list[Companion], scheme):
    """(axis, unit, what) every logical edge must respect, binding ones first."""
    out = []
    for p in tensors:
        if p.cut.per_part:
            continue
        for axis, unit in (p.cut.rows, p.cut.cols):
            if axis == ONE or unit == 1 or (axis == IN and p.cut.whole_in):
                continue
            kind = scheme.unit_name if axis == IN and unit == scheme.group else "pack"
            out.append((axis, unit, f"{unit}-value {kind} of its {p.suffix}"))
    out += scheme.extra_units()
    return sorted(set(out), key=lambda u: -u[1])


def _check_edges(tensors: list[Companion], spec, lay: LocalLayout, scheme) -> None:
    units = _units(tensors, scheme)
    for pc in lay.pieces:
        for axis, lo, hi, dst in ((OUT, *pc.rows, pc.dst_row), (IN, *pc.cols, pc.dst_col)):
            for ax, unit, what in units:
                if ax == axis and (lo % unit or hi % unit or dst % unit):
                    edge = next(v for v in (lo, hi, dst) if v % unit)
                    raise _Split(f"cuts {pc.source} at {axis}put {edge}, inside a {what}")


def _split_error(weight, target, tensors, split: _Split, scheme, group: int, relayout) -> PlanError:
    def fits(q):
        try:
            specs, lays = relayout(weight, q)
            for spec, lay in zip(specs, lays):
                _check_edges(tensors, spec, lay, scheme)
        except (_Split, PlanError):
            return False
        return True
    hint = hint_sizes(fits, "tp", upto=16, none="no tp works: re-quantize with a smaller group")
    return PlanError(f"{weight} (rule {target.rule.style}, {scheme.label()}): tp={group} {split}; a packed "
                     f"tensor is cut in whole packs and groups, together with its weight ({hint})")


def _axis(axis: str, unit: int, piece: Piece, whole: int | None) -> tuple[tuple[int, int], int]:
    """(range, dst) of `piece` along a packed tensor's dim that runs along logical `axis` in `unit`s."""
    if axis == ONE:
        return (0, 1), 0
    if whole is not None:
        return (0, whole), 0
    (lo, hi), dst = (piece.rows, piece.dst_row) if axis == OUT else (piece.cols, piece.dst_col)
    return (lo // unit, hi // unit), dst // unit


def _shape(p: Companion, out_f: int, in_f: int, full_in: int) -> tuple[int, ...]:
    rows, cols = expected_view(p.cut, out_f, full_in if p.cut.whole_in else in_f)
    return (rows,) if p.cut.cols[0] == ONE else (rows, cols)


def _cut(p: Companion, specs, lays, index: dict):
    packed_of = dict(p.scale_of)

    def one(spec, lay):
        experts = spec.style == "expert"   # [local experts, n, k]: each slot's matrix cut alike, stacked
        (g_out, g_in), (l_out, l_in) = spec.global_shape[-2:], spec.local_shape[-2:]
        local, glob = _shape(p, l_out, l_in, g_in), _shape(p, g_out, g_in, g_in)
        per_slot = view2d(local)[0]
        pieces = []
        for pc in lay.pieces:
            if pc.source not in packed_of:
                continue  # a shared-input tensor (g_idx) of a later part: the first part's stands for it
            slot, d = divmod(pc.dst_row, l_out) if experts else (0, pc.dst_row)
            full_in = index[pc.source].shape[1]
            whole = -(-full_in // p.cut.rows[1]) if p.cut.whole_in and p.cut.rows[0] == IN else None
            in_slot = Piece(pc.source, pc.rows, pc.cols, d, pc.dst_col)
            rows, dst_row = _axis(*p.cut.rows, in_slot, whole)
            cols, dst_col = _axis(*p.cut.cols, in_slot, None)
            pieces.append(Piece(packed_of[pc.source], rows, cols, slot * per_slot + dst_row, dst_col))
        if experts:
            one_row = p.cut.rows[0] == ONE   # an expert's 1-D tensor: one row of [local experts, n]
            local = (len(spec.experts),) + (local[1:] if one_row else local)
            glob = (spec.global_shape[0],) + (glob[1:] if one_row else glob)
        dtype = index[p.sources[0]].dtype
        style = spec.style if experts or _follows_cut(p, spec.style) else "replicate"
        lay_out = LocalLayout(*view2d(local), tuple(merged(p, pieces)))
        if sum(pc.numel for pc in lay_out.pieces) != math.prod(local):
            raise PlanError(f"{p.name}: its pieces do not tile its local shape {list(local)}; a packed tensor "
                            f"cannot follow this layout of {p.weight}")
        return ParamSpec(p.name, style, dtype, glob, local, experts=spec.experts), lay_out
    return unzipped(per_group(one, specs, lays))


def _follows_cut(p: Companion, style: str) -> bool:
    """Whether the tensor is cut at all: it runs along the axis its layer's style cuts (inputs for row)."""
    axis = IN if style == "row" else OUT
    return any(a == axis and not (a == IN and p.cut.whole_in) for a, _ in (p.cut.rows, p.cut.cols))


def merged(p: Companion, pieces: list[Piece]) -> list[Piece]:
    """A tensor without an output axis (GPTQ g_idx) is one per layer input: the fused parts share their
    input, so (as in vLLM) the first part's is the param's (per expert slot); other repeats are kept once."""
    if OUT not in (p.cut.rows[0], p.cut.cols[0]):
        first: dict[tuple[int, int], Piece] = {}
        for pc in pieces:
            first.setdefault((pc.dst_row, pc.dst_col), pc)
        return list(first.values())
    return list(dict.fromkeys(pieces))
