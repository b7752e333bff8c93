"""Params the checkpoint stores transposed (rule key `transposed`): GPT-2's Conv1D [in, out], GPT-OSS's stacked
experts [E, in, out], while serving wants [out, in] / [E, out, in].

Why stage and transpose, not transpose while copying: every piece then stays a plain rectangle of its source
(readers, the wire and the receivers' copies know no orientation), and each rank transposes only its own
shard, once, after it has landed. The cut is planned in serving orientation (shapes, `split` and styles are
written as serving sees them); shard.transpose_layout maps each piece onto the stored tensor, the staging
param is the local shard transposed, and a post-load `transpose` step turns it into the final param.
"""

from __future__ import annotations

from dataclasses import replace

from ..errors import PlanError
from .parts import oriented_shape, vector_experts
from .ranks import RankSpecs, RankValues, per_group
from .shard import LocalLayout, transpose_layout, view2d
from .types import ParamSpec, Step


def swapped(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(shape[:-2]) + (shape[-1], shape[-2]) if len(shape) >= 2 else tuple(shape)


def stored_layout(lay: LocalLayout, target, index, dst_matrix_rows: int, num_experts: int = 1) -> LocalLayout:
    """`lay` (serving orientation) as pieces of the stored sources, when the target's rule is transposed; also
    for vector experts, cut as [experts * n, 1] and stored [experts, n] (the same bytes, no transpose step)."""
    rule = target.rule
    if not rule.transposed and not vector_experts(target, index):
        return lay
    per_source = num_experts if rule.stacked else 1
    matrices = {}
    for s in target.sources:
        rows, cols = view2d(oriented_shape(index[s].shape, rule.transposed, f"{target.name}: {s}", rule.stacked))
        matrices[s] = (rows // per_source, cols)
    return transpose_layout(lay, matrices, dst_matrix_rows)


def stage(staging, post: list[tuple], targets: dict):
    """(staging specs, post steps) per rank with every transposed param staged in stored orientation and a
    `transpose` step to its final spec; quantized transposed params are refused (their scales follow the weight).
    staging: RankSpecs, or per rank {name: spec}; a RankSpecs without post steps stays one (per group of ranks)."""
    names = sorted(n for n, t in targets.items() if t.rule.transposed)
    if not names:
        return staging, post
    if isinstance(staging, RankSpecs) and not any(post):
        return _staged_per_group(staging, post, names)
    out_staging, out_post = [], []
    for specs, steps in zip(staging, post):
        touched = {n for step in steps for n in step.inputs + step.outputs}
        clash = [n for n in names if n in touched]
        if clash:
            raise PlanError(f"{clash[0]}: a transposed param cannot also be quantized or dequantized while loading; "
                            f"load the checkpoint unquantized")
        specs, steps = dict(specs), list(steps)
        for n in names:
            spec = specs.get(n)
            if spec is None or len(spec.local_shape) < 2:
                continue
            specs[n] = _staged(n, spec)
            steps.append(Step("transpose", (n,), (n,)))
        out_staging.append(specs)
        out_post.append(tuple(steps))
    return out_staging, out_post


def _staged(name: str, spec: ParamSpec) -> ParamSpec:
    """A transposed param's staging spec: its shapes in stored orientation."""
    if spec.padding:
        raise PlanError(f"{name}: a transposed param cannot have zero-padded regions (style {spec.style})")
    return replace(spec, global_shape=swapped(spec.global_shape), local_shape=swapped(spec.local_shape))


def _staged_per_group(staging: RankSpecs, post, names: list[str]) -> tuple[RankSpecs, RankValues]:
    """stage() for specs stored per group of ranks: each group's staging specs and steps made once, groups in
    rank order (so the first failure names the param the per-rank walk would)."""
    present = [n for n in names if n in staging.per_param]
    if not present:
        return staging, post

    def group(*specs) -> tuple[tuple, tuple[Step, ...]]:
        out, steps = [], []
        for n, spec in zip(present, specs):
            if spec is not None and len(spec.local_shape) >= 2:
                spec = _staged(n, spec)
                steps.append(Step("transpose", (n,), (n,)))
            out.append(spec)
        return tuple(out), tuple(steps)
    made = per_group(group, *(staging.per_param[n] for n in present))
    per_param = dict(staging.per_param)
    for k, n in enumerate(present):
        per_param[n] = made.map(lambda m, k=k: m[0][k])
    return RankSpecs(per_param, staging.world), made.map(lambda m: m[1])
