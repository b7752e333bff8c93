"""Quantized checkpoints and online quantization: every format distload knows, in one wing.

    fp8.py              FP8 schemes from config.json (per-tensor, block; compressed-tensors) and their scale companions
    fp8_layouts.py      the companions' cuts, derived from their weights'
    fp8_steps.py        final specs and post-load steps (requantize, quantize, dequantize)
    packed4.py          packed 4-bit checkpoints planned on their logical weights
    packed4_formats.py  the packed formats as data (GPTQ, AWQ, compressed-tensors int4, NVFP4, bitsandbytes, MXFP4)
    packed4_layouts.py  the packed tensors' cuts, derived from their logical weight's
    packed4_steps.py    the packed formats' final specs and --dequantize steps
    mxfp4.py            GPT-OSS MXFP4 experts, cut and padded as vLLM does
    ops_4bit.py         the 4-bit post-load op (bit math in kernels/)
"""
