"""compressed-tensors pack-quantized int4 (vLLM's compressed_tensors_wNa16): int32 words packed along the input.

    X.weight_packed      I32 [out, in/8]     X.weight_scale  F16 [out, in/g] (strategy group; channel: [out, 1])
    X.weight_zero_point  I32 [out/8, in/g] (asymmetric)     X.weight_shape  I64 [2] per part (not cut)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .. import kernels
from ..errors import PlanError
from . import ct_config
from .packed import PackedFormat, packed_op
from .packed_table import IN, INT_FLOAT_DTYPES, ONE, OUT, Cut, parse_group


def _matrix(step, t: dict, dtype):
    return kernels.dequantize_compressed_int4(t["weight_packed"], t["weight_scale"], t.get("weight_zero_point"),
                                              dtype=dtype)


@dataclass(frozen=True)
class CtInt4(PackedFormat):
    """compressed-tensors int4 (see the module docstring)."""
    symmetric: bool = True

    name: ClassVar[str] = "ct-int4"
    declared_by: ClassVar[str] = ("ct-int4 (compressed-tensors format pack-quantized, 4-bit int, strategy group or "
                                  "channel)")
    dequantize_op: ClassVar[str] = "dequantize_ct_int4"
    OPS: ClassVar[dict] = {"dequantize_ct_int4": packed_op(_matrix)}

    @staticmethod
    def declares(qc: dict) -> bool:
        return qc.get("quant_method") == ct_config.METHOD and qc.get("format") == ct_config.PACKED

    @classmethod
    def from_config(cls, qc: dict, where: str) -> "CtInt4":
        for group, w, _ in ct_config.groups(qc):
            if w.get("type") != "int" or w.get("num_bits") != 4:
                raise PlanError(f"{where}: config_groups.{group} quantizes weights to {w.get('num_bits')}-bit "
                                f"{w.get('type')}; a pack-quantized checkpoint distload loads holds 4-bit int weights")
            if w.get("strategy") not in ("group", "channel"):
                raise PlanError(f"{where}: config_groups.{group} weight strategy {w.get('strategy')!r}; distload "
                                f"cuts 'group' and 'channel' int4 scales")
        w = ct_config.uniform_weights(qc, packed=True)
        if w is None:
            raise PlanError(f"{where}: expected one int4 config group (or identical ones), got "
                            f"{ct_config.summary(qc)}")
        group = parse_group(w.get("group_size"), where) if w.get("strategy") == "group" else 0
        return cls(where, group=group, symmetric=bool(w.get("symmetric", True)))

    def cuts(self, in_features: int) -> dict[str, Cut]:
        g = self.group or in_features
        return {"weight_packed": Cut((OUT, 1), (IN, 8), ("I32",)),
                "weight_scale": Cut((OUT, 1), (IN, g), INT_FLOAT_DTYPES),
                "weight_zero_point": Cut((OUT, 8), (IN, g), ("I32",), optional=self.symmetric),
                "weight_shape": Cut((ONE, 1), (ONE, 1), ("I64", "I32"), optional=True, per_part=True)}
