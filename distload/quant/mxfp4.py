"""GPT-OSS MXFP4 experts, cut as vLLM's gpt_oss.py cuts them and padded as its mxfp4.py allocates them.

vLLM's loader (models/gpt_oss.py, _load_weights_mxfp4) splits each expert's intermediate size I in whole
32-value MXFP4 blocks, unevenly: per = ceil((I / 32) / tp) * 32 values a rank, rank t holds [t * per,
min((t + 1) * per, I)), so the last rank may hold fewer (I = 2880 at tp 8: 384 on ranks 0..6, 192 on rank 7).
Its MXFP4 MoE method (quantization/mxfp4.py, create_weights) allocates every rank's params for
I_pad = round_up(I // tp, 64) (its default backend; Marlin and FlashInfer round to 128 or 256), and the
weight loader copies the slice into the corner [:, :rows, :cols]: the rest stays zero. Per rank (E local experts):

    w13_weight        uint8 [E, 2 * I_pad, H / 2]   rows [2s, 2e) of gate_up_proj_blocks (gate/up interleaved)
    w13_weight_scale  uint8 [E, 2 * I_pad, H / 32]  the same rows of gate_up_proj_scales
    w13_bias          bf16  [E, 2 * I_pad]          the same entries of gate_up_proj_bias
    w2_weight         uint8 [E, H, I_pad / 2]       columns [s / 2, e / 2) of down_proj_blocks as [E, H, I / 2]
    w2_weight_scale   uint8 [E, H, I_pad / 32]      columns [s / 32, e / 32) of down_proj_scales

Zero blocks dequantize to 0 and the clamped SwiGLU of a zero gate/up pair is 0, so the padding changes no
output. `tp` here is the expert group's size (tp / ep ranks split each expert; EP placement as for BF16
experts). vLLM asserts I % tp == 0; a split that leaves a rank without a block is refused as well.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import ClassVar

from .. import kernels
from ..errors import PlanError
from ..plan.expected_shapes import weight_dtype
from ..plan.quantization import View
from ..plan.shard import LocalLayout, Piece, valid_group_sizes
from ..plan.types import ParamSpec
from .companions import Companion, by_weight, with_suffix
from .packed import PackedFormat, packed_op
from .packed_table import IN, OUT, Cut
from .packed_view import LOGICAL

MXFP4_BLOCK = 32
PARTS = ("_blocks", "_scales")   # how GPT-OSS stores a stacked expert tensor X in MXFP4
PAD = 64   # vLLM's round_up of the per-rank intermediate size (mxfp4.py, the default backend)


def rank_range(inter: int, g: int, t: int) -> tuple[int, int]:
    """The intermediate values [s, e) rank t of g holds: vLLM's whole-block, uneven split."""
    per = -(-(inter // MXFP4_BLOCK) // g) * MXFP4_BLOCK
    return t * per, min((t + 1) * per, inter)


def padded_size(inter: int, g: int) -> int:
    """Every rank's allocated intermediate size: round_up(I // g, 64)."""
    return -(-(inter // g) // PAD) * PAD


def splits(inter: int, g: int) -> bool:
    """Whether g ranks can split I as vLLM does: whole blocks, I % g == 0, every rank at least one block."""
    return (inter % MXFP4_BLOCK == 0 and inter % g == 0 and rank_range(inter, g, g - 1)[0] < inter
            and padded_size(inter, g) >= rank_range(inter, g, 0)[1])


def _refusal(weight: str, inter: int, g: int, scheme) -> PlanError:
    n = inter // MXFP4_BLOCK
    if inter % MXFP4_BLOCK:
        why = f"{inter} is not a whole number of {MXFP4_BLOCK}-value blocks"
    elif inter % g:
        why = f"vLLM needs intermediate_size % tp == 0 ({inter} % {g} = {inter % g})"
    else:
        per = rank_range(inter, g, 0)[1] // MXFP4_BLOCK
        empty = [t for t in range(g) if rank_range(inter, g, t)[0] >= inter]
        why = (f"{n} blocks of {MXFP4_BLOCK}, ceil({n} / {g}) = {per} a rank (vLLM's split), leave rank(s) "
               f"{empty} of each expert group without a block")
    valid = valid_group_sizes(lambda q: splits(inter, q), upto=16)
    return PlanError(f"{weight} ({scheme.label()}): intermediate_size {inter} cut by {g} ranks per expert "
                     f"(tp / ep): {why}; MXFP4 experts are cut in whole blocks (try {', '.join(map(str, valid))} "
                     f"ranks per expert group)")


def _stacked_cut(source: str, matrix: tuple[int, int], experts, lo: int, hi: int, size: int, along_rows: bool):
    """(local shape, layout) of [len(experts), ...] from a stacked source of `matrix`-shaped experts: per expert its
    rows (along_rows) or columns [lo, hi) at the start of the slot, zeros up to `size`."""
    rows, cols = matrix
    n = len(experts)
    if along_rows:
        pieces = tuple(Piece(source, (e * rows + lo, e * rows + hi), (0, cols), slot * size, 0)
                       for slot, e in enumerate(experts))
        padding = tuple((slot * size + hi - lo, (slot + 1) * size, 0, cols) for slot in range(n) if hi - lo < size)
        return (n, size, cols), LocalLayout(n * size, cols, pieces, padding)
    pieces = tuple(Piece(source, (e * rows, (e + 1) * rows), (lo, hi), slot * rows, 0) for slot, e in enumerate(experts))
    padding = ((0, n * rows, hi - lo, size),) if hi - lo < size and n else ()
    return (n, rows, size), LocalLayout(n * rows, size, pieces, padding)


def packed_layouts(planned: dict, packed: tuple[Companion, ...], targets: dict, index: dict, scheme,
                   dequantize: bool = False) -> dict:
    """Replace each MXFP4 weight's logical (specs, layouts) in `planned` by its blocks' and scales' (and w13's
    bias by its padded cut); return the padded logical ones (what --dequantize produces). With dequantize the
    blocks and scales are staged unpadded (a post-load step never reads a padded param): it pads its output."""
    logical = {}
    for weight, tensors in by_weight(packed).items():
        if weight not in planned:
            continue
        specs, _ = planned.pop(weight)
        along_rows = targets[weight].rule.inner == "column"    # w13: the intermediate runs along out; w2: along in
        axis = 1 if along_rows else 2
        g = specs[0].global_shape[axis] // specs[0].local_shape[axis]
        experts, rows, cols = specs[0].global_shape
        inter = rows // 2 if along_rows else cols
        if not splits(inter, g):
            raise _refusal(weight, inter, g, scheme)
        scale = 2 if along_rows else 1          # w13's rows interleave gate and up: two per intermediate value
        ranges = [rank_range(inter, g, r % g) for r in range(len(specs))]
        size = padded_size(inter, g) * scale

        def cut(source, matrix, unit, dtype, name, global_shape, padded=True):
            out_specs, out_lays = [], []
            for spec, (s, e) in zip(specs, ranges):
                lo, hi, n = (s * scale, e * scale, size) if along_rows else (s // unit, e // unit, size // unit)
                shape, lay = _stacked_cut(source, matrix, spec.experts, lo, hi, n if padded else hi - lo, along_rows)
                out_specs.append(ParamSpec(name, "expert", dtype, global_shape, shape, lay.padding, experts=spec.experts))
                out_lays.append(lay)
            return out_specs, out_lays

        for p in tensors:
            unit, source = p.cut.cols[1], p.sources[0]
            planned[p.name] = cut(source, (rows, cols // unit), unit, index[source].dtype, p.name,
                                  (experts, rows, cols // unit), padded=not dequantize)
        logical[weight] = cut(targets[weight].sources[0], (rows, cols), 1, specs[0].dtype, weight, (experts, rows, cols))
        bias = weight[: -len("weight")] + "bias"
        if along_rows and bias in planned:
            planned[bias] = _bias(planned[bias][0], targets[bias].sources[0], ranges, rows, size)
    return logical


def _bias(specs, source: str, ranges, rows: int, size: int):
    """w13_bias [E, 2I] as stored (one row per expert), cut and padded like w13's rows."""
    out_specs, out_lays = [], []
    for spec, (s, e) in zip(specs, ranges):
        shape, lay = _stacked_cut(source, (1, rows), spec.experts, 2 * s, 2 * e, size, False)
        out_specs.append(ParamSpec(spec.name, "expert", spec.dtype, (spec.global_shape[0], rows), (shape[0], size),
                                   lay.padding, experts=spec.experts))
        out_lays.append(lay)
    return out_specs, out_lays


def _logical_view(scheme, targets, tensors: dict) -> View:
    """A stacked expert target whose source X is stored as X_blocks [E, out, in/32, 16] and X_scales [E, out, in/32]
    (not transposed, unlike the BF16 X) plans a logical weight [E, out, in] (0 bytes), and the blocks are read as
    their [E, out, in/2] view (the same bytes): both then run along out and in like the weight."""
    index, out_targets, packed = dict(tensors), [], []
    cuts = scheme.cuts(0)
    dtype = weight_dtype([t for t in targets if all(s in tensors for s in t.sources)], tensors) or "BF16"
    for t in targets:
        src = t.sources[0]
        blocks, scales = (src + suffix for suffix in PARTS)
        if not (t.rule.style == "expert" and t.rule.stacked and len(t.sources) == 1 and blocks in tensors):
            out_targets.append(t)
            continue
        if scales not in tensors:
            raise PlanError(f"{t.name} ({scheme.label()}): the checkpoint has {blocks} but lacks {scales}; "
                            f"every MXFP4 tensor has its E8M0 scales: the checkpoint is incomplete")
        b, s = tensors[blocks], tensors[scales]
        # [E, out, in/2] too: the same bytes as vLLM's w13_weight, which a sharded save records
        view = tuple(b.shape[:2]) + (math.prod(b.shape[2:]),) if len(b.shape) in (3, 4) else (0, 0, 1)
        if ((b.dtype, s.dtype) != ("U8", "U8") or (len(b.shape) == 4 and b.shape[3] != 16) or view[2] % 16
                or tuple(s.shape) != view[:2] + (view[2] // 16,)):
            raise PlanError(f"{blocks} {b.dtype} {list(b.shape)}, {scales} {s.dtype} {list(s.shape)}: MXFP4 stores "
                            f"X_blocks uint8 [experts, out, in/32, 16] and X_scales uint8 [experts, out, in/32] "
                            f"({scheme.label()}); the checkpoint does not match its config")
        experts, rows, half = view
        logical_name = LOGICAL.format(src)
        logical = replace(t, sources=(logical_name,), rule=replace(t.rule, transposed=False))
        index[logical_name] = replace(b, name=logical_name, dtype=dtype, shape=(experts, rows, half * 2), nbytes=0)
        index[blocks] = replace(b, shape=view)
        out_targets.append(logical)
        packed += [Companion(t.name, t.name, "weight", ((logical_name, blocks),), cuts["weight"]),
                   Companion(with_suffix(t.name, "weight_scale"), t.name, "weight_scale", ((logical_name, scales),),
                             cuts["weight_scale"])]
    return View(out_targets, index, tuple(packed))


def _matrix(step, t: dict, dtype):
    blocks = t["weight"]   # vLLM's w13_weight [rows, in/2] is the blocks [rows, in/32, 16] flattened
    return kernels.dequantize_mxfp4(blocks.reshape(blocks.shape[0], -1, 16), t["weight_scale"], dtype=dtype)


@dataclass(frozen=True)
class Mxfp4(PackedFormat):
    """GPT-OSS MXFP4 experts (see the module docstring)."""
    name: ClassVar[str] = "mxfp4"
    declared_by: ClassVar[str] = "mxfp4 (quant_method mxfp4: GPT-OSS experts)"
    unit_name: ClassVar[str] = "block"
    dequantize_op: ClassVar[str] = "dequantize_mxfp4"
    OPS: ClassVar[dict] = {"dequantize_mxfp4": packed_op(_matrix)}

    @staticmethod
    def declares(qc: dict) -> bool:
        return qc.get("quant_method") == "mxfp4"

    @classmethod
    def from_config(cls, qc: dict, where: str) -> "Mxfp4":
        return cls(where, group=MXFP4_BLOCK)

    def cuts(self, in_features: int) -> dict[str, Cut]:
        # vLLM's names: X_blocks -> w13_weight, X_scales -> w13_weight_scale
        return {"weight": Cut((OUT, 1), (IN, 2), ("U8",)), "weight_scale": Cut((OUT, 1), (IN, MXFP4_BLOCK), ("U8",))}

    def view(self, targets, tensors: dict, rules, config: dict) -> View:
        return _logical_view(self, targets, tensors)

    def cut(self, view: View, planned: dict, targets: dict, layout, relayout) -> dict:
        return packed_layouts(planned, view.companions, targets, view.index, self, self.dequantize)
