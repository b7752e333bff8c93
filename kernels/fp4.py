"""Dequantization of the lookup-table 4-bit formats (NVFP4, MXFP4, bitsandbytes NF4/FP4); fp4_format.py
says where each layout is defined.

Each format reduces to one flat computation: value k = table[nibble k] * block_scale[k // block], with
nibble k the low (NVFP4, MXFP4) or high (bitsandbytes) half of byte k // 2 for even k. The block scales
are formed in torch by both paths (fp8 * scale_2, E8M0 bits, the undone nested absmax), so the Triton
kernel and the reference do the same single fp32 multiply and are bit-equal.
"""

from __future__ import annotations

import math

import torch

from .backend import cast_in_kernel, use_triton
from .fp4_format import (
    BNB_BLOCK,
    BNB_NESTED_BLOCK,
    MXFP4_BLOCK,
    NVFP4_BLOCK,
    e2m1_table,
    e8m0_to_float32,
)


def _nvfp4_scales(weight, weight_scale, weight_scale_2):
    out_f, in_f = weight.shape[0], weight.shape[1] * 2
    if weight.dtype != torch.uint8 or tuple(weight_scale.shape) != (out_f, in_f // NVFP4_BLOCK) or in_f % NVFP4_BLOCK:
        raise ValueError(f"NVFP4: weight uint8 [out, in/2] {tuple(weight.shape)} ({weight.dtype}) needs weight_scale "
                         f"[{out_f}, {in_f // NVFP4_BLOCK}] and in % 16 == 0, got {tuple(weight_scale.shape)}")
    scale_2 = torch.as_tensor(weight_scale_2, dtype=torch.float32, device=weight.device).reshape(())
    return weight_scale.float() * scale_2, (out_f, in_f)


@torch.no_grad()
def dequantize_nvfp4(weight, weight_scale, weight_scale_2, dtype=torch.bfloat16):
    """ModelOpt NVFP4 weight uint8 [out, in/2] -> float [out, in]."""
    scales, shape = _nvfp4_scales(weight, weight_scale, weight_scale_2)
    return _dispatch(weight, scales, e2m1_table(weight.device), NVFP4_BLOCK, False, shape, dtype)


@torch.no_grad()
def dequantize_nvfp4_reference(weight, weight_scale, weight_scale_2, dtype=torch.bfloat16):
    scales, shape = _nvfp4_scales(weight, weight_scale, weight_scale_2)
    return lut_dequantize_reference(weight, scales, e2m1_table(weight.device), NVFP4_BLOCK, False, shape, dtype)


def _mxfp4_args(blocks, scales):
    if blocks.dtype != torch.uint8 or blocks.shape[-1] != MXFP4_BLOCK // 2 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(f"MXFP4: *_blocks uint8 [..., n/32, 16] and *_scales [..., n/32] expected, got "
                         f"{tuple(blocks.shape)} ({blocks.dtype}) and {tuple(scales.shape)}")
    return e8m0_to_float32(scales), (*blocks.shape[:-2], blocks.shape[-2] * MXFP4_BLOCK)


@torch.no_grad()
def dequantize_mxfp4(blocks, scales, dtype=torch.bfloat16):
    """MXFP4 *_blocks [..., n/32, 16] + E8M0 *_scales [..., n/32] -> float [..., n]."""
    block_scales, shape = _mxfp4_args(blocks, scales)
    return _dispatch(blocks, block_scales, e2m1_table(blocks.device), MXFP4_BLOCK, False, shape, dtype)


@torch.no_grad()
def dequantize_mxfp4_reference(blocks, scales, dtype=torch.bfloat16):
    block_scales, shape = _mxfp4_args(blocks, scales)
    return lut_dequantize_reference(blocks, block_scales, e2m1_table(blocks.device), MXFP4_BLOCK, False, shape, dtype)


