"""FP8 checkpoints made from real tiny models for the FP8 tests (test_quant.py, test_cuda.py): every linear
weight quantized with distload.kernels' reference kernels, per tensor or per block, in the `fp8` and the
`compressed-tensors` namings."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from distload.kernels import (
    quantize_fp8_block_reference,
    quantize_fp8_per_tensor_reference,
)

CKPT_LINEAR = re.compile(r"model\.layers\.\d+\.(.*_proj(?:_with_mqa)?|.*experts\.\d+\.w[123])\.weight$")  # on disk


def quantized_checkpoint(src: Path, out: Path, kind: str, *, block=(16, 16), ct: bool = False) -> Path:
    """Copy checkpoint `src` to `out` with every linear weight quantized (kind 'tensor' or 'block'); the
    same files as the original, each scale in its weight's file, index.json and config.json updated."""
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    for i, f in enumerate(sorted(src.glob("*.safetensors"))):
        tensors = {}
        for n, w in sorted(load_file(f).items()):
            if not CKPT_LINEAR.match(n):
                tensors[n] = w
                continue
            base = n[: -len("weight")]
            if kind == "tensor":
                q, scale = quantize_fp8_per_tensor_reference(w)
                tensors[base + "weight_scale"] = scale.reshape((1,) if ct else ())
                # a static activation scale, different for every weight (so "max of the parts" is visible)
                seed = sum(map(ord, n)) % 97
                tensors[base + "input_scale"] = torch.tensor(0.01 + 0.001 * seed).reshape((1,) if ct else ())
            else:
                q, scale = quantize_fp8_block_reference(w, block)
                tensors[base + ("weight_scale" if ct else "weight_scale_inv")] = scale
            tensors[n] = q
        for n in tensors:
            index["weight_map"][n] = f.name
        save_file(tensors, str(out / f.name), metadata={"format": "pt"})
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization_config(kind, block, ct)
    (out / "config.json").write_text(json.dumps(config))
    return out


def quantization_config(kind: str, block: tuple[int, int], ct: bool) -> dict:
    """config.json's quantization_config of a checkpoint quantized per `kind` ('tensor' or 'block')."""
    if ct:
        weights = {"type": "float", "num_bits": 8, "symmetric": True, "dynamic": False,
                   "strategy": "tensor" if kind == "tensor" else "block",
                   "block_structure": None if kind == "tensor" else list(block)}
        acts = {"type": "float", "num_bits": 8, "strategy": "tensor", "dynamic": False} if kind == "tensor" else None
        return {"quant_method": "compressed-tensors", "format": "float-quantized",
                "ignore": ["lm_head"], "quantization_status": "compressed",
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts}}}
    if kind == "tensor":
        return {"quant_method": "fp8", "activation_scheme": "static"}
    return {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": list(block)}


def skew_parts(path: Path) -> Path:
    """Give the parts of fused params different magnitudes (k 4x q and v, up 1/4 of gate), as real models
    have: a fused param's scale must then be requantized, and a plain max of the scales would be far off."""
    from safetensors.torch import load_file, save_file

    for f in path.glob("*.safetensors"):
        tensors = load_file(f)
        for n in tensors:
            if n.endswith(("k_proj.weight", "up_proj.weight", ".w3.weight")):
                tensors[n] = tensors[n] * (4.0 if "k_proj" in n else 0.25)
        save_file(tensors, str(f), metadata={"format": "pt"})
    return path


BLOCK_DIMS = dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=256, q_lora_rank=256,
                  kv_lora_rank=128, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128)
