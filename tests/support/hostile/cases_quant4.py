"""Cases: 4-bit and FP8 checkpoints whose companions lie by value, not by shape (a GPTQ g_idx out of its groups,
an NVFP4 global scale that is not one number, fused parts with their own global scales, a missing bnb absmax, a
group size that does not divide the input, one BF16 weight in an FP8 checkpoint). Each starts from the tiny
Hugging Face Llama (hidden 64, intermediate 128, 4 heads, 2 kv heads, 2 layers), quantized in the case's build
by the tests' reference quantizer (tests/support/quant4_checkpoints.py, fp8_checkpoints.py)."""

from __future__ import annotations

import json
import shutil

import torch

from .case import Case
from .st_files import edit_config, file_of, replace_tensor

BASE = "llama"
L0 = "model.layers.0."
DOWN, O_PROJ, GATE, UP, K = (L0 + "mlp.down_proj.", L0 + "self_attn.o_proj.", L0 + "mlp.gate_proj.",
                             L0 + "mlp.up_proj.", L0 + "self_attn.k_proj.")


def _quantized(ckpt, fmt: str, skew: bool = False):
    """Replace the case's copy of the base by its `fmt` quantization, in place (skew: up_proj a quarter of
    gate_proj and k_proj 4x q_proj before quantizing, so that fused parts have far apart global scales)."""
    import fp8_checkpoints
    import quant4_checkpoints

    plain = ckpt.with_name("plain")
    ckpt.rename(plain)
    if skew:
        fp8_checkpoints.skew_parts(plain)
    if fmt == "fp8":
        fp8_checkpoints.quantized_checkpoint(plain, ckpt, "tensor")
    else:
        quant4_checkpoints.packed_checkpoint(plain, ckpt, fmt)
    shutil.rmtree(plain)


def _tensor(ckpt, name):
    from safetensors import safe_open

    with safe_open(str(file_of(ckpt, name)), "pt") as f:
        return f.get_tensor(name)


def _drop(ckpt, name):
    from safetensors.torch import load_file, save_file

    path = file_of(ckpt, name)
    tensors = load_file(path)
    del tensors[name]
    save_file(tensors, str(path), metadata={"format": "pt"})
    idx_path = ckpt / "model.safetensors.index.json"
    idx = json.loads(idx_path.read_text())
    del idx["weight_map"][name]
    idx_path.write_text(json.dumps(idx))


def _case(fmt, edit, *extra, dequantize=False, skew=False):
    """build: quantize to `fmt`, then edit(ckpt) the copy; load it (with --dequantize when asked)."""
    def build(ckpt, ws):
        _quantized(ckpt, fmt, skew)
        edit(ckpt)
        return [str(ckpt), *(["--dequantize"] if dequantize else []), *extra]
    return build


def _set(name, fn):
    """The tensor `name` replaced by fn(its current value)."""
    return lambda ckpt: replace_tensor(ckpt, name, fn(_tensor(ckpt, name).clone()))


def _at(index, value):
    def fn(t):
        t.view(-1)[index] = value
        return t
    return fn


def _gptq_group(size):
    def edit(ckpt):
        config = json.loads((ckpt / "config.json").read_text())
        edit_config(ckpt, quantization_config={**config["quantization_config"], "group_size": size})
    return edit


def _nothing(ckpt):
    return None


def _kv_heads_string(ckpt, ws):
    edit_config(ckpt, num_key_value_heads="2")
    return [str(ckpt)]


GIDX = DOWN + "g_idx"
UP_GIDX = UP + "g_idx"   # a part of the fused gate_up_proj: its own g_idx, over hidden 64 = 4 groups of 16
SCALE_2 = DOWN + "weight_scale_2"

