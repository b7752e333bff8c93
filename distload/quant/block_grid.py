"""Block scales' layouts, derived from their weight's, so weight and scale shards always match.

The weight's pieces are mapped onto the block grid: rows [a, b) -> scale rows [a/bn, ceil(b/bn)), columns alike.
A piece whose edge falls inside a block is refused while planning, with the group sizes that work (a scale row
cannot belong to two ranks' different rows). Experts' block scales are made per rank when asked, as their
weights' layouts are (plan/expert_layouts.py), so a rank's planning grows with its own experts.
"""

from __future__ import annotations

import math
import operator

from ..errors import PlanError
from ..dtypes import itemsize
from ..plan.expert_layouts import ExpertLayouts
from ..plan.ranks import RankValues, per_group, unzipped
from ..plan.shard import LocalLayout, Piece, view2d
from ..plan.types import ParamSpec
from .companions import Companion
from .expert_companions import lazy_expert_companion
from .format import group_label, hint_sizes

_SHAPE, _DTYPE = operator.attrgetter("shape"), operator.attrgetter("dtype")   # of a checkpoint entry

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


def block_layouts(c: Companion, target, weight_specs, weight_lays, tensors, block: tuple[int, int], where: str,
                  group: int, relayout) -> tuple[RankValues, RankValues]:
    """Per rank (spec, layout) of block scale `c`, from its weight's per-rank specs and layouts, cut once per group
    of ranks that hold the same weight shard. group: the size of the group the weight is cut over (tp; for experts,
    ranks per expert group); relayout(q): the weight's (specs, layouts) at group size q, asked only when a block
    is split, to name the sizes that work."""
    scale_of = dict(c.scale_of)
    _check_scale_shapes(c, tensors, block, where)
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
        raise _split_error(c, target, split, tensors, block, where, group, relayout) from None


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
    """An expert weight's block scales, per rank when asked (expert_companions.py). A scale source's takers are
    its weight source's, each mapped onto the block grid as _BlockGrid maps a piece (an edge inside a block was
    refused when the ranks of each shape were derived)."""
    bn, bk = block

    def on_the_grid(weight_takers, w, s):
        w_isz, s_isz = itemsize(w.dtype), itemsize(s.dtype)
        n = _matrix_dims(tuple(w.shape), w.name)[0]
        nb = -(-n // bn)
        for r0, r1, width, g in weight_takers:
            e = r0 // n
            yield (e * nb + (r0 - e * n) // bn, e * nb + -(-(r1 - e * n) // bn), -(-(width // w_isz) // bk) * s_isz, g)
    return lazy_expert_companion(c, weight_specs, weight_lays, scales, on_the_grid, ("block scales", bn, bk),
                                 tensors, dtype)


def _split_error(c: Companion, target, split: _SplitBlock, tensors, block, where: str, group: int,
                 relayout) -> PlanError:
    def fits(q: int) -> bool:
        try:
            specs, lays = relayout(q)
            grid = _BlockGrid(dict(c.scale_of), tensors, block)
            for lay, w in zip(lays, specs):
                grid.pieces(lay, w)
        except (_SplitBlock, PlanError):
            return False
        return True
    label, (bn, bk) = group_label(target), block
    hint = hint_sizes(fits, label, none="no tp works: a part's size is not a multiple of the block; re-quantize "
                                        "with a block that divides it")
    return PlanError(f"{target.name} (rule {target.rule.style}, block FP8 [{bn}, {bk}] from {where}): "
                     f"{label}={group} {split}, inside a [{bn}, {bk}] block of its {c.name.rsplit('.', 1)[-1]}; a "
                     f"weight and its block scales are cut together, so every shard edge must fall on a block edge "
                     f"({hint})")
