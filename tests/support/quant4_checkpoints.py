"""Packed 4-bit checkpoints made from real tiny models by the reference quantizer (tests/quant4_reference.py),
in each format's on-disk layout: tensor names, dtypes and config.json quantization_config as the format's own
tools write them. Also what a rank should hold, computed without distload: the dequantized reference model,
and, per packed tensor, the logical axis and unit of its rows and columns (from the formats' definitions)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import quant4_reference as ref
import torch

LINEAR = re.compile(r"model\.layers\.\d+\.(self_attn|mlp)\.(experts\.\d+\.)?\w+_proj\.weight$")  # quantized, on disk
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
ORIENT["bnb"] = {"weight": (("out", 1), ("in", 2)), "weight.absmax": (("out", 1), ("in", 64)),
                 "weight.quant_map": None, "weight.nested_absmax": None, "weight.nested_quant_map": None,
                 "weight.quant_state.bitsandbytes__nf4": None}
ORIENT["bnb-nested"] = ORIENT["bnb"]
FLAT = ("weight", "weight.absmax")      # bitsandbytes stores these flat
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
    if fmt.startswith("bnb"):
        q = ref.bnb_quantize(w, nested=fmt == "bnb-nested")
        state = {"quant_type": "nf4", "blocksize": 64, "dtype": "bfloat16", "shape": list(w.shape)}
        out = {"weight": q["weight"], "weight.absmax": q["absmax"], "weight.quant_map": q["quant_map"]}
        if "offset" in q:
            state.update(nested_blocksize=256, nested_dtype="float32", nested_offset=float(q["offset"]))
            out.update({"weight.nested_absmax": q["nested_absmax"], "weight.nested_quant_map": q["nested_quant_map"]})
        out["weight.quant_state.bitsandbytes__nf4"] = np.frombuffer(json.dumps(state).encode(), dtype=np.uint8).copy()
        return out
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
    if fmt.startswith("bnb"):
        return {"quant_method": "bitsandbytes", "load_in_4bit": True, "load_in_8bit": False,
                "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": fmt == "bnb-nested",
                "bnb_4bit_compute_dtype": "bfloat16", "bnb_4bit_quant_storage": "uint8",
                "llm_int8_skip_modules": None}
    return {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["lm_head"]}


def rewritten_checkpoint(src: Path, out: Path, pattern: re.Pattern, replace, quantization: dict) -> Path:
    """Copy checkpoint `src` to `out`, each tensor whose name matches `pattern` replaced by the tensors
    replace(name, tensor) returns (in the same file), and quantization_config set in config.json."""
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    for f in sorted(src.glob("*.safetensors")):
        tensors = {}
        for n, w in sorted(load_file(f).items()):
            if not pattern.match(n):
                tensors[n] = w
                continue
            del index["weight_map"][n]
            tensors.update(replace(n, w))
        for n in tensors:
            index["weight_map"][n] = f.name
        save_file(tensors, str(out / f.name), metadata={"format": "pt"})
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization
    (out / "config.json").write_text(json.dumps(config))
    return out


def packed_checkpoint(src: Path, out: Path, fmt: str) -> Path:
    """Copy checkpoint `src` to `out` with every linear weight quantized to `fmt`, in the same files."""
    def quantized(n, w):
        return {n[: -len("weight")] + suffix: torch.as_tensor(t).contiguous()
                for suffix, t in _quantize(fmt, w.double().numpy(), n).items()}

    return rewritten_checkpoint(src, out, LINEAR, quantized, quantization_config(fmt))


def _np(t: torch.Tensor) -> np.ndarray:
    return t.float().numpy() if t.dtype in (torch.bfloat16, torch.float8_e4m3fn) else t.numpy()


def packed_base(name: str, fmt: str) -> tuple[str, str] | None:
    """(base 'model.layers.0.mlp.up_proj.', suffix) of a packed tensor of a quantized linear, else None."""
    for suffix in sorted(ORIENT[fmt], key=len, reverse=True):
        if name.endswith("." + suffix) and LINEAR.match(name[: -len(suffix)] + "weight"):
            return name[: -len(suffix)], suffix
    return None


def dequantized(packed: dict[str, torch.Tensor], fmt: str) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors with each quantized linear's packed ones replaced by its reference
    dequantization X.weight (fp32, exact)."""
    out = {n: t for n, t in packed.items() if packed_base(n, fmt) is None}
    bases = {packed_base(n, fmt)[0] for n in packed if packed_base(n, fmt) is not None}
    for base in bases:
        t = {s: _np(packed[base + s]) for s in ORIENT[fmt] if base + s in packed}
        if fmt.startswith("gptq"):
            w = ref.gptq_dequantize(t)
        elif fmt == "awq":
            w = ref.awq_dequantize(t)
        elif fmt.startswith("ct"):
            w = ref.compressed_dequantize(t)
        elif fmt.startswith("bnb"):
            w = ref.bnb_dequantize(_bnb_tensors(t))
        else:
            w = ref.nvfp4_dequantize(t)
        out[base + "weight"] = torch.from_numpy(w.astype(np.float32))
    return out


