"""The scaled family: the quantized weight stays `X.weight` (fp8 or int8 codes), its scales travel beside it.

    view      each linear's companions `X.<scale suffix>` (and `X.input_scale`, static activations), all parts or
              none; a quantized weight is stored in the format's dtype, an unquantized one (lm_head) is not
    cut       the weight's scale by the format's own cut (cut_scale: per part, the block grid, per channel), input
              scales per part (per_part.py)
    finalize  nothing where the cut is final (final_as_cut); else per weight, once per group of ranks: the
              format's fold of a fused param's per-part scales into one (requantize) and of its input scales
              (max), or --dequantize: weight and scales -> a BF16 weight, the scales gone
A format says which (fp8.py, fp8_block.py, ...): its scale suffix, stored dtype, cut and dequantize op.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace
from typing import ClassVar

import torch

from ..errors import PlanError
from ..plan.quantization import View
from ..plan.ranks import RankSpecs, RankValues, per_group
from ..plan.shard import view2d
from ..rules import names
from .companions import scale_companions, with_suffix
from .format import DEQUANTIZED_DTYPE, FP8, SCALE_DTYPE, Format
from .per_part import per_part_layouts
from .steps import ScaleStep, no_steps, part_of, parts, runs

FLOAT_SCALES = ("F64", "F32", "F16", "BF16")


@dataclass(frozen=True)
class ScaledFormat(Format):
    """A format whose weight stays in the checkpoint as X.weight next to its scales (see the module docstring)."""
    static_input: bool = False               # activation_scheme static: every quantized linear has X.input_scale
    scale_suffix: str = "weight_scale"       # the weight scale's suffix (block FP8 from quant_method fp8: _inv)

    stored_dtype: ClassVar[str] = FP8        # what a quantized weight is stored as
    per_part_scales: ClassVar[bool] = False  # one scale per part: steps read the parts' rows (runs)
    dequantize_op: ClassVar[str] = ""

    @property
    def weight_dtypes(self) -> tuple[str, ...]:
        return (self.stored_dtype,)

    @property
    def scale_block(self) -> tuple[int, int] | None:
        """A block scale's [rows, cols] (block formats), which the steps carry."""
        return None

    def cut_scale(self, c, target, weight_specs, weight_lays, index: dict, group: int, relayout):
        """Per rank (spec, layout) of the weight's scale `c`: the format's cut (see per_part.py, block_grid.py)."""
        raise NotImplementedError(type(self).__name__)

    def final_as_cut(self, companions) -> bool:
        """Whether the companions as cut are the final params (no step unless --dequantize)."""
        return not any(c.is_input for c in companions)

    # -- what build_plan asks (plan/quantization.py) -------------------------------------------------------

    def view(self, targets, tensors: dict, rules, config: dict) -> View:
        found = []
        for t, comps, quantized in scale_companions(targets, tensors, (self.scale_suffix,), self.static_input,
                                                    self.where):
            dtypes = sorted({tensors[s].dtype for s in t.sources})
            if quantized and dtypes != [self.stored_dtype]:
                odd = [s for s in t.sources if tensors[s].dtype != self.stored_dtype]   # the tensors to fix
                part = f" (part of {t.name})" if odd != [t.name] else ""
                raise PlanError(f"{names.describe(odd)}{part}: stored as "
                                f"{', '.join(sorted({tensors[s].dtype for s in odd}))} beside its "
                                f"{self.scale_suffix}, but {self.where} needs {self.stored_dtype} weights next to "
                                f"their scales; quantize it like the others or export the checkpoint again")
            if not quantized and self.stored_dtype in dtypes:
                raise PlanError(f"{t.name}: {self.stored_dtype} weights without "
                                f"{with_suffix(t.sources[0], self.scale_suffix)} ({self.where}); the checkpoint is "
                                f"missing its scales")
            found += comps
        return View(targets, tensors, tuple(found))

    def cut(self, view: View, planned: dict, targets: dict, layout, relayout) -> None:
        index = view.index
        for c in view.companions:
            bad = [s for s in c.sources if index[s].dtype not in FLOAT_SCALES]
            if bad:
                raise PlanError(f"{bad[0]}: a quantization scale stored as {index[bad[0]].dtype}; scales are float "
                                f"(F32, BF16, F16): the checkpoint is damaged or mislabelled")
        for c in view.companions:   # cut from the weight's own layout, so weight and scale shards always match
            t = targets[c.weight]
            if t.rule.transposed:   # its layout's pieces are of the stored [in, out]: a scale's rows are not there
                raise PlanError(f"{t.name}: a weight stored transposed ({t.rule.target}) with scales beside it "
                                f"({self.label()}) is not supported; dequantize the checkpoint first")
            w_specs, w_lays = planned[c.weight]
            if c.is_input:
                planned[c.name] = scalar_layouts(c, t, w_specs, index)
                continue
            group = layout.expert_group_size if t.rule.style == "expert" else layout.tp
            planned[c.name] = self.cut_scale(c, t, w_specs, w_lays, index, group, lambda q, n=t.name: relayout(n, q))

    def finalize(self, view: View, staging: RankSpecs, planned: dict, cuts, targets: dict):
        if not self.dequantize and self.final_as_cut(view.companions):
            # Final as cut: no rank rewrites anything, and the staging specs serve as the final ones.
            return staging, no_steps(staging), self.describe()
        final, post = self._steps(staging, planned, targets, view)
        return final, post, self.describe()

    def _steps(self, staging: RankSpecs, planned: dict, targets: dict, view: View) -> tuple[RankSpecs, RankValues]:
        """(final specs, steps) per group of ranks: each weight's groups rewritten once (weight-major, groups in
        rank order, so the first failure is the one a per-rank walk would meet)."""
        per_param = dict(staging.per_param)
        step_columns, padded_columns = [], []
        absent = RankValues([None], staging.world)
        scales: dict[str, dict] = {}
        for c in view.companions:
            scales.setdefault(c.weight, {})["input" if c.is_input else "weight"] = c
        for weight, roles in scales.items():
            scale, inp = roles.get("weight"), roles.get("input")
            group = self._group_steps(weight, targets[weight], scale, inp, view.index)
            made = per_group(group, *planned[weight],
                             *(staging.per_param[x.name] if x is not None else absent for x in (scale, inp)))
            step_columns.append(made.map(lambda m: m[0]))
            staged = [(x.name, staging.per_param[x.name]) for x in (scale, inp) if x is not None]
            padded_columns.append(per_group(_padded_inputs(weight, [n for n, _ in staged]), made,
                                            staging.per_param[weight], *(v for _, v in staged)))
            for k, x in ((1, weight), (2, scale and scale.name), (3, inp and inp.name)):
                if x is not None:
                    per_param[x] = made.map(lambda m, k=k: m[k])
        if not step_columns:
            return staging, RankValues([()], staging.world)
        padded = per_group(lambda *names_: sorted(set().union(*names_)), *padded_columns)
        for i in range(padded.period):
            if padded.value(i):
                raise PlanError(f"{names.describe(padded.value(i))}: a post-load step cannot read a zero-padded param")
        return (RankSpecs(per_param, staging.world),
                per_group(lambda *steps: tuple(itertools.chain(*steps)), *step_columns))

    def _group_steps(self, weight: str, target, scale, inp, index: dict):
        """fn(weight spec, layout, scale spec, input-scale spec) -> (steps, final weight spec, final scale spec,
        final input-scale spec; None: gone) of one group of ranks."""
        per_part = scale is not None and self.per_part_scales
        several, of_part = parts(target) > 1, part_of(target)

        def group(w, lay, s_spec, i_spec):
            if w.style == "expert" and not w.experts:
                return (), w, s_spec, i_spec  # this rank hosts no expert: nothing to rewrite
            steps_runs = covered_runs(lay, w, of_part) if per_part else ()
            if self.dequantize:
                inputs = (weight,) + tuple(x.name for x in (scale, inp) if x is not None)
                step = ScaleStep(self.dequantize_op, inputs, (weight,), steps_runs, self.scale_block)
                return (step,), replace(w, dtype=DEQUANTIZED_DTYPE), None, None
            steps = []   # a param of several parts holds one scale per part: fold them into one
            if per_part and several:
                steps.append(ScaleStep("requantize", (weight, scale.name), (weight, scale.name), steps_runs))
                s_spec = one_scale_spec(s_spec, w, index[scale.sources[0]].shape)
            if inp is not None and several:
                steps.append(ScaleStep("max", (inp.name,), (inp.name,)))
                i_spec = one_scale_spec(i_spec, w, index[inp.sources[0]].shape)
            return tuple(steps), w, s_spec, i_spec
        return group


