"""Triton twins of the FP8 references: per-tensor amax, elementwise rescale, block quantize/dequantize.

Each kernel does the reference's fp32 arithmetic in the same order with IEEE-rounded division
(`tl.math.div_rn`). Not `/`, which is approximate on NVIDIA, and not `tl.fdiv(..., ieee_rounding=True)`,
which Triton 3.6 compiles as approximate too: a quotient that is exactly an fp8 midpoint then rounds the
wrong way (scripts/gpu_check.sh catches it; BENCHMARKS.md has the GPU run). Each kernel then stores into its
output pointer's dtype. The callers pass the real fp8/bf16 output on CUDA and an fp32 buffer under
the interpreter, where torch then performs the (saturating, round-to-nearest-even) final cast; see
`backend.cast_in_kernel`.
"""

import torch
import triton
import triton.language as tl

from .fp8_format import FP8_MAX

_AMAX_BLOCK = 4096
_TILE_ELEMS = 4096  # elements per program of the elementwise rescale


@triton.jit
def _clamp(y, LIMIT: tl.constexpr):
    # NaN stays NaN, as in torch.clamp
    y = tl.maximum(y, -LIMIT, propagate_nan=tl.PropagateNan.ALL)
    return tl.minimum(y, LIMIT, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _amax_partials_kernel(x_ptr, partials_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(partials_ptr + tl.program_id(0), tl.max(tl.abs(x), axis=0))


def amax_triton(x: torch.Tensor) -> torch.Tensor:
    """fp32 scalar max |x| of a contiguous floating tensor (0 when empty)."""
    n = x.numel()
    if n == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    n_blocks = triton.cdiv(n, _AMAX_BLOCK)
    partials = torch.empty(n_blocks, dtype=torch.float32, device=x.device)
    _amax_partials_kernel[(n_blocks,)](x, partials, n, BLOCK=_AMAX_BLOCK, num_warps=8)
    return partials.amax()


@triton.jit
def _rescale_kernel(
    x_ptr, out_ptr, mul_ptr, div_ptr, rows, cols, n_col_tiles,
    HAS_MUL: tl.constexpr, MUL_PER_ROW: tl.constexpr, HAS_DIV: tl.constexpr, CLAMP: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """out[r, c] = clamp((float(x[r, c]) * mul[r or 0]) / div[0]), each step optional."""
    pid = tl.program_id(0)
    r = (pid // n_col_tiles).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = (pid % n_col_tiles).to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (r < rows)[:, None] & (c < cols)[None, :]
    offs = r[:, None] * cols + c[None, :]
    y = tl.load(x_ptr + offs, mask=mask).to(tl.float32)  # no `other`: it cannot be cast to fp8
    if HAS_MUL:
        if MUL_PER_ROW:
            y = y * tl.load(mul_ptr + r, mask=r < rows, other=1.0)[:, None]
        else:
            y = y * tl.load(mul_ptr)
    if HAS_DIV:
        y = tl.math.div_rn(y, tl.load(div_ptr))
    if CLAMP > 0:
        y = _clamp(y, CLAMP)
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def rescale_triton(
    x: torch.Tensor,
    out: torch.Tensor,
    mul: torch.Tensor | None = None,
    div: torch.Tensor | None = None,
    clamp_fp8: bool = False,
) -> None:
    """Writes clamp((x * mul) / div) into `out` (same shape, contiguous; may be x itself).

    x is viewed as [rows, cols] with cols its last dim; `mul` is one fp32 value or one per row,
    `div` one fp32 value; both on x's device.
    """
    if x.numel() == 0:
        return
    cols = x.shape[-1] if x.dim() else 1
    rows = x.numel() // cols
    block_c = min(triton.next_power_of_2(cols), _TILE_ELEMS)
    block_r = min(triton.next_power_of_2(rows), max(1, _TILE_ELEMS // block_c))
    n_col_tiles = triton.cdiv(cols, block_c)
    grid = (triton.cdiv(rows, block_r) * n_col_tiles,)
    mul_per_row = mul is not None and mul.numel() > 1
    _rescale_kernel[grid](
        x, out, mul if mul is not None else x, div if div is not None else x, rows, cols, n_col_tiles,
        HAS_MUL=mul is not None, MUL_PER_ROW=mul_per_row, HAS_DIV=div is not None,
        CLAMP=FP8_MAX if clamp_fp8 else 0.0, BLOCK_R=block_r, BLOCK_C=block_c, num_warps=8,
    )


@triton.jit
def _block_offsets(pid, N, K, n_tiles_n, n_tiles_k,
                   BN: tl.constexpr, BK: tl.constexpr, TILE_N: tl.constexpr, TILE_K: tl.constexpr):
    """Element offsets and mask of block `pid` of an [E, N, K] tensor (blocks numbered like the scales)."""
    per_matrix = n_tiles_n * n_tiles_k
    e = pid // per_matrix
    bn = (pid % per_matrix) // n_tiles_k
    bk = pid % n_tiles_k
    i = tl.arange(0, TILE_N)  # TILE_* are BN/BK rounded up to powers of two, as tl.arange needs
    j = tl.arange(0, TILE_K)
    r = bn.to(tl.int64) * BN + i
    c = bk.to(tl.int64) * BK + j
    mask = ((i < BN) & (r < N))[:, None] & ((j < BK) & (c < K))[None, :]
    offs = e.to(tl.int64) * N * K + r[:, None] * K + c[None, :]
    return offs, mask


@triton.jit
def _block_quant_kernel(x_ptr, q_ptr, scale_ptr, N, K, n_tiles_n, n_tiles_k,
                        BN: tl.constexpr, BK: tl.constexpr, TILE_N: tl.constexpr, TILE_K: tl.constexpr,
                        LIMIT: tl.constexpr):
    pid = tl.program_id(0)
    offs, mask = _block_offsets(pid, N, K, n_tiles_n, n_tiles_k, BN, BK, TILE_N, TILE_K)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
    scale = tl.math.div_rn(amax, LIMIT)
    scale = tl.where(scale > 0, scale, 1.0)  # all-zero block: any scale works, 1.0 is the harmless one
    y = _clamp(tl.math.div_rn(x, scale), LIMIT)
    tl.store(q_ptr + offs, y.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + pid, scale)


@triton.jit
def _block_dequant_kernel(q_ptr, scale_ptr, out_ptr, N, K, n_tiles_n, n_tiles_k,
                          BN: tl.constexpr, BK: tl.constexpr, TILE_N: tl.constexpr, TILE_K: tl.constexpr):
    pid = tl.program_id(0)
    offs, mask = _block_offsets(pid, N, K, n_tiles_n, n_tiles_k, BN, BK, TILE_N, TILE_K)
    y = tl.load(q_ptr + offs, mask=mask).to(tl.float32) * tl.load(scale_ptr + pid)
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def _block_launch_args(shape: torch.Size, scale_shape: torch.Size, block: tuple[int, int]) -> tuple:
    n, k = shape[-2], shape[-1]
    n_tiles_n, n_tiles_k = scale_shape[-2], scale_shape[-1]
    grid = (scale_shape.numel(),)
    meta = dict(BN=block[0], BK=block[1], TILE_N=triton.next_power_of_2(block[0]),
                TILE_K=triton.next_power_of_2(block[1]), num_warps=8)
    return grid, (n, k, n_tiles_n, n_tiles_k), meta


def block_quantize_triton(x: torch.Tensor, q_out: torch.Tensor, scale_out: torch.Tensor,
                          block: tuple[int, int]) -> None:
    """x [E, N, K] contiguous -> q_out (fp8, or fp32 to be cast by torch) and fp32 scale_out [E, nbn, nbk]."""
    if x.numel() == 0:
        return
    grid, dims, meta = _block_launch_args(x.shape, scale_out.shape, block)
    _block_quant_kernel[grid](x, q_out, scale_out, *dims, LIMIT=FP8_MAX, **meta)


def block_dequantize_triton(q: torch.Tensor, scale: torch.Tensor, out: torch.Tensor,
                            block: tuple[int, int]) -> None:
    """q [E, N, K] fp8 contiguous, fp32 scale [E, nbn, nbk] -> out (target dtype, or fp32)."""
    if q.numel() == 0:
        return
    grid, dims, meta = _block_launch_args(q.shape, scale.shape, block)
    _block_dequant_kernel[grid](q, scale, out, *dims, **meta)
