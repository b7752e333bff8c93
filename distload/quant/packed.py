"""The packed family: 4-bit formats whose quantized linear has no float `X.weight`, only packed tensors over it.

A packed checkpoint stores, per quantized linear, packed words and their groups' scales and zeros, each a
rectangle over the *logical* weight [out, in] (kernels/int4_format.py and fp4_format.py define the bit layouts).
Planning works on the logical weight — the family's rules cut it as usual (column, row, merged, qkv with kv
replication) — and every packed tensor follows it through one row of its format's table (`cuts`): which logical
axis its rows and its columns run along, and how many logical values one row or column stands for (8 per int32
word, 2 per byte, g per group). The serving params are vLLM's before its post-processing.

    view      packed_view.py: a logical weight (0 bytes, never read) in place of each quantized linear's packed
              tensors, which become its companions
    cut       packed_cuts.py: each packed tensor's shards from the logical weight's, in whole packs and groups
    finalize  the packed tensors as they are, or --dequantize: one step per linear, packed -> BF16 [out, in]
A format module (gptq.py, awq.py, ct_int4.py, nvfp4.py, bnb.py, mxfp4.py) gives its table, its detection and
its dequantization of one matrix (kernels/ does the bit math).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import torch

from ..dtypes import torch_dtype
from ..plan.quantization import View
from ..plan.types import Step
from .companions import by_weight
from .format import DEQUANTIZED_DTYPE, Format
from .packed_cuts import packed_layouts
from .packed_table import Cut
from .packed_view import logical_view
from .steps import part_of, runs

@dataclass(frozen=True)
class PackedStep(Step):
    """Dequantize one rank's packed tensors of one linear (the format's op). inputs: the packed params, `suffixes`
    says which is which; runs: (rows, part) down the local weight, for per-part scales (NVFP4 weight_scale_2);
    use_g_idx: GPTQ desc_act (else groups are i // group)."""
    suffixes: tuple[str, ...] = ()
    group: int = 0
    runs: tuple[tuple[int, int], ...] = ()
    use_g_idx: bool = False


@dataclass(frozen=True)
class PackedFormat(Format):
    """A packed 4-bit format (see the module docstring)."""
    group: int = 0                   # input values per scale group (the whole input: 0)

    unit_name: ClassVar[str] = "group"         # what one scale covers: a group (int4) or a block (fp4)
    experts_supported: ClassVar[bool] = True
    dequantize_op: ClassVar[str] = ""

    def cuts(self, in_features: int) -> dict[str, Cut]:
        """suffix -> Cut, the tensor that marks a quantized linear first."""
        raise NotImplementedError(type(self).__name__)

    def check_steps(self, weight: str, tensors: list, target, index: dict) -> list[Step]:
        """Served packed: the steps that check a companion's values as it lands (GPTQ's g_idx); none by default."""
        return []

    def extra_units(self) -> list[tuple[str, int, str]]:
        """(axis, unit, what) edges the format needs beyond its tensors' packs (GPTQ: whole groups)."""
        return []

    def details(self) -> str:
        return f"{self.unit_name} {self.group}" if self.group else ""

    def step(self, weight: str, tensors: list, spec, lay, target, index: dict, kind=PackedStep,
             **extra) -> PackedStep:
        """One rank's dequantize step of `weight` from its packed `tensors` (companions); a format that needs
        more passes its step type and fields."""
        return kind(self.dequantize_op, tuple(p.name for p in tensors), (weight,), tuple(p.suffix for p in tensors),
                    self.group, runs(lay, spec, part_of(target)), **extra)

    # -- what build_plan asks (plan/quantization.py) -------------------------------------------------------

    def view(self, targets, tensors: dict, rules, config: dict) -> View:
        return logical_view(self, targets, tensors, rules, config)

    def cut(self, view: View, planned: dict, targets: dict, layout, relayout) -> dict:
        return packed_layouts(self, planned, view.companions, targets, view.index, layout.tp, relayout)

    def finalize(self, view: View, staging, planned: dict, logical: dict, targets: dict):
        """(final specs per rank, steps per rank, note): the packed params as they are (with the format's value
        checks), or one dequantize step per quantized linear on each rank that holds it (its packed tensors gone,
        its BF16 weight in place)."""
        final = [dict(specs) for specs in staging]
        steps: list[list[Step]] = [[] for _ in staging]
        for weight, tensors in by_weight(view.companions, logical).items():
            specs, lays = logical[weight]
            for r, (spec, lay) in enumerate(zip(specs, lays)):
                if spec.style == "expert" and not spec.experts:
                    continue  # this rank hosts no expert: nothing to rewrite
                if not self.dequantize:
                    steps[r] += self.check_steps(weight, tensors, targets[weight], view.index)
                    for p in tensors:
                        if p.check_only:   # staged for the check step only
                            del final[r][p.name]
                    continue
                for p in tensors:
                    del final[r][p.name]
                final[r][weight] = replace(spec, dtype=DEQUANTIZED_DTYPE)
                steps[r].append(self.step(weight, tensors, spec, lay, targets[weight], view.index))
        return final, [tuple(s) for s in steps], self.describe()


def packed_op(matrix):
    """The op of a format's `matrix(step, tensors by suffix, dtype) -> [out, in]`: one rank's packed tensors of one
    linear -> its weight; experts each their own matrix (MXFP4: into vLLM's padded param, zeros past the slice)."""
    def dequantize(step, finals, *inputs) -> tuple[torch.Tensor]:
        t = dict(zip(step.suffixes, inputs))
        dtype = torch_dtype(finals[0].dtype)
        if len(finals[0].local_shape) != 3:
            return (matrix(step, t, dtype),)
        padded = finals[0].padding != ()
        out = (torch.zeros if padded else torch.empty)(finals[0].local_shape, dtype=dtype, device=inputs[0].device)
        for e in range(out.shape[0]):
            w = matrix(step, {k: v[e] for k, v in t.items()}, dtype)
            out[e, :w.shape[0], :w.shape[1]] = w
        return (out,)
    return dequantize
