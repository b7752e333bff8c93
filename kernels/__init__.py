"""distload's post-load kernels (DESIGN §2 steps 6-7): Triton on CUDA, a plain-torch `*_reference` twin each.

Every public function dispatches: Triton when the tensor is on CUDA (or DISTLOAD_FORCE_TRITON=1, used
with TRITON_INTERPRET=1 by the tests), else the reference. Both give bit-equal results. Triton is
imported only on the first Triton call; HAVE_TRITON says whether it is installed. Every entry point
runs under torch.no_grad(): they rewrite or read loaded params, never part of a graph.
"""

from .backend import HAVE_TRITON, use_triton
from .fingerprint import fingerprint, fingerprint_reference, fingerprints
from .fp8 import (
    dequantize_fp8_per_tensor,
    dequantize_fp8_per_tensor_reference,
    quantize_fp8_per_tensor,
    quantize_fp8_per_tensor_reference,
    requantize_fp8_parts,
    requantize_fp8_parts_reference,
)
from .fp8_block import (
    dequantize_fp8_block,
    dequantize_fp8_block_reference,
    quantize_fp8_block,
    quantize_fp8_block_reference,
)
from .fp4 import (
    dequantize_bnb_4bit,
    dequantize_bnb_4bit_reference,
    dequantize_mxfp4,
    dequantize_mxfp4_reference,
    dequantize_nvfp4,
    dequantize_nvfp4_reference,
    undo_bnb_nested_absmax,
)
from .fp8_format import DEFAULT_BLOCK, FP8_DTYPE, FP8_MAX, block_scale_shape
from .int4 import (
    dequantize_awq,
    dequantize_awq_reference,
    dequantize_compressed_int4,
    dequantize_compressed_int4_reference,
    dequantize_gptq,
    dequantize_gptq_reference,
)

__all__ = [
    "DEFAULT_BLOCK",
    "FP8_DTYPE",
    "FP8_MAX",
    "HAVE_TRITON",
    "block_scale_shape",
    "dequantize_bnb_4bit",
    "dequantize_bnb_4bit_reference",
    "dequantize_mxfp4",
    "dequantize_mxfp4_reference",
    "dequantize_nvfp4",
    "dequantize_nvfp4_reference",
    "undo_bnb_nested_absmax",
    "dequantize_awq",
    "dequantize_awq_reference",
    "dequantize_compressed_int4",
    "dequantize_compressed_int4_reference",
    "dequantize_gptq",
    "dequantize_gptq_reference",
    "dequantize_fp8_block",
    "dequantize_fp8_block_reference",
    "dequantize_fp8_per_tensor",
    "dequantize_fp8_per_tensor_reference",
    "fingerprint",
    "fingerprints",
    "fingerprint_reference",
    "quantize_fp8_block",
    "quantize_fp8_block_reference",
    "quantize_fp8_per_tensor",
    "quantize_fp8_per_tensor_reference",
    "requantize_fp8_parts",
    "requantize_fp8_parts_reference",
    "use_triton",
]
