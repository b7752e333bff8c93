"""The one protocol every quantization format implements (one module per format, listed in quant/__init__.py).

A format is a frozen dataclass: its fields are what config.json's quantization_config (or --quantize) says
(a block size, a group size, ...), plus `where` (for messages) and `dequantize` (--dequantize: serve BF16).
It answers, as class-level data and methods:

    name, declared_by          the registry's key; how config.json declares it (the refusal lists these)
    declares(qc) -> bool       whether a quantization_config is this format's (at most one format says yes)
    from_config(qc, where)     the format with its parameters, or a PlanError naming what it cannot load
    view / cut / finalize      what plan/quantization.py asks: a family base implements them once
                               (scaled.py: the weight stays, scales beside it; packed.py: packed tensors
                               over a logical weight), a format fills in its family's hooks
    OPS                        the post-load ops its steps name: op name -> fn(step, final specs, *inputs)

Bit math stays in kernels/ (Triton with a torch reference twin); an op only calls it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..errors import PlanError
from ..plan.shard import valid_group_sizes

FP8 = "F8_E4M3"
FP8_DTYPES = ("F8_E4M3", "F8_E5M2")      # what the dtype policy accepts as fp8 (companions insist on e4m3)
SCALE_DTYPE = "F32"
DEQUANTIZED_DTYPE = "BF16"
HIGH_PRECISION = ("F32", "F16", "BF16")


@dataclass(frozen=True)
class Format:
    """A quantization format as the registry hands it to build_plan (see the module docstring)."""
    where: str                          # 'config.json quantization_config (quant_method ...)' or '--quantize X'
    dequantize: bool = False            # --dequantize: the final params are BF16 weights, no companions

    name: ClassVar[str] = ""
    declared_by: ClassVar[str] = ""
    weight_dtypes: ClassVar[tuple[str, ...]] = ()
    OPS: ClassVar[dict] = {}

    @staticmethod
    def declares(qc: dict) -> bool:
        return False

    @classmethod
    def from_config(cls, qc: dict, where: str) -> "Format":
        raise NotImplementedError(cls.__name__)

    def details(self) -> str:
        """The parameters worth naming after the format's name ('128x128', 'group 64')."""
        return ""

    def label(self) -> str:
        """How messages name the format: 'fp8-block 128x128 (config.json quantization_config ...)'."""
        details = self.details()
        return f"{self.name}{' ' + details if details else ''} ({self.where})"

    def describe(self) -> str:
        """What the load does about quantization (the plan's note, the report's `quantization`)."""
        return self.label() + (" -> BF16 (--dequantize)" if self.dequantize else "")

    @property
    def key(self) -> str:
        """What a plan's digest includes: ranks that plan different quantizations plan different loads."""
        return repr(self)


def hint_sizes(fits, label: str, upto: int = 64, none: str = "") -> str:
    """'try tp 1, 2, 4' for the group sizes `fits(q)` accepts (a derived cut's refusal), or `none`."""
    valid = valid_group_sizes(fits, upto=upto)
    return f"try {label} {', '.join(map(str, valid))}" if valid else none


def group_label(target) -> str:
    """How a refusal names the group a target is cut over."""
    return "ranks per expert group (world/ep)" if target.rule.style == "expert" else "tp"


def refuse_kind(where: str, what: str, loads: str) -> PlanError:
    """A format's refusal of a variant it does not load, naming the config key and what it does load."""
    return PlanError(f"{where}: {what}; distload loads {loads}")
