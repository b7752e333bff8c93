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

from ..errors import PlanError
from .packed4 import PackedTensor, by_weight
from .packed4_formats import MXFP4_BLOCK, Packed4
from ..plan.shard import LocalLayout, Piece, valid_group_sizes
from ..plan.types import ParamSpec

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


def _refusal(weight: str, inter: int, g: int, scheme: Packed4) -> PlanError:
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
    return PlanError(f"{weight} ({scheme.describe()}): intermediate_size {inter} cut by {g} ranks per expert "
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


def packed_layouts(planned: dict, packed: tuple[PackedTensor, ...], targets: dict, index: dict,
                   scheme: Packed4, dequantize: bool = False) -> dict:
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
