"""GPTQ (AutoGPTQ v1 layout, quant_method gptq, 4 bits): int32 words packed along the input, per group of g inputs
a scale and packed zeros; with desc_act (act-order) g_idx maps each input to its group.

    X.qweight  I32 [in/8, out]     X.qzeros  I32 [in/g, out/8]     X.scales  F16 [in/g, out]     X.g_idx  I32 [in]
With desc_act (or one group per row), scales and zeros are not cut along the input: as in vLLM every rank
holds all groups, and its cut of g_idx indexes them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .. import kernels
from ..errors import CheckpointError
from .packed import PackedFormat, PackedStep, packed_op
from .packed_table import IN, INT_FLOAT_DTYPES, ONE, OUT, Cut, parse_group
from .format import refuse_kind


@dataclass(frozen=True)
class GptqStep(PackedStep):
    """A GPTQ step with what a refusal of its g_idx names: the checkpoint's g_idx of each fused part (the first
    part's is the param's), the groups of the whole input."""
    g_idx_sources: tuple[str, ...] = ()
    groups: int = 0
    in_features: int = 0


def check_g_idx(step, *g_idx):
    """Act-order g_idx maps each input to one of the whole input's groups: a value outside 0..groups-1 would
    index another row of the scales (negative: from the end) or past them. Fused parts share their input and a
    fused param holds one g_idx (as in vLLM): a later part's must equal the first's. Returns the first's."""
    for source, part in zip(step.g_idx_sources, g_idx):
        bad = (part < 0) | (part >= step.groups)
        if bool(bad.any()):
            values = sorted(set(part[bad].reshape(-1).tolist()))
            shown = ", ".join(map(str, values[:4])) + (f" (and {len(values) - 4} more)" if len(values) > 4 else "")
            raise CheckpointError(f"{source}: g_idx holds {shown}, but act-order group indices run "
                                  f"0..{step.groups - 1} ({step.in_features} inputs / group_size {step.group} = "
                                  f"{step.groups} groups); the checkpoint is damaged: export it again")
    for source, part in zip(step.g_idx_sources[1:], g_idx[1:]):
        if not torch.equal(part, g_idx[0]):
            at = int((part != g_idx[0]).reshape(-1).nonzero()[0])
            raise CheckpointError(f"{source}: g_idx differs from {step.g_idx_sources[0]}'s (input {at}: "
                                  f"{int(part.reshape(-1)[at])} vs {int(g_idx[0].reshape(-1)[at])}); the fused "
                                  f"{step.outputs[0].rsplit('.', 1)[0]} has one g_idx for all its parts, as in vLLM: "
                                  "parts with their own act order cannot be fused (export them with one)")
    return g_idx[0]


def _check_op(step, finals, *g_idx):
    return (check_g_idx(step, *g_idx),)


def _matrix(step, t: dict, dtype):
    g_idx = None
    if step.use_g_idx and "g_idx" in t:
        g_idx = check_g_idx(step, *(t[s] for s in step.suffixes if s.startswith("g_idx")))
    return kernels.dequantize_gptq(t["qweight"], t["qzeros"], t["scales"], g_idx, group_size=step.group or -1,
                                   dtype=dtype)


@dataclass(frozen=True)
class Gptq(PackedFormat):
    """GPTQ (see the module docstring)."""
    desc_act: bool = False           # act-order: g_idx is a permutation of the groups
    symmetric: bool = True

    name: ClassVar[str] = "gptq"
    declared_by: ClassVar[str] = "gptq (quant_method gptq, 4 bits, checkpoint_format gptq)"
    dequantize_op: ClassVar[str] = "dequantize_gptq"
    OPS: ClassVar[dict] = {"dequantize_gptq": packed_op(_matrix), "check_gptq_g_idx": _check_op}

    @staticmethod
    def declares(qc: dict) -> bool:
        return qc.get("quant_method") == "gptq"

    @classmethod
    def from_config(cls, qc: dict, where: str) -> "Gptq":
        if qc.get("bits", 4) != 4:
            raise refuse_kind(where, f"bits {qc.get('bits')} is not supported", "4-bit gptq checkpoints")
        fmt = qc.get("checkpoint_format", "gptq")
        if fmt != "gptq":
            raise refuse_kind(where, f"checkpoint_format {fmt!r}", "the AutoGPTQ v1 layout ('gptq'); convert the "
                                                                    "checkpoint with gptqmodel first")
        return cls(where, group=parse_group(qc.get("group_size", 128), where), desc_act=bool(qc.get("desc_act")),
                   symmetric=bool(qc.get("sym", True)))

    def details(self) -> str:
        return super().details() + (" desc_act" if self.desc_act else "")

    def cuts(self, in_features: int) -> dict[str, Cut]:
        g, whole = self.group or in_features, self.desc_act or not self.group
        return {"qweight": Cut((IN, 8), (OUT, 1), ("I32",)),
                "qzeros": Cut((IN, g), (OUT, 8), ("I32",), whole_in=whole),
                "scales": Cut((IN, g), (OUT, 1), INT_FLOAT_DTYPES, whole_in=whole),
                "g_idx": Cut((IN, 1), (ONE, 1), ("I32",), optional=not self.desc_act)}

    def extra_units(self) -> list[tuple[str, int, str]]:
        # vLLM: a rank's local input is a whole number of groups
        return [(IN, self.group, f"{self.group}-value group of its scales")] if self.group else []

    def step(self, weight, tensors, spec, lay, target, index, **extra):
        return super().step(weight, tensors, spec, lay, target, index, GptqStep, use_g_idx=self.desc_act,
                            **self._g_idx_fields(tensors, target, index))

    def check_steps(self, weight, tensors, target, index) -> list:
        """Served packed: with act-order, its g_idx (each part's) checked as it lands (what --dequantize checks in
        its step)."""
        g_idx = [p.name for p in tensors if p.suffix.startswith("g_idx")]
        if not self.desc_act or not g_idx:
            return []
        return [GptqStep("check_gptq_g_idx", tuple(g_idx), g_idx[:1], group=self.group,
                         **self._g_idx_fields(tensors, target, index))]

    def _g_idx_fields(self, tensors, target, index) -> dict:
        g_idx = [p for p in tensors if p.suffix.startswith("g_idx")]
        if not g_idx or not self.desc_act:
            return {}
        in_f = index[g_idx[0].sources[0]].shape[-1]
        return dict(g_idx_sources=tuple(p.sources[0] for p in g_idx), in_features=in_f,
                    groups=-(-in_f // (self.group or in_f)))