def covered_runs(lay, spec, of_part: dict) -> tuple[tuple[int, int], ...]:
    """steps.runs, refused unless they cover the weight's local rows (every row needs its part's scale)."""
    found = runs(lay, spec, of_part)
    n_loc = spec.local_shape[-2] if len(spec.local_shape) == 3 else view2d(spec.local_shape)[0]
    if sum(r for r, _ in found) != n_loc:
        raise PlanError(f"{spec.name}: its pieces do not cover its {n_loc} local rows; cannot requantize per part")
    return found


def scalar_layouts(c, target, weight_specs, index: dict):
    """per_part.per_part_layouts of one-value scales (per-tensor weight scales, static input scales), checked."""
    entries = [index[s] for s in c.sources]
    not_scalar = [f"{e.name}{list(e.shape)}" for e in entries if math.prod(e.shape) != 1]
    if not_scalar:
        raise PlanError(f"{c.name}: per-tensor scales must hold one value, got {', '.join(not_scalar)}; "
                        f"check quantization_config (a block or channel scheme?)")
    dtypes = sorted({e.dtype for e in entries})
    if len(dtypes) > 1:
        raise PlanError(f"{c.name}: its parts' scales have different dtypes {dtypes}; the checkpoint contradicts "
                        f"itself")
    if target.rule.style == "expert" and target.rule.stacked:
        raise PlanError(f"{c.name}: per-tensor scales of experts stacked on disk are not supported; "
                        f"use a block-FP8 or per-expert checkpoint")
    return per_part_layouts(c, target, weight_specs, index, squeeze=True)


