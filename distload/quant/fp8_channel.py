"""Per-channel FP8: one fp32 scale per output row (compressed-tensors strategy channel: the "FP8-dynamic"
checkpoints, activations quantized per token at run time), final as cut: no step unless --dequantize.

    X.weight        F8_E4M3 [out, in]
    X.weight_scale  F32 [out, 1]          experts: per expert [n, 1] -> w13 [local experts, 2I/tp, 1], w2 [.., H, 1]
A scale row belongs to its weight row, so the scale is cut with the weight's rows: column-parallel and fused
(qkv, gate_up) params by rank, part by part, kv heads replicated as the weight's when tp > kv heads;
row-parallel params (o_proj, down_proj, w2) cut their inputs only, so every rank holds the whole scale —
as vLLM's ChannelQuantScaleParameter loads it. `--quantize fp8-channel` makes the same from a BF16 checkpoint
on each rank; per-channel is block FP8 with a [1, in] block, so the kernels are block FP8's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .. import kernels
from ..dtypes import itemsize, torch_dtype
from ..errors import PlanError
from ..plan.expert_layouts import ExpertLayouts
from ..plan.ranks import per_group, unzipped
from ..plan.shard import LocalLayout, Piece
from ..plan.types import ParamSpec
from ..transfer import host_memory
from . import ct_config
from .expert_companions import lazy_expert_companion
from .fp8_block import bands
from .scaled import ScaledFormat, matrices


def channel_layouts(c, target, weight_specs, weight_lays, index: dict, where: str):
    """Per rank (spec, layout) of per-channel scale `c` [rows, 1]: each weight piece's rows, placed where the piece
    lands (a row-parallel piece holds every row: the whole scale). Experts: per rank when asked."""
    entries = [index[s] for s in c.sources]
    _check_shapes(c, index, where)
    dtypes = sorted({e.dtype for e in entries})
    if len(dtypes) > 1:
        raise PlanError(f"{c.name}: its parts' scales have different dtypes {dtypes}; the checkpoint contradicts "
                        f"itself")
    scale_of = dict(c.scale_of)

    def derive(lay: LocalLayout, w):
        if lay.padding:
            raise PlanError(f"{w.name}: a zero-padded param with per-channel scales ({where}) is not supported")
        pieces = tuple(Piece(scale_of[pc.source], pc.rows, (0, 1), pc.dst_row, 0) for pc in lay.pieces
                       if pc.dst_col == 0)
        if sum(pc.rows[1] - pc.rows[0] for pc in pieces) != lay.rows:
            raise PlanError(f"{w.name}: its pieces do not cover its {lay.rows} local rows once; per-channel scales "
                            f"cannot follow this cut")
        style = "replicate" if w.style == "row" else w.style   # a row-parallel layer's scale: all of it, everywhere
        spec = ParamSpec(c.name, style, dtypes[0], tuple(w.global_shape[:-1]) + (1,),
                         tuple(w.local_shape[:-1]) + (1,), experts=w.experts)
        return spec, LocalLayout(lay.rows, 1, pieces)

    if isinstance(weight_lays, ExpertLayouts):
        return lazy_expert_companion(c, weight_specs, weight_lays, derive, _row_takers, ("channel scales",), index,
                                     dtypes[0])
    return unzipped(per_group(derive, weight_lays, weight_specs))


def _row_takers(weight_takers, w, s):
    """A scale source's takers: its weight source's rows, one value each."""
    s_isz = itemsize(s.dtype)
    return ((r0, r1, s_isz, g) for r0, r1, _, g in weight_takers)


def _check_shapes(c, index: dict, where: str) -> None:
    """PlanError at the first scale that is not [rows, 1] of its weight [rows, in] (stacked: [E, rows, 1])."""
    for w_src, s_src in c.scale_of:
        want = tuple(index[w_src].shape[:-1]) + (1,)
        if tuple(index[s_src].shape) != want:
            raise PlanError(f"{s_src}: shape {list(index[s_src].shape)}, but {w_src} {list(index[w_src].shape)} with "
                            f"per-channel scales ({where}) needs {list(want)}; config.json's strategy does not match "
                            f"the checkpoint")


def _dequantize_channel(step, finals, weight, scale):
    dtype = torch_dtype(finals[0].dtype)
    out = host_memory.empty(weight.shape, dtype, weight.device)
    o, w, s = matrices(out), matrices(weight), matrices(scale)
    block = (1, w.shape[-1])
    for e, r0, r1 in bands(weight, block):
        o[e, r0:r1] = kernels.dequantize_fp8_block(w[e, r0:r1], s[e, r0:r1], block, dtype)
    return (out,)


def _quantize_channel(step, finals, weight):
    q = host_memory.empty(weight.shape, kernels.FP8_DTYPE, weight.device)
    s = torch.empty(tuple(weight.shape[:-1]) + (1,), dtype=torch.float32, device=weight.device)
    wq, ws, w = matrices(q), matrices(s), matrices(weight)
    block = (1, w.shape[-1])
    for e, r0, r1 in bands(weight, block):
        wq[e, r0:r1], ws[e, r0:r1] = kernels.quantize_fp8_block(w[e, r0:r1], block)
    return q, s


@dataclass(frozen=True)
class Fp8Channel(ScaledFormat):
    """Per-channel FP8 (see the module docstring)."""
    name: ClassVar[str] = "fp8-channel"
    declared_by: ClassVar[str] = ("fp8-channel (compressed-tensors 8-bit float strategy channel, dynamic "
                                  "activations: FP8-dynamic)")
    dequantize_op: ClassVar[str] = "dequantize_channel"
    quantize_op: ClassVar[str] = "quantize_channel"
    OPS: ClassVar[dict] = {"dequantize_channel": _dequantize_channel, "quantize_channel": _quantize_channel}

    @staticmethod
    def declares(qc: dict) -> bool:
        return ct_config.declares(qc, "float", 8, "channel")

    @classmethod
    def from_config(cls, qc: dict, where: str) -> "Fp8Channel":
        check_channel_config(qc, where, "FP8-dynamic")
        return cls(where)

    def cut_scale(self, c, target, weight_specs, weight_lays, index: dict, group: int, relayout):
        return channel_layouts(c, target, weight_specs, weight_lays, index, self.where)

    @staticmethod
    def online_scale(w) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(local, global) shape of --quantize fp8-channel's scale: one per row of the rank's shard."""
        return tuple(w.local_shape[:-1]) + (1,), tuple(w.global_shape[:-1]) + (1,)


def check_channel_config(qc: dict, where: str, recipe: str) -> None:
    """Refuse, by name, what a per-channel compressed-tensors checkpoint may declare and distload does not load:
    asymmetric or dynamic weights, static (stored) activation scales or zero points."""
    weights = ct_config.uniform_weights(qc, packed=False)
    if not weights.get("symmetric", True) or weights.get("dynamic", False):
        raise PlanError(f"{where}: weights symmetric {weights.get('symmetric')!r}, dynamic {weights.get('dynamic')!r}: "
                        f"distload loads symmetric, static per-channel weight scales (no weight_zero_point), as vLLM "
                        f"does")
    if ct_config.static_input(qc):
        raise PlanError(f"{where}: static input_activations (a stored input_scale / input_zero_point per linear) with "
                        f"per-channel weights: not supported; distload loads per-channel checkpoints with dynamic "
                        f"per-token activations ({recipe})")
