"""The packed 4-bit formats distload plans, as data: per format, the tensors beside each quantized linear and
how each lies over the logical weight [out, in] (quant4.py plans them; kernels/int4_format.py and
fp4_format.py define the bit layouts), and which format config.json's quantization_config declares.

    format        config.json quantization_config            tensors per linear (rows axis/unit, cols axis/unit)
    gptq          quant_method gptq, bits 4, desc_act        qweight (in/8, out), qzeros (in/g, out/8), scales
                                                             (in/g, out), g_idx (in)
    awq           quant_method awq, version gemm             qweight (in, out/8), qzeros (in/g, out/8), scales (in/g, out)
    ct-int4       compressed-tensors, format pack-quantized  weight_packed (out, in/8), weight_scale (out, in/g),
                                                             weight_zero_point (out/8, in/g), weight_shape (per part)
    nvfp4         quant_method modelopt, quant_algo NVFP4    weight (out, in/2), weight_scale (out, in/16),
                                                             weight_scale_2 / input_scale (per part)
    bnb           quant_method bitsandbytes, load_in_4bit    weight (out, in/2) and weight.absmax (out, in/64),
                                                             both stored flat; quant_map, nested_absmax,
                                                             nested_quant_map, quant_state (per part)
    mxfp4         quant_method mxfp4 (GPT-OSS experts)       X_blocks [E, out, in/32, 16] uint8, X_scales [E, out, in/32]
                                                             E8M0; cut by vLLM's uneven rule (mxfp4.py)
bitsandbytes packs the flat row-major weight in 64-value blocks, so with in % 64 == 0 the flat bytes are
the [out, in/2] matrix and the absmax the [out, in/64] one, and row and column cuts keep whole blocks (what
no engine does: vLLM and SGLang refuse pre-quantized bitsandbytes at tp > 1). A nested absmax (uint8 codes)
is cut like the fp32 one; the post-load step undoes it with each block's global index.
A per-part tensor (a scalar, a global shape) is not cut: every rank holds every part's, in part order.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import PlanError
from .fp8 import is_packed4

OUT, IN, ONE = "out", "in", "one"
BNB_BLOCK = 64
MXFP4_BLOCK = 32
INT_FLOAT_DTYPES = ("F16", "BF16", "F32")


@dataclass(frozen=True)
class Cut:
    """How one packed tensor's 2-D view lies over its logical weight [out, in]."""
    rows: tuple[str, int]            # (logical axis, logical values per row)
    cols: tuple[str, int]
    dtypes: tuple[str, ...]
    optional: bool = False           # some checkpoints of the format do without it (all parts alike)
    per_part: bool = False           # not cut: every rank holds every part's
    whole_in: bool = False           # when the input is cut, every rank still holds all of it (GPTQ desc_act)
    flat: bool = False               # stored flat (bitsandbytes): planned as its [rows, cols] view


@dataclass(frozen=True)
class Packed4:
    """A packed 4-bit checkpoint's format, as config.json's quantization_config declares it."""
    name: str                        # gptq | awq | ct-int4 | nvfp4 | bnb | mxfp4
    where: str
    group: int                       # input values per scale group (the whole input: 0)
    desc_act: bool = False           # GPTQ act-order: g_idx is a permutation of the groups
    symmetric: bool = True
    quant_type: str = ""             # bitsandbytes: nf4 | fp4

    @property
    def unit_name(self) -> str:
        """What one scale covers: a group (int4 formats) or a block (fp4 / bitsandbytes)."""
        return "block" if self.name in ("nvfp4", "bnb", "mxfp4") else "group"

    def describe(self) -> str:
        group = f" {self.unit_name} {self.group}" if self.group else ""
        kind = f" {self.quant_type}" if self.quant_type else ""
        return f"{self.name}{kind}{group}{' desc_act' if self.desc_act else ''} ({self.where})"

    def cuts(self, in_features: int) -> dict[str, Cut]:
        """suffix -> Cut, the tensor that marks a quantized linear first."""
        g = self.group or in_features
        i32, scale = ("I32",), INT_FLOAT_DTYPES
        whole = self.desc_act or not self.group
        if self.name == "gptq":
            return {"qweight": Cut((IN, 8), (OUT, 1), i32), "qzeros": Cut((IN, g), (OUT, 8), i32, whole_in=whole),
                    "scales": Cut((IN, g), (OUT, 1), scale, whole_in=whole),
                    "g_idx": Cut((IN, 1), (ONE, 1), i32, optional=not self.desc_act)}
        if self.name == "awq":
            return {"qweight": Cut((IN, 1), (OUT, 8), i32), "qzeros": Cut((IN, g), (OUT, 8), i32),
                    "scales": Cut((IN, g), (OUT, 1), scale)}
        if self.name == "ct-int4":
            return {"weight_packed": Cut((OUT, 1), (IN, 8), i32), "weight_scale": Cut((OUT, 1), (IN, g), scale),
                    "weight_zero_point": Cut((OUT, 8), (IN, g), i32, optional=self.symmetric),
                    "weight_shape": Cut((ONE, 1), (ONE, 1), ("I64", "I32"), optional=True, per_part=True)}
        if self.name == "mxfp4":  # vLLM's names: X_blocks -> w13_weight, X_scales -> w13_weight_scale
            return {"weight": Cut((OUT, 1), (IN, 2), ("U8",)), "weight_scale": Cut((OUT, 1), (IN, MXFP4_BLOCK), ("U8",))}
        if self.name == "bnb":
            part = dict(optional=True, per_part=True)
            return {"weight.absmax": Cut((OUT, 1), (IN, BNB_BLOCK), ("F32", "U8"), flat=True),
                    "weight": Cut((OUT, 1), (IN, 2), ("U8",), flat=True),
                    "weight.quant_map": Cut((ONE, 1), (ONE, 1), ("F32",), per_part=True),
                    "weight.nested_absmax": Cut((ONE, 1), (ONE, 1), ("F32",), **part),
                    "weight.nested_quant_map": Cut((ONE, 1), (ONE, 1), ("F32",), **part),
                    f"weight.quant_state.bitsandbytes__{self.quant_type}": Cut((ONE, 1), (ONE, 1), ("U8",),
                                                                                per_part=True)}
        return {"weight_scale": Cut((OUT, 1), (IN, 16), ("F8_E4M3",)), "weight": Cut((OUT, 1), (IN, 2), ("U8",)),
                "weight_scale_2": Cut((ONE, 1), (ONE, 1), ("F32",), per_part=True),
                "input_scale": Cut((ONE, 1), (ONE, 1), ("F32",), optional=True, per_part=True)}


