"""Quantized checkpoints in the plan: which FP8 scheme, and which scale tensors travel with which weight.

No family file names a scale. A quantized checkpoint's linear `X.weight` (fp8) has companions beside
it — `X.weight_scale` and `X.input_scale` (per-tensor FP8: scalars), or `X.weight_scale_inv`
(block FP8: one scale per [bn, bk] block) — so for every target whose parts are `X.weight`, the
companions are the checkpoint's `X.<suffix>` for the suffixes its quantization_config implies (all
parts have them or none: a layer left unquantized, like lm_head, has none). Each companion is cut from
its weight's own layout (quant_layouts.py); quant_steps.py turns the staged params into the final ones.
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass

from ..rules import names
from ..errors import PlanError

FP8 = "F8_E4M3"
SCALE_DTYPE = "F32"
DEQUANTIZED_DTYPE = "BF16"
HIGH_PRECISION = ("F32", "F16", "BF16")
ONLINE = ("fp8", "fp8-block")
ONLINE_BLOCK = (128, 128)  # DeepSeek-V3's block, what block-FP8 GEMM kernels expect
# Which params online quantization turns into fp8: the linear layers (as vLLM): not embeddings and
# lm_head (vocab), not norms or the MoE router (replicate), never a 1-D bias.
QUANTIZED_STYLES = ("qkv", "merged", "column", "row", "expert")


@dataclass(frozen=True)
class Scheme:
    """What a quantized checkpoint (or --quantize) stores next to each linear weight."""
    name: str                          # "fp8" (per-tensor) or "fp8-block"
    where: str                         # for messages: 'config.json quantization_config (quant_method fp8)'
    weight_scale: str                  # suffix of the weight's scale: weight_scale | weight_scale_inv
    static_input: bool = False         # activation_scheme static: every quantized linear has X.input_scale
    block: tuple[int, int] | None = None

    def describe(self) -> str:
        block = f" {self.block[0]}x{self.block[1]}" if self.block else ""
        return f"{self.name}{block} ({self.where})"


@dataclass(frozen=True)
class Companion:
    """A scale param that travels with its weight target, cut from the weight's own layout."""
    name: str                          # serving name: the weight's name with 'weight' -> the suffix
    weight: str                        # the weight target it belongs to
    role: str                          # "weight" (the weight's scale) or "input" (static activation scale)
    scale_of: tuple[tuple[str, str], ...]   # (weight source, its scale source), in the weight's source order

    @functools.cached_property   # asked for per planning pass; computed once
    def sources(self) -> tuple[str, ...]:
        return tuple(s for _, s in self.scale_of)


def checkpoint_scheme(config: dict) -> Scheme | None:
    """The checkpoint's FP8 scheme from config.json quantization_config; None when it is not quantized."""
    qc = config.get("quantization_config")
    if not qc:
        return None
    method = qc.get("quant_method")
    where = f"config.json quantization_config (quant_method {method})"
    if is_packed4(qc):
        return None  # packed 4-bit formats: quant/packed4.py
    if method == "fp8":
        if qc.get("fmt", "e4m3") != "e4m3":
            raise PlanError(f"{where}: fmt {qc.get('fmt')!r} is not supported; distload loads e4m3 FP8 checkpoints")
        static = qc.get("activation_scheme", "dynamic") == "static"
        block = qc.get("weight_block_size")
        if block is None:
            return Scheme("fp8", where, "weight_scale", static)
        return Scheme("fp8-block", where, "weight_scale_inv", static, _block(block, f"{where}: weight_block_size"))
    if method == "compressed-tensors":
        return _compressed_tensors(qc, where)
    raise PlanError(f"{where}: not supported; distload loads quant_method fp8 (per-tensor or weight_block_size) and "
                    f"compressed-tensors FP8 (strategy tensor or block); dequantize the checkpoint first")


def is_packed4(qc: dict) -> bool:
    """Whether quantization_config declares a packed 4-bit format (GPTQ, AWQ, compressed-tensors
    pack-quantized, ModelOpt NVFP4, bitsandbytes 4-bit, MXFP4), which quant/packed4.py plans."""
    method = qc.get("quant_method")
    return (method in ("gptq", "awq", "modelopt", "mxfp4") or (method == "bitsandbytes" and bool(qc.get("load_in_4bit")))
            or (method == "compressed-tensors" and qc.get("format") == "pack-quantized"))


def _block(value, where: str) -> tuple[int, int]:
    if (not isinstance(value, (list, tuple)) or len(value) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)):
        raise PlanError(f"{where} must be two positive integers [rows, cols], got {value!r}; fix config.json")
    return int(value[0]), int(value[1])


