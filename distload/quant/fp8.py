"""Per-tensor FP8: one fp32 scale per checkpoint weight (quant_method fp8, or compressed-tensors strategy tensor).

    X.weight        F8_E4M3 [out, in]       cut as the rules cut it
    X.weight_scale  F32 [] (compressed-tensors: [1])    one per part: every rank holds every part's, in part order
    X.input_scale   F32, activation_scheme static       the same
A fused param's parts were quantized each with its own scale, so a rank holding one fused shard rewrites it to
one scale after landing (requantize: each part dequantized with its own, requantized with the max, vLLM's
requantize_with_max_scale) and keeps the max of the input scales; `--quantize fp8` quantizes a BF16 checkpoint's
linear weights on each rank to one scale per rank-local matrix (per expert for experts).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .. import kernels
from ..dtypes import torch_dtype
from ..transfer import host_memory
from . import ct_config
from .format import refuse_kind
from .scaled import SCALED_OPS, ScaledFormat, matrices, scalar_layouts


def fp8_method(qc: dict, block: bool) -> bool:
    """quant_method fp8 (the format of DeepSeek's and Hugging Face's FP8 checkpoints), with or without a block."""
    return qc.get("quant_method") == "fp8" and (qc.get("weight_block_size") is not None) == block


def static_activations(qc: dict, where: str) -> bool:
    """Whether an FP8 quantization_config quantizes activations statically (an X.input_scale per linear); its
    fmt checked (quant_method fp8 may say e5m2)."""
    if qc.get("quant_method") == ct_config.METHOD:
        return ct_config.static_input(qc)
    if qc.get("fmt", "e4m3") != "e4m3":
        raise refuse_kind(where, f"fmt {qc.get('fmt')!r} is not supported", "e4m3 FP8 checkpoints")
    return qc.get("activation_scheme", "dynamic") == "static"


def _requantize(step, finals, weight, scales):
    w = matrices(weight)
    s = scales.reshape(w.shape[0], -1).float()
    rows, parts = [r for r, _ in step.runs], [p for _, p in step.runs]
    one = torch.empty(w.shape[0], dtype=torch.float32, device=weight.device)
    for e in range(w.shape[0]):
        _, one[e] = kernels.requantize_fp8_parts(w[e], rows, s[e, parts])  # rewrites w[e] in place
    return weight, one


def _quantize(step, finals, weight):
    if weight.dim() == 2:
        return kernels.quantize_fp8_per_tensor(weight)
    q = host_memory.empty(weight.shape, kernels.FP8_DTYPE, weight.device)
    scales = torch.empty(weight.shape[0], dtype=torch.float32, device=weight.device)
    for e in range(weight.shape[0]):  # one scale per expert: each is its own GEMM
        q[e], scales[e] = kernels.quantize_fp8_per_tensor(weight[e])
    return q, scales


def _dequantize(step, finals, weight, scales, *input_scales):
    dtype = torch_dtype(finals[0].dtype)
    w = matrices(weight)
    s = scales.reshape(w.shape[0], -1)
    out = host_memory.empty(w.shape, dtype, weight.device)
    for e in range(w.shape[0]):
        row = 0
        for rows, part in step.runs:  # each part with its own scale: no requantization error on the way
            out[e, row:row + rows] = kernels.dequantize_fp8_per_tensor(w[e, row:row + rows], s[e, part], dtype)
            row += rows
    return (out.reshape(weight.shape),)


@dataclass(frozen=True)
class Fp8Tensor(ScaledFormat):
    """Per-tensor FP8 (see the module docstring)."""
    name: ClassVar[str] = "fp8"
    declared_by: ClassVar[str] = "fp8 (quant_method fp8, or compressed-tensors 8-bit float strategy tensor)"
    per_part_scales: ClassVar[bool] = True
    dequantize_op: ClassVar[str] = "dequantize"
    quantize_op: ClassVar[str] = "quantize"
    OPS: ClassVar[dict] = {**SCALED_OPS, "requantize": _requantize, "quantize": _quantize, "dequantize": _dequantize}

    @staticmethod
    def declares(qc: dict) -> bool:
        return fp8_method(qc, block=False) or ct_config.declares(qc, "float", 8, "tensor")

    @classmethod
    def from_config(cls, qc: dict, where: str) -> "Fp8Tensor":
        return cls(where, static_input=static_activations(qc, where))

    def cut_scale(self, c, target, weight_specs, weight_lays, index: dict, group: int, relayout):
        return scalar_layouts(c, target, weight_specs, index)

    def final_as_cut(self, companions) -> bool:
        return False   # a fused param's per-part scales always fold to one

    @staticmethod
    def online_scale(w) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(local, global) shape of --quantize fp8's scale of weight spec w: one per rank-local matrix."""
        return ((len(w.experts),), (w.global_shape[0],)) if w.style == "expert" else ((), ())
