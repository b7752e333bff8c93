"""The safetensors dtype names distload accepts, and their torch equivalents (a whitelist, DESIGN §5)."""

import torch

SAFETENSORS_TO_TORCH: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
TORCH_TO_SAFETENSORS: dict[torch.dtype, str] = {v: k for k, v in SAFETENSORS_TO_TORCH.items()}


def itemsize(dtype_name: str) -> int:
    """Bytes per element of a safetensors dtype name."""
    return SAFETENSORS_TO_TORCH[dtype_name].itemsize


def torch_dtype(dtype_name: str) -> torch.dtype:
    return SAFETENSORS_TO_TORCH[dtype_name]
