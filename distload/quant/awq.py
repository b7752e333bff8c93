"""AWQ (AutoAWQ GEMM, quant_method awq, 4 bits, zero points): int32 words packed along the output.

    X.qweight  I32 [in, out/8]     X.qzeros  I32 [in/g, out/8]     X.scales  F16 [in/g, out]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .. import kernels
from .format import refuse_kind
from .packed import PackedFormat, packed_op
from .packed_table import IN, INT_FLOAT_DTYPES, OUT, Cut, parse_group


def _matrix(step, t: dict, dtype):
    return kernels.dequantize_awq(t["qweight"], t["qzeros"], t["scales"], dtype=dtype)


@dataclass(frozen=True)
class Awq(PackedFormat):
    """AWQ (see the module docstring)."""
    name: ClassVar[str] = "awq"
    declared_by: ClassVar[str] = "awq (quant_method awq, 4 bits, version gemm, zero points)"
    dequantize_op: ClassVar[str] = "dequantize_awq"
    OPS: ClassVar[dict] = {"dequantize_awq": packed_op(_matrix)}

    @staticmethod
    def declares(qc: dict) -> bool:
        return qc.get("quant_method") == "awq"

    @classmethod
    def from_config(cls, qc: dict, where: str) -> "Awq":
        if qc.get("bits", 4) != 4:
            raise refuse_kind(where, f"bits {qc.get('bits')} is not supported", "4-bit awq checkpoints")
        group = parse_group(qc.get("group_size", 128), where)
        if str(qc.get("version", "gemm")).lower() != "gemm" or not qc.get("zero_point", True):
            raise refuse_kind(where, f"version {qc.get('version')!r}, zero_point {qc.get('zero_point')!r}",
                              "AutoAWQ GEMM checkpoints with zero points")
        return cls(where, group=group)

    def cuts(self, in_features: int) -> dict[str, Cut]:
        g = self.group or in_features
        return {"qweight": Cut((IN, 1), (OUT, 8), ("I32",)), "qzeros": Cut((IN, g), (OUT, 8), ("I32",)),
                "scales": Cut((IN, g), (OUT, 1), INT_FLOAT_DTYPES)}
