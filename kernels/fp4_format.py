"""The 4-bit lookup-table formats: every value is table[4-bit code] * the fp32 scale of its block.

    NVFP4 (NVIDIA ModelOpt, vLLM modelopt.py): weight uint8 [out, in/2], two e2m1 codes per byte, the
        even element in the low nibble; weight_scale float8_e4m3fn [out, in/16]; weight_scale_2 fp32, one
        per tensor. w = e2m1 * (float(weight_scale) * weight_scale_2), the block scale product rounded once.
    MXFP4 (OCP microscaling, as GPT-OSS ships its experts; gpt_oss/torch/weights.py, vLLM mxfp4.py):
        *_blocks uint8 [..., n/32, 16], two e2m1 codes per byte low nibble first; *_scales uint8 E8M0
        [..., n/32]: the block scale is 2 ** (scale - 127).
    bitsandbytes NF4 / FP4 (bitsandbytes functional.quantize_4bit): the flat row-major weight packed two
        codes per byte, the FIRST element in the HIGH nibble; absmax fp32 per 64-value block; quant_map the
        16 table values (stored in the checkpoint). With nested (double) quantization absmax is stored as
        uint8 codes of a 256-entry dynamic map (nested_quant_map) times nested_absmax per 256 blocks, plus
        nested_offset: absmax = nested_quant_map[code] * nested_absmax[b // 256] + offset.

E2M1 (OCP MX spec): sign bit 3, then 2 exponent bits and 1 mantissa bit: 0, 0.5, 1, 1.5, 2, 3, 4, 6.
"""

import torch

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
NVFP4_BLOCK = 16
MXFP4_BLOCK = 32
BNB_BLOCK = 64
BNB_NESTED_BLOCK = 256
E8M0_BIAS = 127
# bitsandbytes' NF4 table (functional.get_4bit_type("nf4")): the quantiles of N(0, 1), scaled to [-1, 1]
NF4_VALUES = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
    0.7229568362236023, 1.0,
)


def e2m1_table(device=None) -> torch.Tensor:
    return torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)


def e8m0_to_float32(scales: torch.Tensor) -> torch.Tensor:
    """uint8 E8M0 -> fp32 2 ** (s - 127), exact (s = 0 is the subnormal 2**-127; 255 is NaN by the spec)."""
    s = scales.to(torch.int32)
    normal = (s << 23).view(torch.float32)
    smallest = torch.full_like(normal, 2.0 ** -127)
    nan = torch.full_like(normal, float("nan"))
    return torch.where(s == 0, smallest, torch.where(s == 255, nan, normal))
