"""ModelOpt NVFP4 (quant_method modelopt, quant_algo NVFP4): e2m1 values two per byte, an fp8 scale per 16-value
block, and per part a global fp32 scale.

    X.weight  U8 [out, in/2]     X.weight_scale  F8_E4M3 [out, in/16]     X.weight_scale_2 / X.input_scale  F32 per part
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .. import kernels
from .format import refuse_kind
from .packed import PackedFormat, packed_op
from .packed_table import IN, ONE, OUT, Cut

BLOCK = 16


def _matrix(step, t: dict, dtype):
    weight, scale, scale_2 = t["weight"], t["weight_scale"], t["weight_scale_2"].reshape(-1)
    out = torch.empty(weight.shape[0], weight.shape[1] * 2, dtype=dtype, device=weight.device)
    row = 0
    for rows, part in step.runs:  # each fused part with its own global scale
        out[row:row + rows] = kernels.dequantize_nvfp4(weight[row:row + rows], scale[row:row + rows],
                                                       scale_2[part], dtype)
        row += rows
    return out


@dataclass(frozen=True)
class Nvfp4(PackedFormat):
    """NVFP4 (see the module docstring)."""
    name: ClassVar[str] = "nvfp4"
    declared_by: ClassVar[str] = "nvfp4 (quant_method modelopt, quant_algo NVFP4, group_size 16)"
    unit_name: ClassVar[str] = "block"
    dequantize_op: ClassVar[str] = "dequantize_nvfp4"
    OPS: ClassVar[dict] = {"dequantize_nvfp4": packed_op(_matrix)}

    @staticmethod
    def declares(qc: dict) -> bool:
        return qc.get("quant_method") == "modelopt"

    @classmethod
    def from_config(cls, qc: dict, where: str) -> "Nvfp4":
        body = qc.get("quantization", qc)
        if body.get("quant_algo") != "NVFP4":
            raise refuse_kind(where, f"quant_algo {body.get('quant_algo')!r}", "ModelOpt NVFP4 checkpoints")
        if body.get("group_size", BLOCK) != BLOCK:
            raise refuse_kind(where, f"group_size {body.get('group_size')}", f"NVFP4 blocks of {BLOCK} values")
        return cls(where, group=BLOCK)

    def cuts(self, in_features: int) -> dict[str, Cut]:
        return {"weight_scale": Cut((OUT, 1), (IN, BLOCK), ("F8_E4M3",)), "weight": Cut((OUT, 1), (IN, 2), ("U8",)),
                "weight_scale_2": Cut((ONE, 1), (ONE, 1), ("F32",), per_part=True, scalar=True),
                "input_scale": Cut((ONE, 1), (ONE, 1), ("F32",), optional=True, per_part=True, scalar=True)}
