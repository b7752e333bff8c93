"""Per-channel FP8 and INT8 W8A8 checkpoints made from real tiny models by a quantizer of their own (plain torch,
not distload's kernels), stored as llm-compressor writes them (compressed-tensors, strategy channel, dynamic
per-token activations): X.weight fp8 e4m3 / int8 [out, in], X.weight_scale float32 [out, 1], lm_head and the MoE
router left in BF16. And what a rank should hold, computed without distload: each weight as the layout oracle cuts
it, each scale with its weight's rows (vLLM's ChannelQuantScaleParameter: a row-parallel layer's whole)."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from layout_oracle import serving_shards
from quant4_checkpoints import rewritten_checkpoint

LINEAR = re.compile(r"model\.layers\.\d+\.(self_attn|mlp)\.(experts\.\d+\.)?\w+_proj\.weight$")  # quantized, on disk
# kind -> (stored dtype, largest code, compressed-tensors type, format)
KINDS = {"fp8": (torch.float8_e4m3fn, 448.0, "float", "float-quantized"),
         "int8": (torch.int8, 127.0, "int", "int-quantized")}
ROW_PARALLEL = re.compile(r"(o_proj|down_proj)\.weight$|experts\.w2_weight$")   # serving names: inputs cut


def channel_quantize(w: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes [out, in], scale [out, 1] float32): per output row, scale = amax / largest code, codes = w / scale
    (fp8: saturated then cast, round to nearest even; int8: rounded, clamped to [-128, 127])."""
    dtype, top, _, _ = KINDS[kind]
    w = w.float()
    scale = w.abs().amax(dim=1, keepdim=True) / top
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    x = w / scale
    codes = x.clamp(-top, top).to(dtype) if kind == "fp8" else x.round().clamp(-128, 127).to(dtype)
    return codes, scale


def quantization_config(kind: str) -> dict:
    _, _, kind_type, fmt = KINDS[kind]
    weights = {"num_bits": 8, "type": kind_type, "symmetric": True, "strategy": "channel", "dynamic": False,
               "group_size": None, "block_structure": None, "observer": "minmax"}
    acts = {"num_bits": 8, "type": kind_type, "symmetric": True, "strategy": "token", "dynamic": True, "observer": None}
    return {"quant_method": "compressed-tensors", "format": fmt, "ignore": ["lm_head", "re:.*mlp.gate$"],
            "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts}}}


def channel_checkpoint(src: Path, out: Path, kind: str) -> Path:
    """Copy checkpoint `src` to `out` with every linear weight quantized per channel (kind 'fp8' or 'int8')."""
    def quantized(n, w):
        codes, scale = channel_quantize(w, kind)
        return {n: codes.contiguous(), n[: -len("weight")] + "weight_scale": scale.contiguous()}

    return rewritten_checkpoint(src, out, LINEAR, quantized, quantization_config(kind))


def dequantized(ckpt: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The checkpoint with each quantized weight as float(codes) * its row's scale (fp32, exact), scales gone."""
    out = {}
    for n, t in ckpt.items():
        if n.endswith(".weight_scale"):
            continue
        scale = ckpt.get(n[: -len("weight")] + "weight_scale") if n.endswith(".weight") else None
        out[n] = t if scale is None else t.float() * scale
    return out


def expected_shards(ckpt: dict[str, torch.Tensor], config: dict, rank: int, tp: int, ep: int = 1) -> dict:
    """Rank `rank`'s params at tp (and ep, linear placement): the weights as the oracle cuts the checkpoint, each
    X.weight_scale [rows, 1] cut with its weight's rows; a row-parallel layer's scale whole (experts: per local one)."""
    codes = {n: (t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t) for n, t in ckpt.items()
             if not n.endswith(".weight_scale")}
    out = serving_shards(codes, config, rank, tp, ep)
    as_weights = {n: ckpt.get(n[: -len("weight")] + "weight_scale", t) if n.endswith(".weight") else t
                  for n, t in codes.items()}
    scales = serving_shards(as_weights, config, rank, tp, ep)
    whole = serving_shards(as_weights, {**config}, 0, 1, 1)   # every scale uncut (tp 1), for the row-parallel ones
    n_experts = config.get("num_experts") or config.get("num_local_experts") or 1
    group = rank // (tp // ep)
    local = slice(group * n_experts // ep, (group + 1) * n_experts // ep)
    for name, t in list(out.items()):
        base = name[: -len("weight")]
        if not name.endswith("weight") or base + "weight" not in scales or not _quantized(name, ckpt):
            continue
        if ROW_PARALLEL.search(name):
            out[base + "weight_scale"] = whole[name][local] if "experts." in name else whole[name]
        else:
            out[base + "weight_scale"] = scales[name]
    return out


def _quantized(serving: str, ckpt: dict) -> bool:
    """Whether a serving weight is made of quantized checkpoint weights (lm_head, embeddings, norms are not)."""
    layer = re.match(r"model\.layers\.\d+\.", serving)
    return layer is not None and serving.endswith(("_proj.weight", "w13_weight", "w2_weight")) and \
        any(n.startswith(layer.group(0)) and n.endswith(".weight_scale") for n in ckpt)
