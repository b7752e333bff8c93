"""Triton twin of fp4.lut_dequantize_reference: value k = table[nibble k] * scales[k // block].

The 16-entry table is gathered from memory; the output is stored in its pointer's dtype (fp32 under the
interpreter, where torch casts; see backend.cast_in_kernel).
"""

import torch
import triton
import triton.language as tl

_BLOCK = 1024


@triton.jit
def _lut_dequant_kernel(packed_ptr, scale_ptr, table_ptr, out_ptr, numel, block,
                        HIGH_FIRST: tl.constexpr, BLOCK: tl.constexpr):
    k = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = k < numel
    byte = tl.load(packed_ptr + k // 2, mask=mask, other=0).to(tl.int32)
    odd = (k % 2) == 1
    if HIGH_FIRST:
        code = tl.where(odd, byte & 15, byte >> 4)
    else:
        code = tl.where(odd, byte >> 4, byte & 15)
    value = tl.load(table_ptr + code, mask=mask, other=0.0)
    y = value * tl.load(scale_ptr + k // block, mask=mask, other=0.0)
    tl.store(out_ptr + k, y.to(out_ptr.dtype.element_ty), mask=mask)


def lut_dequantize_triton(packed: torch.Tensor, scales: torch.Tensor, table: torch.Tensor, out: torch.Tensor,
                          block: int, high_first: bool) -> None:
    """packed uint8 flat, fp32 scales flat, fp32 table [16] -> out flat (contiguous)."""
    numel = out.numel()
    if numel == 0:
        return
    _lut_dequant_kernel[(triton.cdiv(numel, _BLOCK),)](
        packed, scales, table, out, numel, block, HIGH_FIRST=high_first, BLOCK=_BLOCK, num_warps=4)
