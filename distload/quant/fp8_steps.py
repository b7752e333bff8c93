"""Final specs and post-load steps: what the transfer writes (staging) -> what the caller gets (final).

`finalize` turns each rank's *staging* specs into its *final* specs (what the caller gets, the manifest
records and reconciliation checks) plus a list of `Step`s that postprocess.py runs on the rank as soon
as their inputs have arrived:

    checkpoint per-tensor  fused param: requantize each part to the max scale -> one weight_scale;
                           input_scale -> max of the parts (a single-source param keeps its scalars)
    checkpoint block       nothing: weight and weight_scale_inv are final as cut
    --quantize fp8         every linear weight (QUANTIZED_STYLES) -> fp8 + its own weight_scale per rank
    --quantize fp8-block   the same with weight_scale_inv [ceil(n/128), ceil(k/128)] of the local shard
    --dequantize           fp8 weight (+ its scales) -> BF16 weight; the scales are gone
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

from ..rules import names
from ..errors import PlanError
from .fp8 import (DEQUANTIZED_DTYPE, FP8, HIGH_PRECISION, QUANTIZED_STYLES, SCALE_DTYPE, Companion, Scheme,
                  online_scheme, with_suffix)
from .fp8_layouts import block_scale_shape
from ..plan.ranks import RankSpecs, RankValues, per_group
from ..plan.shard import LocalLayout, view2d
from ..plan.types import ParamSpec

@dataclass(frozen=True)
class Step:
    """One post-load rewrite on one rank; runs once every input has fully arrived.

    op: requantize (fused fp8 weight + per-part scales -> one scale), max (per-part input scales -> one),
    quantize / quantize_block (online), dequantize / dequantize_block. Inputs that are not final params
    are released after the step; outputs replace the params of the same name.
    """
    op: str
    inputs: tuple[str, ...]            # staging params read (the weight first)
    outputs: tuple[str, ...]           # final params written (the weight first, then its scale)
    runs: tuple[tuple[int, int], ...] = ()   # per-tensor: (rows, part) down one local matrix, in row order
    block: tuple[int, int] | None = None



def _runs(lay: LocalLayout, spec, part_of: dict) -> tuple[tuple[int, int], ...]:
    """(rows, part) down the first local matrix of a weight, merging neighbours of the same part."""
    n_loc = spec.local_shape[-2] if len(spec.local_shape) == 3 else view2d(spec.local_shape)[0]
    runs: list[list[int]] = []
    for pc in sorted((p for p in lay.pieces if p.dst_row < n_loc), key=lambda p: (p.dst_row, p.dst_col)):
        if pc.dst_col:
            continue  # a row-split piece: its rows are already counted by the piece at column 0
        part = part_of[pc.source]
        if runs and runs[-1][1] == part:
            runs[-1][0] += pc.rows[1] - pc.rows[0]
        else:
            runs.append([pc.rows[1] - pc.rows[0], part])
    if sum(r for r, _ in runs) != n_loc:
        raise PlanError(f"{spec.name}: its pieces do not cover its {n_loc} local rows; cannot requantize per part")
    return tuple((r, p) for r, p in runs)


def _part_of(target) -> dict[str, int]:
    if target.rule.style == "expert" and target.expert_sources:
        return {s: j for parts in target.expert_sources for j, s in enumerate(parts)}
    return {s: i for i, s in enumerate(target.sources)}


def finalize(staging: RankSpecs, planned: dict, targets: dict, comps: list[Companion], tensors: dict,
             scheme: Scheme | None, quantize: str | None = None, dequantize: bool = False):
    """(final specs per rank, steps per rank, what the load does about quantization) from the staging specs:
    per group of ranks (RankSpecs, RankValues).

    planned: name -> (per-rank specs, per-rank layouts) of every planned param; targets: name -> Target.
    """
    online = online_scheme(quantize)
    if online and scheme:
        raise PlanError(f"--quantize {quantize}: the checkpoint is already quantized ({scheme.describe()}); "
                        f"drop --quantize")
    if dequantize and online:
        raise PlanError("--quantize and --dequantize contradict each other; pass one")
    if dequantize and not scheme:
        raise PlanError("--dequantize: the checkpoint is not quantized (config.json has no quantization_config); "
                        "drop --dequantize")
    if not online and not scheme:
        return staging, [() for _ in staging], None
    if scheme and scheme.block and not dequantize and not any(c.role == "input" for c in comps):
        # Block scales are cut with their weights and final as cut: no rank rewrites anything (and the
        # staging specs serve as the final ones, never copied per rank).
        return staging, [() for _ in staging], scheme.describe()
    if online:
        final, post = _online(staging, online)
        return final, post, online.describe()
    by_weight: dict[str, dict[str, Companion]] = {}
    for c in comps:
        by_weight.setdefault(c.weight, {})[c.role] = c
    final, post = _checkpoint_steps(staging, planned, targets, by_weight, tensors, scheme, dequantize)
    return final, post, scheme.describe() + (" -> BF16 (--dequantize)" if dequantize else "")


def _checkpoint_steps(staging: RankSpecs, planned: dict, targets: dict, by_weight: dict, tensors: dict,
                      scheme: Scheme, dequantize: bool) -> tuple[RankSpecs, RankValues]:
    """(final specs, steps) per group of ranks for a quantized checkpoint: each weight's groups are rewritten
    once (weight-major, groups in rank order, so the first failure is the one a per-rank walk would meet)."""
    per_param = dict(staging.per_param)
    step_columns, padded_columns = [], []
    absent = RankValues([None], staging.world)
    for weight, roles in by_weight.items():
        w_specs, w_lays = planned[weight]
        part_of = _part_of(targets[weight])
        scale, inp = roles.get("weight"), roles.get("input")
        per_part = scale is not None and not scheme.block
        several = _parts(targets[weight]) > 1

        def group(w, lay, s_spec, i_spec, weight=weight, scale=scale, inp=inp, part_of=part_of, per_part=per_part,
                  several=several):
            """(steps, final weight spec, final scale spec, final input-scale spec; None: gone) of one group."""
            if w.style == "expert" and not w.experts:
                return (), w, s_spec, i_spec  # this rank hosts no expert: nothing to rewrite
            runs = _runs(lay, w, part_of) if per_part else ()
            if dequantize:
                op = "dequantize_block" if scheme.block else "dequantize"
                inputs = (weight,) + tuple(x.name for x in (scale, inp) if x is not None)
                return (Step(op, inputs, (weight,), runs, scheme.block),), replace(w, dtype=DEQUANTIZED_DTYPE), None, None
            # A param with several weight sources holds one scale per part: fold them into one.
            steps = []
            if per_part and several:
                steps.append(Step("requantize", (weight, scale.name), (weight, scale.name), runs))
                s_spec = _one_scale_spec(s_spec, w, tensors[scale.sources[0]].shape)
            if inp is not None and several:
                steps.append(Step("max", (inp.name,), (inp.name,)))
                i_spec = _one_scale_spec(i_spec, w, tensors[inp.sources[0]].shape)
            return tuple(steps), w, s_spec, i_spec
        made = per_group(group, w_specs, w_lays,
                         *(staging.per_param[x.name] if x is not None else absent for x in (scale, inp)))
        step_columns.append(made.map(lambda m: m[0]))
        staged = [(x.name, staging.per_param[x.name]) for x in (roles.get("weight"), inp) if x is not None]
        padded_columns.append(per_group(_padded_inputs(weight, [n for n, _ in staged]), made,
                                        staging.per_param[weight], *(v for _, v in staged)))
        for k, x in ((1, weight), (2, scale and scale.name), (3, inp and inp.name)):
            if x is not None:
                per_param[x] = made.map(lambda m, k=k: m[k])
    if not step_columns:
        return staging, RankValues([()], staging.world)
    padded = per_group(lambda *names: sorted(set().union(*names)), *padded_columns)
    for i in range(padded.period):
        if padded.value(i):
            raise PlanError(f"{names.describe(padded.value(i))}: a post-load step cannot read a zero-padded param")
    return RankSpecs(per_param, staging.world), per_group(lambda *steps: tuple(itertools.chain(*steps)), *step_columns)


def _padded_inputs(weight: str, companions: list[str]):
    """fn(made, weight spec, companion specs...) -> the names a group's steps read that are zero-padded."""
    def padded(made, *specs) -> set[str]:
        staged = dict(zip([weight] + companions, specs))
        return {n for step in made[0] for n in step.inputs if staged[n].padding}
    return padded