def _compressed_tensors(qc: dict, where: str) -> Scheme:
    """compressed-tensors FP8: `weights` of type float, 8 bits, strategy tensor (scalar weight_scale)
    or block (weight_scale on the block grid); static `input_activations` add a scalar input_scale."""
    groups = list((qc.get("config_groups") or {}).items())
    schemes = set()
    for group, body in groups:
        w = (body or {}).get("weights") or {}
        if w.get("type") != "float" or w.get("num_bits") != 8:
            raise PlanError(f"{where}: config_groups.{group} quantizes weights to {w.get('num_bits')}-bit "
                            f"{w.get('type')}; distload loads 8-bit float (FP8) compressed-tensors checkpoints only")
        act = (body or {}).get("input_activations")
        static = bool(act) and not act.get("dynamic", False)
        strategy = w.get("strategy")
        if strategy == "tensor":
            schemes.add(Scheme("fp8", where, "weight_scale", static))
        elif strategy == "block":
            block = _block(w.get("block_structure"), f"{where}: config_groups.{group}.weights.block_structure")
            schemes.add(Scheme("fp8-block", where, "weight_scale", static, block))
        else:
            raise PlanError(f"{where}: config_groups.{group} has weight strategy {strategy!r}; distload supports "
                            f"'tensor' and 'block' (a per-channel scale is not cut yet)")
    if len(schemes) != 1:
        raise PlanError(f"{where}: expected one FP8 config group (or several identical ones), got "
                        f"{len(groups)} group(s) describing {len(schemes)} scheme(s)")
    return schemes.pop()


def online_scheme(quantize: str | None) -> Scheme | None:
    if quantize is None:
        return None
    if quantize not in ONLINE:
        raise PlanError(f"--quantize {quantize!r}: choose one of {', '.join(ONLINE)}")
    if quantize == "fp8":
        return Scheme("fp8", "--quantize fp8", "weight_scale")
    return Scheme("fp8-block", "--quantize fp8-block", "weight_scale_inv", block=ONLINE_BLOCK)


_WEIGHT = len("weight")
_is_weight = operator.methodcaller("endswith", ".weight")


def with_suffix(weight_name: str, suffix: str) -> str:
    return weight_name[:-_WEIGHT] + suffix


def companions(targets, tensors: dict, scheme: Scheme | None) -> list[Companion]:
    """Scale targets derived from the checkpoint: for each target whose parts are all `X.weight` (and are
    in the checkpoint), its parts' `X.<scale suffix>` and `X.input_scale`, all or none."""
    if scheme is None:
        return []
    out = []
    # A scale's name ends with `.<suffix>`: a suffix no checkpoint name ends with (dynamic FP8's input_scale)
    # has nothing to look up per source.
    kinds = [(suffix, role, any(map(operator.methodcaller("endswith", "." + suffix), tensors)))
             for suffix, role in ((scheme.weight_scale, "weight"), ("input_scale", "input"))]
    for t in targets:
        sources = t.sources
        if (not t.name.endswith("weight") or not all(map(_is_weight, sources))
                or not all(map(tensors.__contains__, sources))):
            continue
        quantized = False
        for suffix, role, anywhere in kinds:
            scales = [s[:-_WEIGHT] + suffix for s in sources]   # with_suffix, inline: thousands per target
            present = list(filter(tensors.__contains__, scales)) if anywhere else []
            if not present:
                if role == "input" and quantized and scheme.static_input:
                    raise PlanError(f"{t.name}: {scheme.where} says activation_scheme static, but the checkpoint "
                                    f"has no {names.describe(scales)}; re-export the checkpoint with its input "
                                    f"scales or set activation_scheme to dynamic")
                continue
            if len(present) != len(scales):
                raise PlanError(f"{t.name}: the checkpoint has {names.describe(present)} but not "
                                f"{names.describe(sorted(set(scales) - set(present)))}; every part of one param "
                                f"is quantized alike: the checkpoint is incomplete")
            quantized = quantized or role == "weight"
            out.append(Companion(with_suffix(t.name, suffix), t.name, role, tuple(zip(sources, scales))))
        dtypes = sorted({e.dtype for e in map(tensors.__getitem__, sources)})
        if quantized and dtypes != [FP8]:
            raise PlanError(f"{t.name}: has {scheme.weight_scale} tensors but its weights are {', '.join(dtypes)}; "
                            f"{scheme.where} needs {FP8} weights next to their scales")
        if not quantized and FP8 in dtypes:
            raise PlanError(f"{t.name}: {FP8} weights without {with_suffix(sources[0], scheme.weight_scale)} "
                            f"({scheme.where}); the checkpoint is missing its scales")
    return out
