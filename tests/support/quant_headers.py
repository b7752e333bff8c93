"""A one-layer tiny Llama's checkpoint as planning sees it (header entries only, no bytes), in a quantization
format's on-disk names, dtypes and shapes: for pure tests of what a format checks while planning."""

from __future__ import annotations

import math

from distload.checkpoint.header import TensorEntry
from distload.dtypes import itemsize

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_hidden_layers": 1,
          "vocab_size": 250, "rms_norm_eps": 1e-6, "tie_word_embeddings": False}
LINEARS = {"self_attn.q_proj": (64, 64), "self_attn.k_proj": (32, 64), "self_attn.v_proj": (32, 64),
           "self_attn.o_proj": (64, 64), "mlp.gate_proj": (128, 64), "mlp.up_proj": (128, 64),
           "mlp.down_proj": (64, 128)}
GROUP = 16
QUANTIZATION = {
    "gptq-act": {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": True, "sym": True},
    "nvfp4": {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16},
    "bnb": {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"},
    "fp8": {"quant_method": "fp8", "activation_scheme": "static"},
}


def _packed(fmt: str, out_f: int, in_f: int) -> dict[str, tuple[str, tuple[int, ...]]]:
    """suffix -> (dtype, shape) of one quantized linear [out_f, in_f]."""
    if fmt == "gptq-act":
        return {"qweight": ("I32", (in_f // 8, out_f)), "qzeros": ("I32", (in_f // GROUP, out_f // 8)),
                "scales": ("F16", (in_f // GROUP, out_f)), "g_idx": ("I32", (in_f,))}
    if fmt == "nvfp4":
        return {"weight": ("U8", (out_f, in_f // 2)), "weight_scale": ("F8_E4M3", (out_f, in_f // 16)),
                "weight_scale_2": ("F32", ()), "input_scale": ("F32", ())}
    if fmt == "bnb":
        return {"weight": ("U8", (out_f * in_f // 2, 1)), "weight.absmax": ("F32", (out_f * in_f // 64,)),
                "weight.quant_map": ("F32", (16,)), "weight.quant_state.bitsandbytes__nf4": ("U8", (96,))}
    return {"weight": ("F8_E4M3", (out_f, in_f)), "weight_scale": ("F32", ()), "input_scale": ("F32", ())}


def headers(fmt: str) -> dict[str, TensorEntry]:
    """name -> entry of the checkpoint (one file; offsets are not read by planning)."""
    shapes = {"model.embed_tokens.weight": ("BF16", (250, 64)), "lm_head.weight": ("BF16", (250, 64)),
              "model.norm.weight": ("BF16", (64,)), "model.layers.0.input_layernorm.weight": ("BF16", (64,)),
              "model.layers.0.post_attention_layernorm.weight": ("BF16", (64,))}
    for linear, (out_f, in_f) in LINEARS.items():
        for suffix, spec in _packed(fmt, out_f, in_f).items():
            shapes[f"model.layers.0.{linear}.{suffix}"] = spec
    out, offset = {}, 0
    for name, (dtype, shape) in shapes.items():
        nbytes = math.prod(shape) * itemsize(dtype)
        out[name] = TensorEntry(name, "model.safetensors", dtype, shape, offset, nbytes)
        offset += nbytes
    return out


def config(fmt: str, **quantization) -> dict:
    return {**CONFIG, "quantization_config": {**QUANTIZATION[fmt], **quantization}}