def _parts(target) -> int:
    """Scales per rank-local matrix before folding: one per weight source (per expert: one per part)."""
    if target.rule.style == "expert" and target.expert_sources:
        return len(target.expert_sources[0])
    return len(target.sources)


def _one_scale_spec(staged, weight_spec, scalar_shape):
    """The final spec of a per-part scale folded to one value (per expert for experts)."""
    if weight_spec.style == "expert":
        return replace(staged, dtype=SCALE_DTYPE, global_shape=(weight_spec.global_shape[0],),
                       local_shape=(len(weight_spec.experts),))
    # Every rank holds every part's (global) scale, so the max is the same everywhere: a replicated
    # param, which reconciliation fingerprints across ranks. Its shape is the checkpoint's scalar's.
    return replace(staged, style="replicate", dtype=SCALE_DTYPE, global_shape=tuple(scalar_shape),
                   local_shape=tuple(scalar_shape))


def _online(staging: RankSpecs, scheme: Scheme) -> tuple[RankSpecs, RankValues]:
    """(final specs, steps) per group of ranks for --quantize: each linear weight's groups are rewritten once
    (param-major, groups in rank order), its scale added after the staged params as a per-rank walk would."""
    per_param, step_columns = dict(staging.per_param), []
    absent = RankValues([None], staging.world)
    for name, values in staging.per_param.items():
        scale = with_suffix(name, scheme.weight_scale)

        def group(w, existing, name=name, scale=scale):
            """(step, final weight spec, scale spec) of one group; step None: not a quantized weight here."""
            if (w is None or w.alias_of or w.style not in QUANTIZED_STYLES or len(w.local_shape) not in (2, 3)
                    or not name.endswith("weight") or (w.style == "expert") != (len(w.local_shape) == 3)):
                return None, w, None
            if w.dtype not in HIGH_PRECISION:
                raise PlanError(f"--quantize {scheme.name}: {name} is {w.dtype}; online quantization reads "
                                f"{', '.join(HIGH_PRECISION)} checkpoints")
            if existing is not None:
                raise PlanError(f"--quantize {scheme.name}: {scale} already exists in the checkpoint's layout")
            if w.padding:
                raise PlanError(f"--quantize {scheme.name}: {name} is zero-padded; it cannot be quantized while loading")
            if scheme.block:
                local = block_scale_shape(w.local_shape, scheme.block)
                glob = block_scale_shape(w.global_shape, scheme.block)
                op = "quantize_block"
            else:  # one scale per rank-local matrix: per expert for experts, else one scalar
                experts = w.style == "expert"
                local, glob = ((len(w.experts),), (w.global_shape[0],)) if experts else ((), ())
                op = "quantize"
            return (Step(op, (name,), (name, scale), block=scheme.block), replace(w, dtype=FP8),
                    ParamSpec(scale, w.style, SCALE_DTYPE, glob, local, experts=w.experts))
        made = per_group(group, values, staging.per_param.get(scale, absent))
        if all(made.value(i)[0] is None for i in range(made.period)):
            continue
        per_param[name] = made.map(lambda m: m[1])
        per_param[scale] = made.map(lambda m: m[2])
        step_columns.append(made.map(lambda m: m[0]))
    if not step_columns:
        return staging, RankValues([()], staging.world)
    return RankSpecs(per_param, staging.world), per_group(lambda *steps: tuple(s for s in steps if s is not None),
                                                         *step_columns)
