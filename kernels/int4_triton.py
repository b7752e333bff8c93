"""Triton twin of kernels/int4.py's reference: one kernel for every `Int4Layout` (GPTQ, AWQ, compressed-tensors).

Each program dequantizes a [BLOCK_O, BLOCK_I] tile of the [out, in] output: it gathers the tile's words,
shifts out the nibbles, looks up group, scale and zero exactly as the reference indexes them, and stores
float(q - z) * scale (exact in fp32) in the output's dtype (fp32 under the interpreter; see
backend.cast_in_kernel).
"""

import torch
import triton
import triton.language as tl

from .int4_format import Int4Layout

_BLOCK_O = 32
_BLOCK_I = 64


@triton.jit
def _nibble_shift(col, AWQ: tl.constexpr):
    c = col % 8
    if AWQ:
        c = (c % 2) * 4 + c // 2
    return c * 4


@triton.jit
def _int4_dequant_kernel(
    q_ptr, z_ptr, s_ptr, g_ptr, out_ptr, out_f, in_f, group,
    q_si, q_so, s_sg, s_so, z_sg, z_so, zero_bias, zero_const,
    PACK_INPUT: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_GIDX: tl.constexpr, AWQ: tl.constexpr,
    BLOCK_O: tl.constexpr, BLOCK_I: tl.constexpr,
):
    o = (tl.program_id(0).to(tl.int64) * BLOCK_O + tl.arange(0, BLOCK_O))[:, None]
    i = (tl.program_id(1).to(tl.int64) * BLOCK_I + tl.arange(0, BLOCK_I))[None, :]
    mask = (o < out_f) & (i < in_f)
    if PACK_INPUT:
        word = (i // 8) * q_si + o * q_so
        shift = (i % 8) * 4
    else:
        word = i * q_si + (o // 8) * q_so
        shift = _nibble_shift(o, AWQ)
    q = (tl.load(q_ptr + word, mask=mask, other=0) >> shift.to(tl.int32)) & 15
    if HAS_GIDX:
        g = tl.load(g_ptr + i, mask=i < in_f, other=0).to(tl.int64)
    else:
        g = i // group
    s = tl.load(s_ptr + g * s_sg + o * s_so, mask=mask, other=0.0)
    if HAS_ZERO:
        zw = tl.load(z_ptr + g * z_sg + (o // 8) * z_so, mask=mask, other=0)
        z = ((zw >> _nibble_shift(o, AWQ).to(tl.int32)) & 15) + zero_bias
    else:
        z = zero_const
    y = (q - z).to(tl.float32) * s
    tl.store(out_ptr + o * in_f + i, y.to(out_ptr.dtype.element_ty), mask=mask)


def int4_dequantize_triton(qweight: torch.Tensor, zeros, scales: torch.Tensor, g_idx, out: torch.Tensor,
                           layout: Int4Layout, group: int) -> None:
    """Fills out [out_f, in_f] (contiguous) from contiguous packed words, fp32 scales, int32 g_idx or None."""
    out_f, in_f = out.shape
    if out.numel() == 0:
        return
    grid = (triton.cdiv(out_f, _BLOCK_O), triton.cdiv(in_f, _BLOCK_I))
    _int4_dequant_kernel[grid](
        qweight, zeros if zeros is not None else qweight, scales, g_idx if g_idx is not None else qweight,
        out, out_f, in_f, group, layout.q_stride_in, layout.q_stride_out, layout.scale_stride_group,
        layout.scale_stride_out, layout.zero_stride_group, layout.zero_stride_out, layout.zero_bias,
        layout.zero_const, PACK_INPUT=layout.pack_input, HAS_ZERO=layout.has_zero, HAS_GIDX=g_idx is not None,
        AWQ=layout.awq_order, BLOCK_O=_BLOCK_O, BLOCK_I=_BLOCK_I, num_warps=4,
    )
