"""The FP8 format distload writes (OCP e4m3fn) and the few torch helpers every FP8 kernel shares.

Reference and Triton code follow the same arithmetic, step by step, so their results are bit-equal:
values are widened to fp32, scaled with correctly rounded fp32 multiply/divide (never a multiply by a
precomputed reciprocal, which rounds differently), clamped to +-448 and only then cast.
"""

import math
from collections.abc import Iterator

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448.0
DEFAULT_BLOCK = (128, 128)  # DeepSeek-V3 weight_block_size

# Bounds the fp32 temporaries of the references to ~64 MiB, whatever the tensor size: CPU ranks run
# the references in production, and a rank must never hold a second full-size copy (DESIGN §5).
REFERENCE_CHUNK_ELEMS = 1 << 24


def saturating_cast_to_fp8(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> e4m3fn, round-to-nearest-even, out-of-range values saturate to +-448.

    torch's cast alone turns anything beyond 448 into NaN, hence the clamp (NaN stays NaN).
    """
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """Per-tensor or per-block scale: amax / 448, and 1.0 where that is zero (all-zero or tiny input).

    Divides by a tensor on amax's device, not by a Python float: CUDA torch turns `x / 448.0` into
    `x * (1 / 448.0)`, which differs from the Triton kernels' IEEE division in the last bit.
    """
    amax = amax.float()
    scale = amax / torch.full((), FP8_MAX, dtype=torch.float32, device=amax.device)
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def check_floating(t: torch.Tensor, name: str) -> None:
    if not t.is_floating_point() or t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise ValueError(f"{name}: expected a float16/bfloat16/float32/float64 tensor, got {t.dtype}")


def check_fp8(t: torch.Tensor, name: str) -> None:
    if t.dtype != FP8_DTYPE:
        raise ValueError(f"{name}: expected {FP8_DTYPE}, got {t.dtype}; quantize it first")


def block_scale_shape(weight_shape: torch.Size | tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """Scale shape of a block-quantized weight: [..., ceil(N/bn), ceil(K/bk)] (partial edge blocks count)."""
    if len(weight_shape) not in (2, 3):
        raise ValueError(f"block FP8 needs a [N, K] or [E, N, K] weight, got shape {tuple(weight_shape)}")
    bn, bk = check_block(block)
    *lead, n, k = weight_shape
    return (*lead, math.ceil(n / bn), math.ceil(k / bk))


def check_block(block: tuple[int, int]) -> tuple[int, int]:
    bn, bk = (int(b) for b in block)
    if bn <= 0 or bk <= 0:
        raise ValueError(f"block must be two positive sizes (rows, cols), got {tuple(block)}")
    return bn, bk


def row_chunks(t: torch.Tensor) -> Iterator[torch.Tensor]:
    """Views of `t` along dim 0 of at most ~REFERENCE_CHUNK_ELEMS elements each (writes go through)."""
    if t.dim() == 0:
        yield t
        return
    row_elems = max(1, math.prod(t.shape[1:]))
    yield from t.split(max(1, REFERENCE_CHUNK_ELEMS // row_elems))
