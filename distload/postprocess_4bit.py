"""The post-load step of packed 4-bit loads (plan.quant4_steps.Dequant4Step): one rank's packed tensors of
one linear -> its float weight, with distload.kernels (Triton on CUDA, the torch references on CPU)."""

from __future__ import annotations

import torch

from . import kernels
from .dtypes import torch_dtype


def _nvfp4(step, t: dict, dtype) -> torch.Tensor:
    weight, scale, scale_2 = t["weight"], t["weight_scale"], t["weight_scale_2"].reshape(-1)
    out = torch.empty(weight.shape[0], weight.shape[1] * 2, dtype=dtype, device=weight.device)
    row = 0
    for rows, part in step.runs:  # each fused part with its own global scale
        out[row:row + rows] = kernels.dequantize_nvfp4(weight[row:row + rows], scale[row:row + rows],
                                                       scale_2[part], dtype)
        row += rows
    return out


def dequantize4(step, finals, *inputs) -> tuple[torch.Tensor]:
    t = dict(zip(step.suffixes, inputs))
    dtype = torch_dtype(finals[0].dtype)
    if step.format == "gptq":
        g_idx = t.get("g_idx") if step.use_g_idx else None
        w = kernels.dequantize_gptq(t["qweight"], t["qzeros"], t["scales"], g_idx, group_size=step.group or -1,
                                    dtype=dtype)
    elif step.format == "awq":
        w = kernels.dequantize_awq(t["qweight"], t["qzeros"], t["scales"], dtype=dtype)
    elif step.format == "ct-int4":
        w = kernels.dequantize_compressed_int4(t["weight_packed"], t["weight_scale"], t.get("weight_zero_point"),
                                               dtype=dtype)
    else:
        w = _nvfp4(step, t, dtype)
    return (w,)


OPS = {"dequantize4": dequantize4}