def checkpoint_scheme(config: dict) -> Packed4 | None:
    """The packed 4-bit format from config.json quantization_config; None for any other checkpoint."""
    qc = config.get("quantization_config") or {}
    if not is_packed4(qc):
        return None
    method = qc["quant_method"]
    where = f"config.json quantization_config (quant_method {method})"
    if method in ("gptq", "awq"):
        if qc.get("bits", 4) != 4:
            raise PlanError(f"{where}: bits {qc.get('bits')} is not supported; distload loads 4-bit {method} checkpoints")
        group = _group(qc.get("group_size", 128), where)
        if method == "awq":
            if str(qc.get("version", "gemm")).lower() != "gemm" or not qc.get("zero_point", True):
                raise PlanError(f"{where}: version {qc.get('version')!r}, zero_point {qc.get('zero_point')!r}; "
                                f"distload loads AutoAWQ GEMM checkpoints with zero points")
            return Packed4("awq", where, group, symmetric=False)
        fmt = qc.get("checkpoint_format", "gptq")
        if fmt != "gptq":
            raise PlanError(f"{where}: checkpoint_format {fmt!r}; distload loads the AutoGPTQ v1 layout "
                            f"('gptq'); convert the checkpoint with gptqmodel first")
        return Packed4("gptq", where, group, desc_act=bool(qc.get("desc_act")), symmetric=bool(qc.get("sym", True)))
    if method == "bitsandbytes":
        kind = qc.get("bnb_4bit_quant_type", "fp4")
        if not qc.get("load_in_4bit") or kind not in ("nf4", "fp4"):
            raise PlanError(f"{where}: load_in_4bit {qc.get('load_in_4bit')!r}, bnb_4bit_quant_type {kind!r}; "
                            f"distload loads pre-quantized 4-bit (nf4 / fp4) bitsandbytes checkpoints")
        return Packed4("bnb", where, BNB_BLOCK, quant_type=kind)
    if method == "mxfp4":
        return Packed4("mxfp4", where, MXFP4_BLOCK)
    if method == "modelopt":
        body = qc.get("quantization", qc)
        if body.get("quant_algo") != "NVFP4":
            raise PlanError(f"{where}: quant_algo {body.get('quant_algo')!r}; distload loads ModelOpt NVFP4 checkpoints")
        if body.get("group_size", 16) != 16:
            raise PlanError(f"{where}: group_size {body.get('group_size')}; NVFP4 blocks hold 16 values")
        return Packed4("nvfp4", where, 16)
    return _compressed_int4(qc, where)


def _group(value, where: str) -> int:
    if value in (-1, 0, None):
        return 0
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise PlanError(f"{where}: group_size {value!r} must be a positive integer or -1; fix config.json")
    return value


def _compressed_int4(qc: dict, where: str) -> Packed4:
    schemes = set()
    for group, body in (qc.get("config_groups") or {}).items():
        w = (body or {}).get("weights") or {}
        if w.get("type") != "int" or w.get("num_bits") != 4:
            raise PlanError(f"{where}: config_groups.{group} quantizes weights to {w.get('num_bits')}-bit "
                            f"{w.get('type')}; a pack-quantized checkpoint distload loads holds 4-bit int weights")
        strategy = w.get("strategy")
        if strategy not in ("group", "channel"):
            raise PlanError(f"{where}: config_groups.{group} weight strategy {strategy!r}; distload cuts 'group' "
                            f"and 'channel' int4 scales")
        g = _group(w.get("group_size"), where) if strategy == "group" else 0
        schemes.add(Packed4("ct-int4", where, g, symmetric=bool(w.get("symmetric", True))))
    if len(schemes) != 1:
        raise PlanError(f"{where}: expected one int4 config group (or identical ones), got {len(schemes)} schemes")
    return schemes.pop()


def expected_view(cut: Cut, out_f: int, in_f: int) -> tuple[int, int]:
    """The packed tensor's 2-D view over a logical [out_f, in_f]."""
    sizes = {OUT: out_f, IN: in_f, ONE: 1}
    return tuple(-(-sizes[axis] // unit) for axis, unit in (cut.rows, cut.cols))
