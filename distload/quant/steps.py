"""What every format's post-load steps share: the step with its parameters, and where each fused part lies.

A fused param (qkv_proj, gate_up_proj, w13) holds one scale per part in a per-part format (per-tensor FP8,
NVFP4's global scale): a step that rewrites or dequantizes it must know which local rows came from which part.
`runs` reads that off the weight's layout once, while planning, as (rows, part) down one local matrix.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..plan.shard import LocalLayout, view2d
from ..plan.types import Step


@dataclass(frozen=True)
class ScaleStep(Step):
    """A step of the scaled formats (scaled.py) and of online quantization: runs, for a per-part scale (which
    rows each part's scale covers); block, for a block scale's [rows, cols]."""
    runs: tuple[tuple[int, int], ...] = ()
    block: tuple[int, int] | None = None


def part_of(target) -> dict[str, int]:
    """Each source of the target -> the index of the part it is (per expert: the part within the expert)."""
    if target.rule.style == "expert" and target.expert_sources:
        return {s: j for parts in target.expert_sources for j, s in enumerate(parts)}
    return {s: i for i, s in enumerate(target.sources)}


def parts(target) -> int:
    """Parts per rank-local matrix: one per weight source (per expert: one per part)."""
    if target.rule.style == "expert" and target.expert_sources:
        return len(target.expert_sources[0])
    return len(target.sources)


def runs(lay: LocalLayout, spec, part_of_source: dict) -> tuple[tuple[int, int], ...]:
    """(rows, part) down the first local matrix of a weight, neighbours of one part merged; a row-split piece is
    counted once, by its piece at column 0."""
    n_loc = spec.local_shape[-2] if len(spec.local_shape) == 3 else view2d(spec.local_shape)[0]
    out: list[list[int]] = []
    for pc in sorted((p for p in lay.pieces if p.dst_row < n_loc and not p.dst_col), key=lambda p: p.dst_row):
        part = part_of_source[pc.source]
        if out and out[-1][1] == part:
            out[-1][0] += pc.rows[1] - pc.rows[0]
        else:
            out.append([pc.rows[1] - pc.rows[0], part])
    return tuple((r, p) for r, p in out)


def no_steps(staging) -> list[tuple]:
    """Per rank: nothing to run (the staged params are the final ones)."""
    return [() for _ in staging]
