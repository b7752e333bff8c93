"""Online quantization (`--quantize NAME`): a high-precision checkpoint's linear weights quantized on each rank
as they land, into a scaled format (fp8.py, fp8_block.py, ...): the format names the op and its scale's shape.

Which params: the linear layers, as vLLM quantizes them: not embeddings and lm_head (vocab), not norms or the
MoE router (replicate), never a 1-D bias. Each weight's groups of ranks are rewritten once; the weight's
high-precision copy is a step input, allocated on its first write and released after the step
(postprocess.py), so a rank holds about one layer of it, never the model's.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..errors import PlanError
from ..plan.quantization import View
from ..plan.ranks import RankSpecs, RankValues, per_group
from ..plan.types import ParamSpec
from .companions import with_suffix
from .format import HIGH_PRECISION, SCALE_DTYPE
from .steps import ScaleStep

QUANTIZED_STYLES = ("qkv", "merged", "column", "row", "expert")


@dataclass(frozen=True)
class Online:
    """The plan's quantization for --quantize: the checkpoint as it is, one quantize step per linear weight."""
    format: object                       # a scaled format made for the option (its where: '--quantize NAME')

    weight_dtypes = ()

    @property
    def key(self) -> str:
        return "online " + self.format.key

    def describe(self) -> str:
        return self.format.describe()

    def view(self, targets, tensors: dict, rules, config: dict) -> View:
        return View(targets, tensors)

    def cut(self, view: View, planned: dict, targets: dict, layout, relayout) -> None:
        return None

    def finalize(self, view: View, staging: RankSpecs, planned: dict, cuts, targets: dict):
        """(final specs, steps) per group of ranks: each linear weight's groups rewritten once (param-major,
        groups in rank order), its scale added after the staged params, as a per-rank walk would."""
        fmt = self.format
        per_param, step_columns = dict(staging.per_param), []
        absent = RankValues([None], staging.world)
        for name, values in staging.per_param.items():
            scale = with_suffix(name, fmt.scale_suffix)
            made = per_group(lambda w, existing, name=name, scale=scale: self._group(name, scale, w, existing),
                             values, staging.per_param.get(scale, absent))
            if all(made.value(i)[0] is None for i in range(made.period)):
                continue
            per_param[name] = made.map(lambda m: m[1])
            per_param[scale] = made.map(lambda m: m[2])
            step_columns.append(made.map(lambda m: m[0]))
        if not step_columns:
            return staging, RankValues([()], staging.world), self.describe()
        post = per_group(lambda *steps: tuple(s for s in steps if s is not None), *step_columns)
        return RankSpecs(per_param, staging.world), post, self.describe()

    def _group(self, name: str, scale: str, w, existing):
        """(step, final weight spec, scale spec) of one group; step None: not a quantized weight here."""
        fmt = self.format
        if (w is None or w.alias_of or w.style not in QUANTIZED_STYLES or len(w.local_shape) not in (2, 3)
                or not name.endswith("weight") or (w.style == "expert") != (len(w.local_shape) == 3)):
            return None, w, None
        if w.dtype not in HIGH_PRECISION:
            raise PlanError(f"--quantize {fmt.name}: {name} is {w.dtype}; online quantization reads "
                            f"{', '.join(HIGH_PRECISION)} checkpoints")
        if existing is not None:
            raise PlanError(f"--quantize {fmt.name}: {scale} already exists in the checkpoint's layout")
        if w.padding:
            raise PlanError(f"--quantize {fmt.name}: {name} is zero-padded; it cannot be quantized while loading")
        local, glob = fmt.online_scale(w)
        step = ScaleStep(fmt.quantize_op, (name,), (name, scale), block=fmt.scale_block)
        return (step, replace(w, dtype=fmt.stored_dtype),
                ParamSpec(scale, w.style, SCALE_DTYPE, glob, local, experts=w.experts))