def _padded_inputs(weight: str, companions: list[str]):
    """fn(made, weight spec, companion specs...) -> the names a group's steps read that are zero-padded."""
    def padded(made, *specs) -> set[str]:
        staged = dict(zip([weight] + companions, specs))
        return {n for step in made[0] for n in step.inputs if staged[n].padding}
    return padded


def one_scale_spec(staged, weight_spec, scalar_shape):
    """The final spec of a per-part scale folded to one value (per expert for experts)."""
    if weight_spec.style == "expert":
        return replace(staged, dtype=SCALE_DTYPE, global_shape=(weight_spec.global_shape[0],),
                       local_shape=(len(weight_spec.experts),))
    # Every rank holds every part's (global) scale, so the max is the same everywhere: a replicated
    # param, which reconciliation fingerprints across ranks. Its shape is the checkpoint's scalar's.
    return replace(staged, style="replicate", dtype=SCALE_DTYPE, global_shape=tuple(scalar_shape),
                   local_shape=tuple(scalar_shape))


def matrices(t: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [1, N, K]; [E, N, K] as it is: one code path for dense and expert weights."""
    return t.unsqueeze(0) if t.dim() == 2 else t


def _max(step, finals, scales):
    """Per-part static input scales -> their max (per expert for experts)."""
    return (scales.reshape(math.prod(finals[0].local_shape), -1).float().amax(dim=1),)


SCALED_OPS = {"max": _max}
