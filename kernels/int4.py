"""Dequantization of 4-bit integer checkpoints (GPTQ, AWQ, compressed-tensors pack-quantized) to [out, in].

One arithmetic for all three (int4_format.py has the layouts and where they are defined): each public
function checks its tensors' shapes, describes them as an `Int4Layout` and hands them to the Triton
kernel (CUDA, or DISTLOAD_FORCE_TRITON=1) or to the plain-torch reference; both are bit-equal.
"""

from __future__ import annotations

import torch

from .backend import cast_in_kernel, use_triton
from .fp8_format import REFERENCE_CHUNK_ELEMS
from .int4_format import PACK, Int4Layout, awq_layout, awq_nibble, check_shape, compressed_layout, gptq_layout


def _groups(in_features: int, group_size: int) -> int:
    return 1 if group_size in (-1, 0) or group_size >= in_features else in_features // group_size


def _gptq_args(qweight, qzeros, scales, g_idx, group_size):
    in_features, out_features = qweight.shape[0] * PACK, qweight.shape[1]
    groups = scales.shape[0]
    check_shape("GPTQ", "qzeros", qzeros.shape, (groups, out_features // PACK))
    if g_idx is None:
        check_shape("GPTQ", "scales", scales.shape, (_groups(in_features, group_size), out_features))
    else:
        check_shape("GPTQ", "g_idx", g_idx.shape, (in_features,))
    return out_features, in_features, gptq_layout(out_features, groups)


@torch.no_grad()
def dequantize_gptq(qweight, qzeros, scales, g_idx=None, group_size=128, dtype=torch.bfloat16):
    """GPTQ v1 tensors -> the float weight [out, in]; g_idx None means group i // group_size."""
    out_f, in_f, layout = _gptq_args(qweight, qzeros, scales, g_idx, group_size)
    return _dispatch(qweight, qzeros, scales, g_idx, layout, out_f, in_f, _size(in_f, group_size), dtype)


@torch.no_grad()
def dequantize_gptq_reference(qweight, qzeros, scales, g_idx=None, group_size=128, dtype=torch.bfloat16):
    out_f, in_f, layout = _gptq_args(qweight, qzeros, scales, g_idx, group_size)
    return _reference(qweight, qzeros, scales, g_idx, layout, out_f, in_f, _size(in_f, group_size), dtype)


def _check_groups(fmt: str, in_features: int, groups: int) -> None:
    if groups < 1 or in_features % groups:
        raise ValueError(f"{fmt}: {groups} scale groups do not divide {in_features} input features")


def _awq_args(qweight, qzeros, scales):
    in_features, out_features = qweight.shape[0], qweight.shape[1] * PACK
    groups = scales.shape[0]
    _check_groups("AWQ", in_features, groups)
    check_shape("AWQ", "scales", scales.shape, (groups, out_features))
    check_shape("AWQ", "qzeros", qzeros.shape, (groups, out_features // PACK))
    return out_features, in_features, awq_layout(out_features, groups), in_features // groups


@torch.no_grad()
def dequantize_awq(qweight, qzeros, scales, dtype=torch.bfloat16):
    """AWQ GEMM tensors (qweight [in, out/8]) -> the float weight [out, in]."""
    out_f, in_f, layout, group = _awq_args(qweight, qzeros, scales)
    return _dispatch(qweight, qzeros, scales, None, layout, out_f, in_f, group, dtype)


@torch.no_grad()
def dequantize_awq_reference(qweight, qzeros, scales, dtype=torch.bfloat16):
    out_f, in_f, layout, group = _awq_args(qweight, qzeros, scales)
    return _reference(qweight, qzeros, scales, None, layout, out_f, in_f, group, dtype)


def _compressed_args(weight_packed, weight_scale, weight_zero_point):
    out_features, in_features = weight_packed.shape[0], weight_packed.shape[1] * PACK
    groups = weight_scale.shape[1]
    _check_groups("compressed-tensors", in_features, groups)
    check_shape("compressed-tensors", "weight_scale", weight_scale.shape, (out_features, groups))
    if weight_zero_point is not None:
        check_shape("compressed-tensors", "weight_zero_point", weight_zero_point.shape,
                    (out_features // PACK, groups))
    layout = compressed_layout(in_features, groups, weight_zero_point is not None)
    return out_features, in_features, layout, in_features // groups


@torch.no_grad()
def dequantize_compressed_int4(weight_packed, weight_scale, weight_zero_point=None, dtype=torch.bfloat16):
    """compressed-tensors pack-quantized int4 (weight_packed [out, in/8]) -> the float weight [out, in]."""
    out_f, in_f, layout, group = _compressed_args(weight_packed, weight_scale, weight_zero_point)
    return _dispatch(weight_packed, weight_zero_point, weight_scale, None, layout, out_f, in_f, group, dtype)


@torch.no_grad()
def dequantize_compressed_int4_reference(weight_packed, weight_scale, weight_zero_point=None, dtype=torch.bfloat16):
    out_f, in_f, layout, group = _compressed_args(weight_packed, weight_scale, weight_zero_point)
    return _reference(weight_packed, weight_zero_point, weight_scale, None, layout, out_f, in_f, group, dtype)


def _size(in_features: int, group_size: int) -> int:
    return in_features if group_size in (-1, 0) else group_size


def _dispatch(qweight, zeros, scales, g_idx, layout: Int4Layout, out_f, in_f, group, dtype):
    if not use_triton(qweight):
        return _reference(qweight, zeros, scales, g_idx, layout, out_f, in_f, group, dtype)
    from .int4_triton import int4_dequantize_triton

    store = dtype if cast_in_kernel(qweight.device) else torch.float32
    out = torch.empty(out_f, in_f, dtype=store, device=qweight.device)
    int4_dequantize_triton(qweight.contiguous(), None if zeros is None else zeros.contiguous(),
                           scales.float().contiguous(), None if g_idx is None else g_idx.int().contiguous(),
                           out, layout, group)
    return out if out.dtype == dtype else out.to(dtype)


def _reference(qweight, zeros, scales, g_idx, layout: Int4Layout, out_f, in_f, group, dtype):
    out = torch.empty(out_f, in_f, dtype=dtype, device=qweight.device)
    words = qweight.reshape(-1).int()
    scale_flat = scales.reshape(-1).float()
    zero_words = None if zeros is None else zeros.reshape(-1).int()
    i = torch.arange(in_f, device=qweight.device)[None, :]
    g = (g_idx.long()[None, :] if g_idx is not None else i // group)
    rows = max(1, REFERENCE_CHUNK_ELEMS // max(1, in_f))
    for start in range(0, out_f, rows):  # row chunks bound the index temporaries
        o = torch.arange(start, min(out_f, start + rows), device=qweight.device)[:, None]
        if layout.pack_input:
            word = (i // PACK) * layout.q_stride_in + o * layout.q_stride_out
            shift = (i % PACK) * 4
        else:
            word = i * layout.q_stride_in + (o // PACK) * layout.q_stride_out
            shift = (awq_nibble(o % PACK) if layout.awq_order else o % PACK) * 4
        q = (words[word] >> shift) & 15
        s = scale_flat[g * layout.scale_stride_group + o * layout.scale_stride_out]
        if layout.has_zero:
            z_shift = (awq_nibble(o % PACK) if layout.awq_order else o % PACK) * 4
            z_word = g * layout.zero_stride_group + (o // PACK) * layout.zero_stride_out
            z = ((zero_words[z_word] >> z_shift) & 15) + layout.zero_bias
        else:
            z = layout.zero_const
        out[start:start + o.shape[0]] = ((q - z).float() * s).to(dtype)
    return out
