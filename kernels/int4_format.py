"""The 4-bit integer layouts distload dequantizes, as one descriptor each (GPTQ, AWQ, compressed-tensors).

Every layout stores 8 unsigned 4-bit codes per int32 word, code k of a word in bits [4k, 4k + 4), and
dequantizes w[o, i] = float(q[o, i] - z[g, o]) * scale[g, o] with g the input group of column i; the
layouts differ only in which dim is packed, the nibble order and how zeros are stored:

    GPTQ (AutoGPTQ v1, as vLLM's gptq.py loads it): qweight [in/8, out] packed along input,
        qzeros [in/g, out/8] packed along output, scales [in/g, out], g_idx [in] (input column -> group;
        with desc_act a permutation of i // g). Stored zeros are z - 1 (v1): the kernel adds 1 back.
    AWQ (AutoAWQ GEMM, vLLM awq.py / awq_triton.py): qweight [in, out/8] packed along output with the
        nibble order [0, 2, 4, 6, 1, 3, 5, 7] (nibble k holds column order[k]), qzeros [in/g, out/8]
        the same way, scales [in/g, out]; zeros as stored, no g_idx.
    compressed-tensors pack-quantized (compressed_tensors pack_to_int32, vLLM compressed_tensors_wNa16):
        weight_packed [out, in/8] packed along input of value + 8 (offset encoding), weight_scale
        [out, in/g], weight_zero_point (asymmetric only) [out/8, in/g] packed along output with the same
        offset; symmetric weights have z = 8.

The product float(q - z) * scale is exact in fp32 (a 5-bit integer times a <= 24-bit scale), so the one
rounding is the final cast, identical in the reference and the Triton kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

PACK = 8          # 4-bit codes per int32 word
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ: nibble k holds column 8 * word + AWQ_ORDER[k]
CT_OFFSET = 8     # compressed-tensors stores signed int4 v as v + 8


@dataclass(frozen=True)
class Int4Layout:
    """Where the code, group, scale and zero of output element [o, i] live (strides in elements)."""
    pack_input: bool                 # codes packed along input (GPTQ, CT) or output (AWQ)
    q_stride_in: int                 # word stride per packed-input step
    q_stride_out: int
    scale_stride_group: int
    scale_stride_out: int
    zero_stride_group: int = 0
    zero_stride_out: int = 0        # per word of 8 output columns
    has_zero: bool = False
    zero_bias: int = 0               # added to a stored zero (GPTQ v1: 1)
    zero_const: int = 0              # the zero when none is stored (CT symmetric: 8)
    awq_order: bool = False


def awq_nibble(col_in_word):
    """Nibble position of column c (0..7) of an AWQ word: the inverse of AWQ_ORDER (works on ints and tensors)."""
    return (col_in_word % 2) * 4 + col_in_word // 2


def gptq_layout(out_features: int, groups: int) -> Int4Layout:
    return Int4Layout(True, out_features, 1, out_features, 1, out_features // PACK, 1, True, 1, 0)


def awq_layout(out_features: int, groups: int) -> Int4Layout:
    return Int4Layout(False, out_features // PACK, 1, out_features, 1, out_features // PACK, 1, True, 0, 0, True)


def compressed_layout(in_features: int, groups: int, has_zero: bool) -> Int4Layout:
    return Int4Layout(True, 1, in_features // PACK, 1, groups, 1, groups, has_zero, 0, CT_OFFSET)


def check_shape(name: str, what: str, got, expected: tuple[int, ...]) -> None:
    if tuple(got) != tuple(expected):
        raise ValueError(f"{name}: {what} should have shape {tuple(expected)}, got {tuple(got)}")