def _bnb_args(packed, absmax, quant_map, shape, blocksize):
    numel = math.prod(shape)
    if packed.dtype != torch.uint8 or packed.numel() != (numel + 1) // 2 or absmax.numel() != -(-numel // blocksize):
        raise ValueError(f"bitsandbytes 4-bit: a weight of shape {tuple(shape)} needs {(numel + 1) // 2} packed "
                         f"uint8 bytes and {-(-numel // blocksize)} absmax values, got {packed.numel()} "
                         f"({packed.dtype}) and {absmax.numel()}")
    if absmax.dtype != torch.float32 or quant_map.numel() != 16:
        raise ValueError("bitsandbytes 4-bit: absmax must be fp32 (undo nested quantization first with "
                         "undo_bnb_nested_absmax) and quant_map must hold 16 values")
    return absmax.reshape(-1), quant_map.reshape(-1).float(), tuple(shape)


@torch.no_grad()
def dequantize_bnb_4bit(packed, absmax, quant_map, shape, blocksize=BNB_BLOCK, dtype=torch.bfloat16):
    """bitsandbytes NF4/FP4 packed bytes (first value in the high nibble) -> float weight of `shape`."""
    absmax, table, shape = _bnb_args(packed, absmax, quant_map, shape, blocksize)
    return _dispatch(packed, absmax, table, blocksize, True, shape, dtype)


@torch.no_grad()
def dequantize_bnb_4bit_reference(packed, absmax, quant_map, shape, blocksize=BNB_BLOCK, dtype=torch.bfloat16):
    absmax, table, shape = _bnb_args(packed, absmax, quant_map, shape, blocksize)
    return lut_dequantize_reference(packed, absmax, table, blocksize, True, shape, dtype)


@torch.no_grad()
def undo_bnb_nested_absmax(absmax_codes, nested_quant_map, nested_absmax, offset,
                           nested_blocksize=BNB_NESTED_BLOCK) -> torch.Tensor:
    """bitsandbytes double quantization undone: fp32 absmax = map[code] * nested_absmax[b // 256] + offset."""
    codes = absmax_codes.reshape(-1).long()
    if nested_absmax.numel() != -(-codes.numel() // nested_blocksize):
        raise ValueError(f"bitsandbytes nested absmax: {codes.numel()} codes need "
                         f"{-(-codes.numel() // nested_blocksize)} nested_absmax values, got {nested_absmax.numel()}")
    per_code = nested_absmax.reshape(-1).float().repeat_interleave(nested_blocksize)[: codes.numel()]
    offset = torch.as_tensor(offset, dtype=torch.float32, device=codes.device)
    return nested_quant_map.reshape(-1).float()[codes] * per_code + offset


def _dispatch(packed, scales, table, block, high_first, shape, dtype):
    if not use_triton(packed):
        return lut_dequantize_reference(packed, scales, table, block, high_first, shape, dtype)
    from .fp4_triton import lut_dequantize_triton

    store = dtype if cast_in_kernel(packed.device) else torch.float32
    out = torch.empty(shape, dtype=store, device=packed.device)
    lut_dequantize_triton(packed.contiguous().reshape(-1), scales.float().contiguous().reshape(-1),
                          table.contiguous(), out.reshape(-1), block, high_first)
    return out if out.dtype == dtype else out.to(dtype)


def lut_dequantize_reference(packed, scales, table, block, high_first, shape, dtype) -> torch.Tensor:
    """The shared reference: flat value k = table[nibble k] * scales[k // block], reshaped to `shape`."""
    numel = math.prod(shape)
    data = packed.reshape(-1)
    low, high = (data & 15).long(), (data >> 4).long()
    first, second = (high, low) if high_first else (low, high)
    codes = torch.stack([first, second], dim=1).reshape(-1)[:numel]
    per_value = scales.reshape(-1).float().repeat_interleave(block)[:numel]
    return (table[codes] * per_value).to(dtype).reshape(shape)
