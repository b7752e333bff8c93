"""Scale companions' layouts, derived from their weight's, so weight and scale shards always match.

    per-part   (per-tensor scales, input scales) one scalar per distinct weight source; every rank gets
               all of them in source order: [n_sources], experts [local experts, n_parts]
    block      the weight's pieces mapped onto the block grid: rows [a, b) -> scale rows [a/bn, ceil(b/bn));
               a piece whose edge falls inside a block is refused while planning, with the tp values
               that work (a scale row cannot belong to two ranks' different rows)
"""

from __future__ import annotations

import math
import operator

from ..errors import PlanError
from ..dtypes import itemsize
from ..plan.expert_layouts import DerivedExpertLayouts, ExpertLayouts
from .fp8 import Companion, Scheme
from ..plan.ranks import RankValues, per_group, unzipped
from ..plan.shard import LocalLayout, Piece, view2d
from ..plan.types import ParamSpec

_SHAPE, _DTYPE = operator.attrgetter("shape"), operator.attrgetter("dtype")   # of a checkpoint entry

def companion_layouts(c: Companion, target, weight_specs: RankValues, weight_lays: RankValues, tensors: dict,
                      scheme: Scheme, group: int, relayout) -> tuple[RankValues, RankValues]:
    """Per rank (spec, layout) of companion `c`, from its weight's per-rank specs and layouts, cut once per
    group of ranks that hold the same weight shard.

    group: the size of the group the weight is cut over (tp; for experts, ranks per expert group);
    relayout(q) -> the weight's (specs, layouts) at group size q, called only when a block is split,
    to name the sizes that work.
    """
    if c.role == "weight" and scheme.block:
        return _block_layouts(c, target, weight_specs, weight_lays, tensors, scheme, group, relayout)
    return _per_part_layouts(c, target, weight_specs, tensors)


def _per_part_layouts(c: Companion, target, weight_specs: RankValues, tensors) -> tuple[RankValues, RankValues]:
    scale_of = dict(c.scale_of)
    entries = [tensors[s] for s in c.sources]
    not_scalar = [f"{e.name}{list(e.shape)}" for e in entries if math.prod(e.shape) != 1]
    if not_scalar:
        raise PlanError(f"{c.name}: per-tensor scales must hold one value, got {', '.join(not_scalar)}; "
                        f"check quantization_config (a block or channel scheme?)")
    dtypes = sorted({e.dtype for e in entries})
    if len(dtypes) > 1:
        raise PlanError(f"{c.name}: its parts' scales have different dtypes {dtypes}; the checkpoint contradicts itself")
    world = weight_specs.world
    if target.rule.style == "expert":
        if target.rule.stacked:
            raise PlanError(f"{c.name}: per-tensor scales of experts stacked on disk are not supported; "
                            f"use a block-FP8 or per-expert checkpoint")
        n_parts = len(target.expert_sources[0])

        def per_expert(w):  # [local experts(, parts)]: each hosted expert's scalars, slot by slot
            shape = (len(w.experts), n_parts) if n_parts > 1 else (len(w.experts),)
            pieces = tuple(Piece(scale_of[s], (0, 1), (0, 1), slot, j)
                           for slot, e in enumerate(w.experts) for j, s in enumerate(target.expert_sources[e]))
            glob = (w.global_shape[0], n_parts) if n_parts > 1 else (w.global_shape[0],)
            return ParamSpec(c.name, "expert", dtypes[0], glob, shape, experts=w.experts), LocalLayout(*view2d(shape), pieces)
        return unzipped(per_group(per_expert, weight_specs))
    if len(c.sources) == 1:  # one source (also a fused one on disk): its scalar, as it is, on every rank
        (entry,) = entries
        return (RankValues([ParamSpec(c.name, "replicate", entry.dtype, tuple(entry.shape), tuple(entry.shape))], world),
                RankValues([LocalLayout(1, 1, (Piece(entry.name, (0, 1), (0, 1), 0, 0),))], world))
    shape = (len(c.sources),)
    lay = LocalLayout(len(c.sources), 1, tuple(Piece(s, (0, 1), (0, 1), i, 0) for i, s in enumerate(c.sources)))
    return RankValues([ParamSpec(c.name, "replicate", dtypes[0], shape, shape)], world), RankValues([lay], world)


class _SplitBlock(Exception):
    """A weight piece whose edge falls inside a block (internal: becomes a PlanError with hints)."""


def _matrix_dims(shape: tuple[int, ...], what: str) -> tuple[int, int]:
    if len(shape) not in (2, 3):
        raise PlanError(f"{what}: block FP8 needs a [N, K] or [experts, N, K] weight, got shape {list(shape)}")
    return shape[-2], shape[-1]