def _bnb_tensors(t: dict) -> dict:
    state = json.loads(bytes(t["weight.quant_state.bitsandbytes__nf4"].tolist()).decode())
    out = {"weight": t["weight"], "absmax": t["weight.absmax"], "quant_map": t["weight.quant_map"],
           "shape": tuple(state["shape"])}
    if "nested_offset" in state:
        out.update(nested_absmax=t["weight.nested_absmax"], nested_quant_map=t["weight.nested_quant_map"],
                   offset=np.float32(state["nested_offset"]))
    return out


def logical_grid(t: torch.Tensor, orient, out_f: int, in_f: int, flat: bool = False) -> torch.Tensor:
    """A packed tensor spread over its logical weight [out, in]: element [o, i] is the packed element
    that covers logical (o, i), so slicing it like the weight and sampling back gives the packed slice."""
    (ra, ru), (ca, cu) = orient
    t2 = t.reshape(out_f, -1) if flat else t.reshape(t.shape[0], -1)   # flat: bitsandbytes' row-major bytes
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
    if fmt.startswith("bnb"):
        state = json.loads(bytes(ckpt[base + "weight.quant_state.bitsandbytes__nf4"].tolist()).decode())
        return tuple(state["shape"])
    suffix, ((ra, ru), (ca, cu)) = next(iter(ORIENT[fmt].items()))
    rows, cols = ckpt[base + suffix].shape
    sizes = {ra: rows * ru, ca: cols * cu}
    return sizes["out"], sizes["in"]


# GPT-OSS MXFP4, as the released checkpoints store the experts: per stacked expert tensor X (HF's [E, in, out])
# X_blocks uint8 [E, out, in/32, 16] and X_scales uint8 E8M0 [E, out, in/32], rows in X's out order (gate/up
# interleaved); everything else BF16 as in the source checkpoint.
MXFP4_EXPERTS = re.compile(r"model\.layers\.\d+\.mlp\.experts\.(gate_up_proj|down_proj)$")
MXFP4_CONFIG = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}


def mxfp4_checkpoint(src: Path, out: Path) -> Path:
    """Copy GPT-OSS checkpoint `src` to `out` with its stacked experts quantized to MXFP4 by the reference."""
    def quantized(n, w):
        per_expert = [ref.mxfp4_quantize(w[e].double().numpy().T) for e in range(w.shape[0])]
        return {n + suffix: torch.from_numpy(np.stack([q[key] for q in per_expert])).contiguous()
                for suffix, key in (("_blocks", "blocks"), ("_scales", "scales"))}

    return rewritten_checkpoint(src, out, MXFP4_EXPERTS, quantized, MXFP4_CONFIG)


def mxfp4_dequantized(packed: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The checkpoint in transformers' layout, each X_blocks / X_scales pair replaced by the reference
    dequantization X [E, in, out] (fp32, exact)."""
    out = {}
    for n, t in packed.items():
        if n.endswith("_scales"):
            continue
        if not n.endswith("_blocks"):
            out[n] = t
            continue
        base = n[: -len("_blocks")]
        full = [ref.mxfp4_dequantize({"blocks": b.numpy(), "scales": s.numpy()}).T
                for b, s in zip(t, packed[base + "_scales"])]
        out[base] = torch.from_numpy(np.stack(full).astype(np.float32))
    return out


def write_plain(tensors: dict[str, torch.Tensor], config: dict, out: Path, dtype=torch.float32) -> Path:
    """A plain (unquantized) checkpoint of `tensors` in `dtype` for transformers: the reference of verify."""
    from safetensors.torch import save_file

    out.mkdir(parents=True)
    save_file({n: t.to(dtype).contiguous() for n, t in tensors.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    config = {k: v for k, v in config.items() if k != "quantization_config"}
    (out / "config.json").write_text(json.dumps(config))
    return out


def save_sharded_at_tp2(path: str, out: str) -> None:
    import distload

    distload.load(path, tp=2, progress=False, save_sharded=out)


def reload_differences(path: str, out: str, tp: int) -> list[str]:
    import distload

    direct = distload.load(path, tp=tp, progress=False).params
    again = distload.load(out, tp=tp, progress=False, reshard=tp != 2).params
    return [n for n in set(direct) | set(again) if n not in direct or n not in again
            or direct[n].dtype != again[n].dtype or not torch.equal(direct[n], again[n])]
