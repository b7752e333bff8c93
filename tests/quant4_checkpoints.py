"""Packed 4-bit checkpoints made from real tiny models by the reference quantizer (tests/quant4_reference.py),
in each format's on-disk layout: tensor names, dtypes and config.json quantization_config as the format's own
tools write them. Also what a rank should hold, computed without distload: the dequantized reference model,
and, per packed tensor, the logical axis and unit of its rows and columns (from the formats' definitions)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import torch

import quant4_reference as ref

LINEAR = re.compile(r"model\.layers\.\d+\.(self_attn|mlp)\.\w+_proj\.weight$")   # on disk, a quantized linear
GROUP = 16

# format -> suffix -> ((rows axis, values per row), (cols axis, values per col)); "one": no such axis
ORIENT = {
    "gptq": {"qweight": (("in", 8), ("out", 1)), "qzeros": (("in", GROUP), ("out", 8)),
             "scales": (("in", GROUP), ("out", 1)), "g_idx": (("in", 1), ("one", 1))},
    "awq": {"qweight": (("in", 1), ("out", 8)), "qzeros": (("in", GROUP), ("out", 8)),
            "scales": (("in", GROUP), ("out", 1))},
    "ct": {"weight_packed": (("out", 1), ("in", 8)), "weight_scale": (("out", 1), ("in", GROUP)),
           "weight_zero_point": (("out", 8), ("in", GROUP)), "weight_shape": None},
    "nvfp4": {"weight": (("out", 1), ("in", 2)), "weight_scale": (("out", 1), ("in", 16)),
              "weight_scale_2": None, "input_scale": None},
}
ORIENT["gptq-act"] = ORIENT["gptq"]
ORIENT["ct-asym"] = ORIENT["ct"]


def _quantize(fmt: str, w: np.ndarray, name: str) -> dict[str, torch.Tensor]:
    if fmt.startswith("gptq"):
        q = ref.gptq_quantize(w, GROUP, act_order_seed=sum(map(ord, name.rsplit(".", 3)[0])) if fmt == "gptq-act" else None)
        return {"qweight": q["qweight"], "qzeros": q["qzeros"], "scales": q["scales"], "g_idx": q["g_idx"]}
    if fmt == "awq":
        return ref.awq_quantize(w, GROUP)
    if fmt.startswith("ct"):
        q = ref.compressed_quantize(w, GROUP, symmetric=fmt == "ct")
        return {**q, "weight_scale": torch.from_numpy(q["weight_scale"]).to(torch.bfloat16)}
    q = ref.nvfp4_quantize(w)
    seed = sum(map(ord, name)) % 97
    return {"weight": q["weight"], "weight_scale": torch.from_numpy(q["weight_scale"]).to(torch.float8_e4m3fn),
            "weight_scale_2": np.float32(q["weight_scale_2"]).reshape(()),
            "input_scale": np.float32(0.01 + 0.001 * seed).reshape(())}


def quantization_config(fmt: str) -> dict:
    if fmt.startswith("gptq"):
        return {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": fmt == "gptq-act", "sym": True,
                "checkpoint_format": "gptq", "damp_percent": 0.01}
    if fmt == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm"}
    if fmt.startswith("ct"):
        weights = {"num_bits": 4, "type": "int", "symmetric": fmt == "ct", "strategy": "group", "group_size": GROUP,
                   "dynamic": False}
        return {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
                "quantization_status": "compressed",
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None}}}
    return {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["lm_head"]}


def packed_checkpoint(src: Path, out: Path, fmt: str) -> Path:
    """Copy checkpoint `src` to `out` with every linear weight quantized to `fmt`, in the same files."""
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    for f in sorted(src.glob("*.safetensors")):
        tensors = {}
        for n, w in sorted(load_file(f).items()):
            if not LINEAR.match(n):
                tensors[n] = w
                continue
            del index["weight_map"][n]
            for suffix, t in _quantize(fmt, w.double().numpy(), n).items():
                tensors[n[: -len("weight")] + suffix] = torch.as_tensor(t).contiguous()
        for n in tensors:
            index["weight_map"][n] = f.name
        save_file(tensors, str(out / f.name), metadata={"format": "pt"})
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization_config(fmt)
    (out / "config.json").write_text(json.dumps(config))
    return out


def _np(t: torch.Tensor) -> np.ndarray:
    return t.float().numpy() if t.dtype in (torch.bfloat16, torch.float8_e4m3fn) else t.numpy()


def dequantized(packed: dict[str, torch.Tensor], fmt: str) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors with each quantized linear's packed ones replaced by its reference
    dequantization X.weight (fp32, exact)."""
    out = {n: t for n, t in packed.items() if not any(n.endswith("." + s) for s in ORIENT[fmt])
           or not LINEAR.match(n.rsplit(".", 1)[0] + ".weight")}
    bases = {n.rsplit(".", 1)[0] for n in packed if n.endswith("." + next(iter(ORIENT[fmt])))
             and LINEAR.match(n.rsplit(".", 1)[0] + ".weight")}
    for base in bases:
        t = {s: _np(packed[f"{base}.{s}"]) for s in ORIENT[fmt] if f"{base}.{s}" in packed}
        if fmt.startswith("gptq"):
            w = ref.gptq_dequantize(t)
        elif fmt == "awq":
            w = ref.awq_dequantize(t)
        elif fmt.startswith("ct"):
            w = ref.compressed_dequantize(t)
        else:
            w = ref.nvfp4_dequantize(t)
        out[base + ".weight"] = torch.from_numpy(w.astype(np.float32))
    return out


def logical_grid(t: torch.Tensor, orient, out_f: int, in_f: int) -> torch.Tensor:
    """A packed tensor spread over its logical weight [out, in]: element [o, i] is the packed element
    that covers logical (o, i), so slicing it like the weight and sampling back gives the packed slice."""
    (ra, ru), (ca, cu) = orient
    t2 = t.reshape(t.shape[0], -1)
    grid = t2.repeat_interleave(ru, 0).repeat_interleave(cu, 1) if ca != "one" else t2.repeat_interleave(ru, 0)
    if ra == "in":
        grid = grid.t()
    if ca == "one":
        grid = grid.expand(out_f, -1) if ra == "in" else grid
    return grid[:out_f, :in_f]


def sample_back(grid: torch.Tensor, orient) -> torch.Tensor:
    """logical_grid's inverse on a slice: one element per packed element."""
    (ra, ru), (ca, cu) = orient
    if ca == "one":
        return grid[0, ::ru].contiguous()
    if ra == "in":
        grid = grid.t()
    return grid[::ru, ::cu].contiguous()


def logical_shape(ckpt: dict, base: str, fmt: str) -> tuple[int, int]:
    """A quantized linear's [out, in] from its first packed tensor (base: 'model.layers.0.mlp.up_proj.')."""
    suffix, ((ra, ru), (ca, cu)) = next(iter(ORIENT[fmt].items()))
    rows, cols = ckpt[base + suffix].shape
    sizes = {ra: rows * ru, ca: cols * cu}
    return sizes["out"], sizes["in"]
