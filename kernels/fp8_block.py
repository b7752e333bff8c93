"""Block FP8 (DeepSeek-V3 style): one fp32 scale per [bn, bk] block of a [N, K] or [E, N, K] weight.

`scale_inv` follows the checkpoint convention of DeepSeek-V3 (`weight_scale_inv`): dequant =
float(w_fp8) * scale_inv of the element's block; scale_inv = block amax / 448. N and K need not be
multiples of the block: edge blocks are partial and still get one scale each, so the scale shape is
[..., ceil(N/bn), ceil(K/bk)]. Expert-stacked weights [E, N, K] carry scales [E, ceil(N/bn), ceil(K/bk)].
"""

import torch
import torch.nn.functional as F

from .backend import cast_in_kernel, use_triton
from .fp8_format import (
    DEFAULT_BLOCK,
    FP8_DTYPE,
    block_scale_shape,
    check_block,
    check_floating,
    check_fp8,
    saturating_cast_to_fp8,
    scale_from_amax,
)


@torch.no_grad()
def quantize_fp8_block(
    w: torch.Tensor, block: tuple[int, int] = DEFAULT_BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] or [E, N, K] (float) -> (fp8 of w's shape, fp32 scale_inv [(E,) ceil(N/bn), ceil(K/bk)])."""
    check_floating(w, "quantize_fp8_block")
    block = check_block(block)
    scale_shape = block_scale_shape(w.shape, block)
    if not use_triton(w, needs_fp8=True):
        return quantize_fp8_block_reference(w, block)
    from .fp8_triton import block_quantize_triton

    stacked = _stacked(w.contiguous())
    q = torch.empty(stacked.shape, dtype=FP8_DTYPE if cast_in_kernel(w.device) else torch.float32, device=w.device)
    scale_inv = torch.empty(_stacked_shape(scale_shape), dtype=torch.float32, device=w.device)
    block_quantize_triton(stacked, q, scale_inv, block)
    # under the interpreter q holds clamped fp32 values; torch's cast of those is the saturating one
    return q.to(FP8_DTYPE).reshape(w.shape), scale_inv.reshape(scale_shape)


@torch.no_grad()
def quantize_fp8_block_reference(
    w: torch.Tensor, block: tuple[int, int] = DEFAULT_BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    check_floating(w, "quantize_fp8_block")
    bn, bk = block = check_block(block)
    scale_shape = block_scale_shape(w.shape, block)
    stacked = _stacked(w)
    n, k = stacked.shape[1:]
    n_tiles_n, n_tiles_k = scale_shape[-2:]
    q = torch.empty(stacked.shape, dtype=FP8_DTYPE, device=w.device)
    scale_inv = torch.empty(_stacked_shape(scale_shape), dtype=torch.float32, device=w.device)
    for e in range(stacked.shape[0]):  # one matrix at a time bounds the fp32 temporaries
        # zero padding to whole blocks leaves every block's amax unchanged
        x = F.pad(stacked[e].float(), (0, n_tiles_k * bk - k, 0, n_tiles_n * bn - n))
        tiles = x.reshape(n_tiles_n, bn, n_tiles_k, bk)
        scale = scale_from_amax(tiles.abs().amax(dim=(1, 3)))
        y = (tiles / scale[:, None, :, None]).reshape(n_tiles_n * bn, n_tiles_k * bk)
        q[e] = saturating_cast_to_fp8(y[:n, :k])
        scale_inv[e] = scale
    return q.reshape(w.shape), scale_inv.reshape(scale_shape)


@torch.no_grad()
def dequantize_fp8_block(
    w_fp8: torch.Tensor,
    scale_inv: torch.Tensor,
    block: tuple[int, int] = DEFAULT_BLOCK,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """fp8 [N, K] or [E, N, K] with fp32 block scale_inv -> float(w_fp8) * scale_inv per block, as `dtype`."""
    block = _check_dequant_args(w_fp8, scale_inv, block)
    if not use_triton(w_fp8, needs_fp8=True):
        return dequantize_fp8_block_reference(w_fp8, scale_inv, block, dtype)
    from .fp8_triton import block_dequantize_triton

    stacked = _stacked(w_fp8.contiguous())
    scales = _stacked(scale_inv.to(device=w_fp8.device, dtype=torch.float32).contiguous())
    out_dtype = dtype if cast_in_kernel(w_fp8.device) else torch.float32
    out = torch.empty(stacked.shape, dtype=out_dtype, device=w_fp8.device)
    block_dequantize_triton(stacked, scales, out, block)
    return out.to(dtype).reshape(w_fp8.shape)


@torch.no_grad()
def dequantize_fp8_block_reference(
    w_fp8: torch.Tensor,
    scale_inv: torch.Tensor,
    block: tuple[int, int] = DEFAULT_BLOCK,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    bn, bk = block = _check_dequant_args(w_fp8, scale_inv, block)
    stacked = _stacked(w_fp8)
    scales = _stacked(scale_inv.to(device=w_fp8.device, dtype=torch.float32))
    n, k = stacked.shape[1:]
    out = torch.empty(stacked.shape, dtype=dtype, device=w_fp8.device)
    for e in range(stacked.shape[0]):
        per_element = scales[e].repeat_interleave(bn, dim=0)[:n].repeat_interleave(bk, dim=1)[:, :k]
        out[e] = (stacked[e].float() * per_element).to(dtype)
    return out.reshape(w_fp8.shape)


def _check_dequant_args(w_fp8: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> tuple[int, int]:
    check_fp8(w_fp8, "dequantize_fp8_block")
    block = check_block(block)
    expected = block_scale_shape(w_fp8.shape, block)
    if tuple(scale_inv.shape) != expected:
        raise ValueError(
            f"dequantize_fp8_block: weight {tuple(w_fp8.shape)} with block {block} needs scale_inv of shape "
            f"{expected} (ceil division, partial edge blocks included), got {tuple(scale_inv.shape)}; "
            "check the block size (quantization_config.weight_block_size) and the scale's TP slice"
        )
    return block


def _stacked(t: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [1, N, K]; [E, N, K] unchanged: one code path for dense and expert-stacked weights."""
    return t if t.dim() == 3 else t.unsqueeze(0)


def _stacked_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    return shape if len(shape) == 3 else (1, *shape)