def block_scale_shape(shape, block) -> tuple[int, ...]:
    *lead, n, k = shape
    return (*lead, -(-n // block[0]), -(-k // block[1]))


class _BlockGrid:
    """Weight layouts -> their pieces on the block grid, for one companion.

    A piece's block rectangle depends only on its geometry (its source's shape, its rows, columns and place,
    the local matrix it lands in), which every expert and layer of one shape repeat: each geometry is mapped
    once (and checked once), then only renamed to the scale source of the piece's weight source."""

    def __init__(self, scale_of: dict, tensors: dict, block):
        self.scale_of, self.tensors, self.block = scale_of, tensors, block
        # local shape -> (n, k, blocks of the local grid, per weight source (its shape, the memo of its shape))
        self.grids: dict[tuple[int, ...], tuple[int, int, int, dict]] = {}
        self.memos: dict[tuple, dict] = {}   # (local shape, source shape) -> {piece geometry: block rectangle}

    def pieces(self, lay: LocalLayout, spec) -> tuple[Piece, ...]:
        """The weight's pieces on the block grid; _SplitBlock when an edge falls inside a block."""
        grid = self.grids.get(spec.local_shape)
        if grid is None:
            n_loc, k_loc = _matrix_dims(spec.local_shape, spec.name)
            grid = self.grids[spec.local_shape] = (n_loc, k_loc, math.prod(block_scale_shape(spec.local_shape,
                                                                                                self.block)), {})
        n_loc, k_loc, blocks, sources = grid
        nb_loc = -(-n_loc // self.block[0])
        out, numel = [], 0
        for pc in lay.pieces:
            known = sources.get(pc.source)
            if known is None:
                shape = tuple(self.tensors[pc.source].shape)
                known = sources[pc.source] = (shape, self.memos.setdefault((spec.local_shape, shape), {}))
            shape, memo = known
            # Its geometry within one expert's matrix (slot apart): every slot of a stack maps alike.
            slot, d = divmod(pc.dst_row, n_loc)
            geometry = (pc.rows, pc.cols, d, pc.dst_col)
            mapped = memo.get(geometry)
            if mapped is None:
                mapped = memo[geometry] = self._mapped(pc._replace(dst_row=d), shape, spec.name, n_loc, k_loc)
            out.append(Piece(self.scale_of[pc.source], mapped[0], mapped[1], slot * nb_loc + mapped[2], mapped[3]))
            numel += mapped[4]
        if numel != blocks:
            raise PlanError(f"{spec.name}: its pieces do not tile the block grid "
                            f"{list(block_scale_shape(spec.local_shape, self.block))} (padded or overlapping "
                            f"shard?); block scales cannot be cut for this param")
        return tuple(out)

    def _mapped(self, pc: Piece, shape, name: str, n_loc: int, k_loc: int) -> tuple:
        """(rows, cols, dst_row, dst_col, numel) of one weight piece's block rectangle, checked."""
        bn, bk = self.block
        n, k = _matrix_dims(shape, pc.source)
        e, a0 = divmod(pc.rows[0], n)
        a1 = pc.rows[1] - e * n
        slot, d = divmod(pc.dst_row, n_loc)
        if a1 > n:
            raise PlanError(f"{name}: a piece of {pc.source} spans several matrices; block scales cannot follow it")
        (c0, c1), dc = pc.cols, pc.dst_col
        for what, lo, hi, edge, dst, size, b, dst_size in (("row", a0, a1, n, d, a1 - a0, bn, n_loc),
                                                          ("column", c0, c1, k, dc, c1 - c0, bk, k_loc)):
            # A piece starts on a block edge (in the source and in the param) and ends on one, or ends
            # at the source's partial last block exactly where the param's matrix ends.
            if lo % b or dst % b:
                raise _SplitBlock(f"cuts {pc.source} at {what} {lo if lo % b else dst}")
            if hi % b and not (hi == edge and dst + size == dst_size):
                raise _SplitBlock(f"cuts {pc.source} at {what} {hi}")
        nb = -(-n // bn)
        nb_loc = -(-n_loc // bn)
        rows, cols = (e * nb + a0 // bn, e * nb + -(-a1 // bn)), (c0 // bk, -(-c1 // bk))
        return rows, cols, slot * nb_loc + d // bn, dc // bk, (rows[1] - rows[0]) * (cols[1] - cols[0])


def _block_layouts(c: Companion, target, weight_specs, weight_lays, tensors, scheme: Scheme, group: int, relayout):
    block = scheme.block
    scale_of = dict(c.scale_of)
    _check_scale_shapes(c, tensors, block, scheme.where)
    dtypes = sorted(set(map(_DTYPE, map(tensors.__getitem__, c.sources))))
    if len(dtypes) > 1:
        raise PlanError(f"{c.name}: its parts' scales have different dtypes {dtypes}; the checkpoint contradicts itself")
    grid = _BlockGrid(scale_of, tensors, block)
    specs: dict[int, tuple[ParamSpec, int, int]] = {}   # per weight spec (shared by many ranks): its scale's

    def scales(lay, w):
        pieces = grid.pieces(lay, w)
        made = specs.get(id(w))
        if made is None:
            local = block_scale_shape(w.local_shape, block)
            if w.style == "expert":
                glob = (w.global_shape[0],) + block_scale_shape(w.global_shape[1:], block)
            else:   # the scales of the weight's parts, stacked
                distinct = list(dict.fromkeys(c.sources))
                glob = (sum(view2d(tuple(tensors[s].shape))[0] for s in distinct),
                        view2d(tuple(tensors[distinct[0]].shape))[1])
            made = specs[id(w)] = (ParamSpec(c.name, w.style, dtypes[0], glob, local, experts=w.experts),
                                   *view2d(local))
        spec, local_rows, local_cols = made
        return spec, LocalLayout(local_rows, local_cols, pieces)
    try:
        if isinstance(weight_lays, ExpertLayouts):
            return _lazy_expert_scales(c, weight_specs, weight_lays, scales, tensors, block, dtypes[0])
        return unzipped(per_group(scales, weight_lays, weight_specs))
    except _SplitBlock as split:
        raise _split_error(c, target, split, tensors, scheme, group, relayout) from None


def _check_scale_shapes(c: Companion, tensors: dict, block, where: str) -> None:
    """PlanError at the first scale whose shape is not its weight's block grid. Shapes are compared as lists, once
    per distinct weight shape (every expert's is one): a companion may hold every expert of a layer."""
    weights, scales = zip(*c.scale_of)
    weight_shapes = list(map(tuple, map(_SHAPE, map(tensors.__getitem__, weights))))
    wants = {shape: block_scale_shape(shape, block) for shape in set(weight_shapes)}
    if list(map(tuple, map(_SHAPE, map(tensors.__getitem__, scales)))) == list(map(wants.__getitem__, weight_shapes)):
        return
    for w_src, s_src in c.scale_of:
        want = wants[tuple(tensors[w_src].shape)]
        if tuple(tensors[s_src].shape) != want:
            raise PlanError(f"{s_src}: shape {list(tensors[s_src].shape)}, but {w_src} {list(tensors[w_src].shape)} "
                            f"with block {list(block)} ({where}) needs {list(want)}; the block size in "
                            f"config.json does not match the checkpoint")


def _lazy_expert_scales(c: Companion, weight_specs, weight_lays: ExpertLayouts, scales, tensors: dict, block,
                        dtype: str):
    """An expert weight's block scales, per rank when asked (expert_layouts.py). Every expert has one geometry,
    so the ranks of one (rank in group, number of hosted experts) are checked now, one each: what a split block
    or an untiled grid would refuse fails while planning. A scale source's takers are its weight source's, each
    mapped onto the block grid as _BlockGrid maps a piece (an edge inside a block was refused above)."""
    pairs: dict[int, tuple] = {}
    scale_of = dict(c.scale_of)

    def pair(i: int):
        if i not in pairs:
            pairs[i] = scales(weight_lays.value(i), weight_specs.value(i))
        return pairs[i]
    placement = weight_lays.placement
    for i in placement.one_per_shape:
        pair(i)
    bn, bk = block
    mapped = placement.memo   # alike across layers, as the weight's takers are

    def takers_of(w_source: str) -> tuple:
        w, s = tensors[w_source], tensors[scale_of[w_source]]
        w_isz = itemsize(w.dtype)
        weight_takers = weight_lays.takers(w_source, w_isz)
        key = ("block scales", id(weight_takers), w.shape[-2], w.dtype, s.dtype, bn, bk)   # shape[-2]: one matrix's rows
        known = mapped.get(key)
        if known is None:   # the weight's takers are kept alive by the placement's memo: ids stay unique
            n, s_isz = _matrix_dims(tuple(w.shape), w_source)[0], itemsize(s.dtype)
            nb, out = -(-n // bn), []
            for r0, r1, width, g in weight_takers:
                e = r0 // n
                out.append((e * nb + (r0 - e * n) // bn, e * nb + -(-(r1 - e * n) // bn),
                            -(-(width // w_isz) // bk) * s_isz, g))
            known = mapped[key] = tuple(out)
        return known
    return (RankValues((), weight_specs.world, make=lambda i: pair(i)[0], period=weight_lays.period),
            DerivedExpertLayouts(c.name, weight_lays, {s: w for w, s in c.scale_of}, lambda i: pair(i)[1], takers_of,
                                 ("block scales", bn, bk), dtype))


def _split_error(c: Companion, target, split: _SplitBlock, tensors, scheme: Scheme, group: int, relayout) -> PlanError:
    label = "ranks per expert group (world/ep)" if target.rule.style == "expert" else "tp"
    valid = []
    for q in range(1, 65):
        try:
            specs, lays = relayout(q)
            grid = _BlockGrid(dict(c.scale_of), tensors, scheme.block)
            for lay, w in zip(lays, specs):
                grid.pieces(lay, w)
        except (_SplitBlock, PlanError):
            continue
        valid.append(q)
    bn, bk = scheme.block
    hint = (f"try {label} {', '.join(map(str, valid))}" if valid else
            "no tp works: a part's size is not a multiple of the block; re-quantize with a block that divides it")
    return PlanError(f"{target.name} (rule {target.rule.style}, block FP8 [{bn}, {bk}] from {scheme.where}): "
                     f"{label}={group} {split}, inside a [{bn}, {bk}] block of its {c.name.rsplit('.', 1)[-1]}; a "
                     f"weight and its block scales are cut together, so every shard edge must fall on a block edge "
                     f"({hint})")
