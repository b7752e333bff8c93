"""Per-tensor FP8 (e4m3fn): quantize, dequantize, and requantize fused params to one scale.

A fused param (qkv_proj, gate_up_proj) loaded from a per-tensor FP8 checkpoint holds one scale per
logical part, but per-tensor GEMM kernels take one scale for the whole weight. Taking the max scale
without touching the weights would silently scale up every other part, so each part is dequantized
with its own scale and requantized with the max (vLLM's `requantize_with_max_scale`); the part that
owns the max comes back bit-identical.

Dequantize: w = float(q) * scale. Quantize: q = fp8(clamp(w / scale, +-448)), scale = amax / 448.
"""

from collections.abc import Sequence

import torch

from .backend import cast_in_kernel, use_triton
from .fp8_format import (
    FP8_DTYPE,
    check_floating,
    check_fp8,
    row_chunks,
    saturating_cast_to_fp8,
    scale_from_amax,
)


@torch.no_grad()
def quantize_fp8_per_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w (float) -> (fp8 tensor of w's shape, fp32 scalar scale); dequant = fp8 * scale."""
    check_floating(w, "quantize_fp8_per_tensor")
    if not use_triton(w, needs_fp8=True):
        return quantize_fp8_per_tensor_reference(w)
    from .fp8_triton import amax_triton, rescale_triton

    w = w.contiguous()
    scale = scale_from_amax(amax_triton(w))
    q = _kernel_output(w, FP8_DTYPE)
    rescale_triton(w, q, div=scale.reshape(1), clamp_fp8=True)
    return _final_cast(q, FP8_DTYPE), scale


@torch.no_grad()
def quantize_fp8_per_tensor_reference(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    check_floating(w, "quantize_fp8_per_tensor")
    scale = scale_from_amax(_amax_reference(w))
    q = torch.empty(w.shape, dtype=FP8_DTYPE, device=w.device)
    for src, dst in zip(row_chunks(w), row_chunks(q)):
        dst.copy_(saturating_cast_to_fp8(src.float() / scale))
    return q, scale


@torch.no_grad()
def dequantize_fp8_per_tensor(
    w_fp8: torch.Tensor, scale: torch.Tensor | float, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """fp8 tensor and one scale -> float(w_fp8) * scale, cast to `dtype`."""
    check_fp8(w_fp8, "dequantize_fp8_per_tensor")
    scale = _one_scale(scale, w_fp8.device, "dequantize_fp8_per_tensor")
    if not use_triton(w_fp8, needs_fp8=True):
        return _dequantize_reference(w_fp8, scale, dtype)
    from .fp8_triton import rescale_triton

    w_fp8 = w_fp8.contiguous()
    out = _kernel_output(w_fp8, dtype)
    rescale_triton(w_fp8, out, mul=scale.reshape(1))
    return _final_cast(out, dtype)


@torch.no_grad()
def dequantize_fp8_per_tensor_reference(
    w_fp8: torch.Tensor, scale: torch.Tensor | float, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    check_fp8(w_fp8, "dequantize_fp8_per_tensor")
    return _dequantize_reference(w_fp8, _one_scale(scale, w_fp8.device, "dequantize_fp8_per_tensor"), dtype)


@torch.no_grad()
def requantize_fp8_parts(
    weight_fp8: torch.Tensor, part_rows: Sequence[int], part_scales: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused [rows, cols] fp8 weight with one scale per row-block part -> (same weight, one fp32 scale).

    Rewrites `weight_fp8` in place (and returns it) so no second copy of the param is ever held; the
    scale is the max of `part_scales`, as a 0-d fp32 tensor on the weight's device.
    """
    scales = _check_parts(weight_fp8, part_rows, part_scales)
    max_scale = scales.max()
    if not use_triton(weight_fp8, needs_fp8=True):
        _requantize_reference(weight_fp8, part_rows, scales, max_scale)
        return weight_fp8, max_scale
    from .fp8_triton import rescale_triton

    work = weight_fp8 if weight_fp8.is_contiguous() else weight_fp8.contiguous()
    row_scales = torch.repeat_interleave(
        scales, torch.tensor(list(part_rows), device=scales.device), output_size=work.shape[0]
    )
    out = _kernel_output(work, FP8_DTYPE)  # `work` itself on CUDA: an in-place rewrite
    rescale_triton(work, out, mul=row_scales, div=max_scale.reshape(1), clamp_fp8=True)
    if out is not weight_fp8:
        weight_fp8.copy_(_final_cast(out, FP8_DTYPE))
    return weight_fp8, max_scale


@torch.no_grad()
def requantize_fp8_parts_reference(
    weight_fp8: torch.Tensor, part_rows: Sequence[int], part_scales: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    scales = _check_parts(weight_fp8, part_rows, part_scales)
    max_scale = scales.max()
    _requantize_reference(weight_fp8, part_rows, scales, max_scale)
    return weight_fp8, max_scale


def _requantize_reference(weight_fp8, part_rows, scales, max_scale) -> None:
    start = 0
    for rows, scale in zip(part_rows, scales):
        for piece in row_chunks(weight_fp8[start : start + rows]):
            piece.copy_(saturating_cast_to_fp8(piece.float() * scale / max_scale))
        start += rows


def _dequantize_reference(w_fp8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    out = torch.empty(w_fp8.shape, dtype=dtype, device=w_fp8.device)
    for src, dst in zip(row_chunks(w_fp8), row_chunks(out)):
        dst.copy_((src.float() * scale).to(dtype))
    return out


def _amax_reference(w: torch.Tensor) -> torch.Tensor:
    if w.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=w.device)
    # max |w| is exact in w's own dtype; the inf-norm finds it without an abs() copy of w
    return torch.linalg.vector_norm(w.reshape(-1), float("inf")).float()


def _kernel_output(like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Where a kernel stores: the real dtype when it may cast itself, else fp32 for torch to cast."""
    if cast_in_kernel(like.device):
        if like.dtype == dtype:
            return like  # in place (requantize)
        return torch.empty(like.shape, dtype=dtype, device=like.device)
    return torch.empty(like.shape, dtype=torch.float32, device=like.device)


def _final_cast(out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # fp32 buffers hold already clamped values, so a plain cast is the saturating one
    return out if out.dtype == dtype else out.to(dtype)


def _one_scale(scale: torch.Tensor | float, device: torch.device, name: str) -> torch.Tensor:
    scale = torch.as_tensor(scale, dtype=torch.float32, device=device)
    if scale.numel() != 1:
        raise ValueError(f"{name}: a per-tensor scale has one value, got shape {tuple(scale.shape)}")
    return scale.reshape(())


def _check_parts(weight_fp8: torch.Tensor, part_rows: Sequence[int], part_scales: torch.Tensor) -> torch.Tensor:
    """Validates the part layout; returns the part scales as fp32 [n_parts] on the weight's device."""
    check_fp8(weight_fp8, "requantize_fp8_parts")
    if weight_fp8.dim() != 2:
        raise ValueError(f"requantize_fp8_parts: expected a [rows, cols] weight, got shape {tuple(weight_fp8.shape)}")
    scales = torch.as_tensor(part_scales).to(device=weight_fp8.device, dtype=torch.float32).reshape(-1)
    rows = [int(r) for r in part_rows]
    if len(rows) != scales.numel() or not rows:
        raise ValueError(
            f"requantize_fp8_parts: {len(rows)} parts (part_rows={rows}) but {scales.numel()} part scales; "
            "give one scale per logical part (q, k, v or gate, up)"
        )
    if any(r < 0 for r in rows) or sum(rows) != weight_fp8.shape[0]:
        raise ValueError(
            f"requantize_fp8_parts: part_rows={rows} sum to {sum(rows)}, but the weight has "
            f"{weight_fp8.shape[0]} rows; the parts must tile dim 0 exactly"
        )
    return scales
