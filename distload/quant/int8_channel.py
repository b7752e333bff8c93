"""INT8 W8A8: int8 weights with one fp32 scale per output row, activations quantized per token at run time
(compressed-tensors type int, 8 bits, strategy channel, dynamic input_activations: vLLM's
CompressedTensorsW8A8Int8), final as cut: no step unless --dequantize.

    X.weight        I8 [out, in]          symmetric: no weight_zero_point (vLLM refuses asymmetric weights too)
    X.weight_scale  F32 [out, 1]          cut as per-channel FP8's (fp8_channel.py): with the weight's rows
Refused by name: strategy tensor (vLLM turns its per-part scales into channels after loading), static activations
(a stored input_scale, and input_zero_point when asymmetric; vLLM's fused MoE refuses them too). Dynamic
asymmetric activations store nothing and load as the symmetric ones do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..dtypes import torch_dtype
from ..errors import PlanError
from ..transfer import host_memory
from . import ct_config
from .fp8_block import bands
from .fp8_channel import channel_layouts, check_channel_config
from .scaled import ScaledFormat, matrices


def _dequantize(step, finals, weight, scale):
    """int8 codes times their row's scale, in fp32, rounded once to the final dtype (plain torch: no bit layout)."""
    dtype = torch_dtype(finals[0].dtype)
    out = host_memory.empty(weight.shape, dtype, weight.device)
    o, w, s = matrices(out), matrices(weight), matrices(scale)
    for e, r0, r1 in bands(weight, (1, w.shape[-1])):
        o[e, r0:r1] = (w[e, r0:r1].float() * s[e, r0:r1].float()).to(dtype)
    return (out,)


@dataclass(frozen=True)
class Int8Channel(ScaledFormat):
    """INT8 W8A8 (see the module docstring)."""
    name: ClassVar[str] = "int8-channel"
    declared_by: ClassVar[str] = ("int8-channel (compressed-tensors 8-bit int strategy channel, dynamic per-token "
                                  "activations: W8A8 INT8)")
    stored_dtype: ClassVar[str] = "I8"
    dequantize_op: ClassVar[str] = "dequantize_int8_channel"
    OPS: ClassVar[dict] = {"dequantize_int8_channel": _dequantize}

    @staticmethod
    def declares(qc: dict) -> bool:
        return ct_config.declares(qc, "int", 8)

    @classmethod
    def from_config(cls, qc: dict, where: str) -> "Int8Channel":
        strategy = ct_config.uniform_weights(qc, packed=False).get("strategy")
        if strategy != "channel":
            raise PlanError(f"{where}: 8-bit int weights with strategy {strategy!r}: not supported; distload loads "
                            f"INT8 W8A8 with strategy 'channel' (one scale per output row)")
        check_channel_config(qc, where, "W8A8 INT8 with dynamic activations")
        return cls(where)

    def cut_scale(self, c, target, weight_specs, weight_lays, index: dict, group: int, relayout):
        return channel_layouts(c, target, weight_specs, weight_lays, index, self.where)
