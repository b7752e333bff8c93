"""Block FP8: one fp32 scale per [bn, bk] block of each weight (DeepSeek-V3's quant_method fp8 with
weight_block_size, compressed-tensors strategy block), final as cut: no step unless --dequantize.

    X.weight              F8_E4M3 [out, in]
    X.weight_scale_inv    F32 [ceil(out/bn), ceil(in/bk)]   (compressed-tensors: X.weight_scale)
The scale's rows and columns follow the weight's on the block grid (block_grid.py); a shard edge inside a block
is refused while planning, naming the tp values that work. `--quantize fp8-block` quantizes a BF16
checkpoint's linear weights on each rank into [128, 128] blocks of its local shard.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .. import kernels
from ..dtypes import torch_dtype
from ..errors import PlanError
from ..transfer import host_memory
from . import ct_config
from .block_grid import block_layouts, block_scale_shape
from .fp8 import fp8_method, static_activations
from .scaled import SCALED_OPS, ScaledFormat, matrices

ONLINE_BLOCK = (128, 128)  # DeepSeek-V3's block, what block-FP8 GEMM kernels expect
# Block kernels are called on bands of whole block rows (a block never crosses a band, so the result is the
# same): the CPU references widen their input to fp32 several times over, and a band bounds that to ~4 MiB
# per temporary instead of several copies of the largest matrix.
BAND_ELEMS = 1 << 20


def _block(value, where: str) -> tuple[int, int]:
    if (not isinstance(value, (list, tuple)) or len(value) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)):
        raise PlanError(f"{where} must be two positive integers [rows, cols], got {value!r}; fix config.json")
    return int(value[0]), int(value[1])


def bands(weight: torch.Tensor, block):
    """(matrix, first row, last row) of bands of whole block rows down every matrix of `weight`."""
    w = matrices(weight)
    n, k = w.shape[1:]
    rows = max(1, BAND_ELEMS // max(1, k) // block[0]) * block[0]
    for e in range(w.shape[0]):
        for r0 in range(0, n, rows):
            yield e, r0, min(n, r0 + rows)


def _quantize_block(step, finals, weight):
    bn = step.block[0]
    q = host_memory.empty(weight.shape, kernels.FP8_DTYPE, weight.device)
    s = torch.empty(kernels.block_scale_shape(weight.shape, step.block), dtype=torch.float32, device=weight.device)
    wq, ws, w = matrices(q), matrices(s), matrices(weight)
    for e, r0, r1 in bands(weight, step.block):
        wq[e, r0:r1], ws[e, r0 // bn:-(-r1 // bn)] = kernels.quantize_fp8_block(w[e, r0:r1], step.block)
    return q, s


def _dequantize_block(step, finals, weight, scale_inv, *input_scales):
    bn, dtype = step.block[0], torch_dtype(finals[0].dtype)
    out = host_memory.empty(weight.shape, dtype, weight.device)
    o, w, s = matrices(out), matrices(weight), matrices(scale_inv)
    for e, r0, r1 in bands(weight, step.block):
        o[e, r0:r1] = kernels.dequantize_fp8_block(w[e, r0:r1], s[e, r0 // bn:-(-r1 // bn)], step.block, dtype)
    return (out,)


@dataclass(frozen=True)
class Fp8Block(ScaledFormat):
    """Block FP8 (see the module docstring)."""
    block: tuple[int, int] = ONLINE_BLOCK
    scale_suffix: str = "weight_scale_inv"

    name: ClassVar[str] = "fp8-block"
    declared_by: ClassVar[str] = ("fp8-block (quant_method fp8 with weight_block_size, or compressed-tensors 8-bit "
                                  "float strategy block)")
    dequantize_op: ClassVar[str] = "dequantize_block"
    quantize_op: ClassVar[str] = "quantize_block"
    OPS: ClassVar[dict] = {**SCALED_OPS, "quantize_block": _quantize_block, "dequantize_block": _dequantize_block}

    @staticmethod
    def declares(qc: dict) -> bool:
        return fp8_method(qc, block=True) or ct_config.declares(qc, "float", 8, "block")

    @classmethod
    def from_config(cls, qc: dict, where: str) -> "Fp8Block":
        static = static_activations(qc, where)
        if qc.get("quant_method") == ct_config.METHOD:   # compressed-tensors names the scale weight_scale
            group = ct_config.groups(qc)[0][0]
            block = _block(ct_config.uniform_weights(qc, packed=False).get("block_structure"),
                           f"{where}: config_groups.{group}.weights.block_structure")
            return cls(where, static_input=static, scale_suffix="weight_scale", block=block)
        block = _block(qc.get("weight_block_size"), f"{where}: weight_block_size")
        return cls(where, static_input=static, block=block)

    def details(self) -> str:
        return f"{self.block[0]}x{self.block[1]}"

    @property
    def scale_block(self) -> tuple[int, int]:
        return self.block

    def cut_scale(self, c, target, weight_specs, weight_lays, index: dict, group: int, relayout):
        return block_layouts(c, target, weight_specs, weight_lays, index, self.block, self.where, group, relayout)

    def online_scale(self, w) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(local, global) shape of --quantize fp8-block's scale: the block grid of the rank's shard."""
        return block_scale_shape(w.local_shape, self.block), block_scale_shape(w.global_shape, self.block)
