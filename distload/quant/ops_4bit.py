"""The post-load step of packed 4-bit loads (quant.packed4_steps.Dequant4Step): one rank's packed tensors of
one linear -> its float weight, with distload.kernels (Triton on CUDA, the torch references on CPU)."""

from __future__ import annotations

import json
import math

import torch

from .. import kernels
from ..dtypes import torch_dtype


def _nvfp4(step, t: dict, dtype) -> torch.Tensor:
    weight, scale, scale_2 = t["weight"], t["weight_scale"], t["weight_scale_2"].reshape(-1)
    out = torch.empty(weight.shape[0], weight.shape[1] * 2, dtype=dtype, device=weight.device)
    row = 0
    for rows, part in step.runs:  # each fused part with its own global scale
        out[row:row + rows] = kernels.dequantize_nvfp4(weight[row:row + rows], scale[row:row + rows],
                                                       scale_2[part], dtype)
        row += rows
    return out


def _bnb_states(step, t: dict) -> list[dict]:
    """Each part's quant_state (bitsandbytes' JSON, stored as bytes; the parts' one after another)."""
    blob = next(v for k, v in t.items() if k.startswith("weight.quant_state.")).reshape(-1).tolist()
    out, at = [], 0
    for n in step.state_sizes:
        out.append(json.loads(bytes(blob[at:at + n]).decode()))
        at += n
    return out


def _bnb_undo_nested(step, t: dict, codes: torch.Tensor) -> torch.Tensor:
    """fp32 absmax of this rank's blocks: nested_quant_map[code] * nested_absmax[b // 256] + offset, with b
    the block's index in its part's whole weight (bitsandbytes' double quantization, per part)."""
    states = _bnb_states(step, t)
    maps = t["weight.nested_quant_map"].reshape(len(states), -1).float()
    nested = t["weight.nested_absmax"].reshape(-1).float()
    starts = [0]
    for st in states:
        starts.append(starts[-1] + -(-math.prod(st["shape"]) // st["blocksize"] // st["nested_blocksize"]))
    out = torch.empty(codes.shape, dtype=torch.float32, device=codes.device)
    for dst_row, dst_col, rows, cols, src_row, src_col, src_cols, part in step.blocks:
        c = codes[dst_row:dst_row + rows, dst_col:dst_col + cols].long()
        b = ((src_row + torch.arange(rows, device=codes.device))[:, None] * src_cols
             + (src_col + torch.arange(cols, device=codes.device))[None, :])
        per_block = nested[starts[part]:starts[part + 1]][b // states[part]["nested_blocksize"]]
        offset = torch.tensor(states[part]["nested_offset"], dtype=torch.float32, device=codes.device)
        out[dst_row:dst_row + rows, dst_col:dst_col + cols] = maps[part][c] * per_block + offset
    return out


def _bnb(step, t: dict, dtype) -> torch.Tensor:
    weight, absmax = t["weight"], t["weight.absmax"]
    if absmax.dtype == torch.uint8:
        absmax = _bnb_undo_nested(step, t, absmax)
    maps = t["weight.quant_map"].reshape(-1, 16)
    cols = weight.shape[1] * 2
    out = torch.empty(weight.shape[0], cols, dtype=dtype, device=weight.device)
    row = 0
    for rows, part in step.runs:  # blocks never cross a row (in % 64 == 0); each part with its own code book
        out[row:row + rows] = kernels.dequantize_bnb_4bit(weight[row:row + rows], absmax[row:row + rows],
                                                          maps[part], (rows, cols), dtype=dtype)
        row += rows
    return out


def dequantize4(step, finals, *inputs) -> tuple[torch.Tensor]:
    t = dict(zip(step.suffixes, inputs))
    dtype = torch_dtype(finals[0].dtype)
    if len(finals[0].local_shape) == 3:  # experts: each local expert is its own matrix
        # MXFP4 stages each rank's slice unpadded; the output is vLLM's padded param, zeros past the slice
        padded = finals[0].padding != ()
        out = (torch.zeros if padded else torch.empty)(finals[0].local_shape, dtype=dtype, device=inputs[0].device)
        for e in range(out.shape[0]):
            w = _dequantize_matrix(step, {k: v[e] for k, v in t.items()}, dtype)
            out[e, :w.shape[0], :w.shape[1]] = w
        return (out,)
    return (_dequantize_matrix(step, t, dtype),)


def _dequantize_matrix(step, t: dict, dtype) -> torch.Tensor:
    if step.format == "gptq":
        g_idx = t.get("g_idx") if step.use_g_idx else None
        w = kernels.dequantize_gptq(t["qweight"], t["qzeros"], t["scales"], g_idx, group_size=step.group or -1,
                                    dtype=dtype)
    elif step.format == "awq":
        w = kernels.dequantize_awq(t["qweight"], t["qzeros"], t["scales"], dtype=dtype)
    elif step.format == "ct-int4":
        w = kernels.dequantize_compressed_int4(t["weight_packed"], t["weight_scale"], t.get("weight_zero_point"),
                                               dtype=dtype)
    elif step.format == "bnb":
        w = _bnb(step, t, dtype)
    elif step.format == "mxfp4":   # vLLM's w13_weight [rows, in/2] is the blocks [rows, in/32, 16] flattened
        blocks = t["weight"]
        w = kernels.dequantize_mxfp4(blocks.reshape(blocks.shape[0], -1, 16), t["weight_scale"], dtype=dtype)
    else:
        w = _nvfp4(step, t, dtype)
    return w


OPS = {"dequantize4": dequantize4}