CASES = [
    Case("gptq-g-idx-negative-dequantize", _case("gptq-act", _set(GIDX, _at(5, -1)), dequantize=True), base=BASE,
         names=(GIDX, "-1", "0..7")),
    Case("gptq-g-idx-negative", _case("gptq-act", _set(GIDX, _at(5, -1))), base=BASE, names=(GIDX, "-1", "0..7")),
    Case("gptq-g-idx-past-last-dequantize", _case("gptq-act", _set(GIDX, _at(70, 8)), dequantize=True), base=BASE,
         names=(GIDX, "8", "0..7")),
    Case("gptq-g-idx-past-last", _case("gptq-act", _set(GIDX, _at(3, 9))), base=BASE,
         names=(GIDX, "9", "0..7")),
    Case("gptq-g-idx-up-past-last", _case("gptq-act", _set(UP_GIDX, _at(9, 4))), base=BASE,
         names=(UP_GIDX, "4", "0..3")),
    Case("gptq-g-idx-up-past-last-dequantize", _case("gptq-act", _set(UP_GIDX, _at(40, 4)), dequantize=True),
         base=BASE, names=(UP_GIDX, "4", "0..3")),
    Case("gptq-g-idx-up-negative", _case("gptq-act", _set(UP_GIDX, _at(63, -2))), base=BASE,
         names=(UP_GIDX, "-2", "0..3")),
    Case("gptq-g-idx-up-negative-dequantize", _case("gptq-act", _set(UP_GIDX, _at(0, -1)), dequantize=True),
         base=BASE, names=(UP_GIDX, "-1", "0..3")),
    Case("gptq-g-idx-o-proj-tp1", _case("gptq-act", _set(O_PROJ + "g_idx", _at(0, 1000)), "--tp", "1"),
         base=BASE, names=(O_PROJ + "g_idx", "1000", "0..3")),
    Case("gptq-group-size-48", _case("gptq", _gptq_group(48)), base=BASE, names=("group_size", "48", "64")),
    Case("gptq-ok-act-order-dequantize", _case("gptq-act", _nothing, dequantize=True), base=BASE, expect="ok"),
    Case("nvfp4-scale-2-vector", _case("nvfp4", _set(SCALE_2, lambda t: t.reshape(1).repeat(4))), base=BASE,
         names=(SCALE_2, "[4]")),
    Case("nvfp4-scale-2-vector-dequantize", _case("nvfp4", _set(SCALE_2, lambda t: t.reshape(1).repeat(4)),
                                                  dequantize=True), base=BASE, names=(SCALE_2, "[4]")),
    Case("nvfp4-scale-2-bf16", _case("nvfp4", _set(SCALE_2, lambda t: t.to(torch.bfloat16))), base=BASE,
         names=(SCALE_2, "BF16", "F32")),
    Case("nvfp4-scale-2-vector-1", _case("nvfp4", _set(SCALE_2, lambda t: t.reshape(1))), base=BASE, expect="ok"),
    # loads only (a case compares no values): tests/ranks/test_quant4.py's nvfp4-skewed load compares these parts'
    # values, their global scales 4x apart, packed and dequantized, with the reference's
    Case("nvfp4-gate-up-own-scales-dequantize", _case("nvfp4", _nothing, dequantize=True, skew=True), base=BASE,
         expect="ok"),
    Case("nvfp4-gate-up-own-scales", _case("nvfp4", _nothing, skew=True), base=BASE, expect="ok"),
    Case("nvfp4-input-scale-vector", _case("nvfp4", _set(UP + "input_scale", lambda t: t.reshape(1).repeat(2))),
         base=BASE, names=(UP + "input_scale", "[2]")),
    Case("bnb-absmax-missing", _case("bnb", lambda c: _drop(c, UP + "weight.absmax"), "--tp", "1"), base=BASE,
         names=(UP + "weight.absmax",)),
    Case("bnb-absmax-missing-down", _case("bnb", lambda c: _drop(c, DOWN + "weight.absmax"), "--tp", "1"), base=BASE,
         names=(DOWN + "weight.absmax",)),
    Case("fp8-one-bf16-weight", _case("fp8", _set(K + "weight", lambda t: t.to(torch.bfloat16))), base=BASE,
         names=(K + "weight", "BF16")),
    Case("fp8-one-bf16-weight-down", _case("fp8", _set(DOWN + "weight", lambda t: t.to(torch.bfloat16))),
         base=BASE, names=(DOWN + "weight", "BF16")),

    # config.json's own types: a string where a size goes is named as such, not taken as absent
    Case("config-kv-heads-string", _kv_heads_string,
         names=("config.json", "num_key_value_heads", "'2'", '"num_key_value_heads": 2')),
]

EXTRA: list[Case] = []
