"""What one trainer rank holds of each checkpoint tensor, as boxes of the tensor's 2-D view.

A trainer describes its tensors as DTensors (FSDP2 `fully_shard`: Shard(0); tensor parallel placements on a
DeviceMesh; both, where FSDP2 marks its dim-0 split of a TP shard _StridedShard), as `Piece(local, offsets,
global_shape)`, or as full tensors (replicated, as DDP holds them). Each becomes `Held(dtype, shape, boxes)`:
box (row0, row1, col0, col1, local_row0, local_col0) says rows x cols of the global 2-D view
([prod(shape[:-1]), shape[-1]], plan/shard.view2d) sit at (local_row0, local_col0) of the local tensor's
2-D view. Only metadata: the local bytes stay where they are until a route asks for them.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from ..dtypes import TORCH_TO_SAFETENSORS
from ..errors import DistloadError
from ..plan.shard import view2d


class Piece(NamedTuple):
    """A plain local tensor that is the box [offsets, offsets + local.shape) of a global tensor."""
    local: torch.Tensor
    offsets: tuple[int, ...]
    global_shape: tuple[int, ...]


class Held(NamedTuple):
    dtype: str                                   # safetensors dtype name
    shape: tuple[int, ...]                       # the global (checkpoint) shape
    boxes: tuple[tuple[int, int, int, int, int, int], ...]


def named_tensors(tensors) -> dict:
    """An nn.Module's params (a tied param once, under its first name) or the given mapping."""
    if isinstance(tensors, torch.nn.Module):
        return {name: p.detach() for name, p in tensors.named_parameters()}
    return dict(tensors)


def describe(tensors: dict) -> dict[str, Held]:
    return {name: _held(name, t) for name, t in sorted(tensors.items())}


def local_view(t) -> torch.Tensor:
    """The local bytes of a held tensor as its 2-D view (what a box's local coordinates index)."""
    local = t.local if isinstance(t, Piece) else t.to_local() if _is_dtensor(t) else t
    local = local.detach()
    return local.reshape(view2d(tuple(local.shape)))


def _is_dtensor(t) -> bool:
    return type(t).__name__ == "DTensor" and hasattr(t, "placements")


def _held(name: str, t) -> Held:
    if isinstance(t, Piece):
        shape, local = tuple(t.global_shape), t.local
        if len(t.offsets) != len(shape) or local.dim() != len(shape):
            raise DistloadError(f"refit: Piece {name!r}: offsets {tuple(t.offsets)} and local shape "
                                f"{tuple(local.shape)} must have one entry per dim of global_shape {shape}")
        ranges = [[(o, o + n)] for o, n in zip(t.offsets, local.shape)]
    elif _is_dtensor(t):
        shape, local = tuple(t.shape), t.to_local()
        ranges = _dtensor_ranges(name, t)
    elif isinstance(t, torch.Tensor):
        shape, local = tuple(t.shape), t
        ranges = [[(0, n)] for n in shape]
    else:
        raise DistloadError(f"refit: {name!r} is a {type(t).__name__}; send a tensor, a DTensor or a "
                            f"distload.refit.Piece")
    if local.dtype not in TORCH_TO_SAFETENSORS:
        raise DistloadError(f"refit: {name!r} has dtype {local.dtype}, which distload does not support")
    for d, (runs, n) in enumerate(zip(ranges, shape)):
        if any(not 0 <= a <= b <= n for a, b in runs):
            raise DistloadError(f"refit: {name!r} holds dim {d} rows {runs}, outside its global shape {shape}")
    return Held(TORCH_TO_SAFETENSORS[local.dtype], shape, _boxes(name, shape, ranges))


def _dtensor_ranges(name: str, t) -> list[list[tuple[int, int]]]:
    """Per dim, the runs of global indices this rank's local tensor holds, in local order."""
    mesh = t.device_mesh
    coord = mesh.get_coordinate()
    if coord is None:
        return [[] for _ in t.shape]   # this rank is not in the mesh: it holds nothing
    ranges = placement_ranges(name, tuple(t.shape), tuple(t.placements), tuple(mesh.shape), tuple(coord))
    local = tuple(t.to_local().shape)
    got = tuple(sum(b - a for a, b in runs) for runs in ranges)
    if got != local:
        raise DistloadError(f"refit: {name!r}: its placements {tuple(t.placements)} give a local shape {got}, "
                            f"the local tensor is {local}")
    return ranges


def placement_ranges(name: str, shape: tuple, placements: tuple, mesh_shape: tuple, coord: tuple) -> list:
    """Per dim, the runs of global indices mesh coordinate `coord` holds under DTensor `placements`.

    Shard(d) splits what the earlier mesh dims left of dim d as torch.chunk does. _StridedShard(d, sf) (FSDP2
    over a TP shard: torch >= 2.13 no longer makes it a Shard) is the split applied last, to what the sf shards
    of the later mesh dims left, as FSDP2 cuts its local TP shard: so it is applied after every plain Shard."""
    ranges = [[(0, n)] for n in shape]
    plain = [m for m, p in enumerate(placements) if not _strided(p)]
    strided = [m for m, p in enumerate(placements) if _strided(p)]
    for m in plain + strided[::-1]:
        p = placements[m]
        if p.is_replicate():
            continue
        if not (p.is_shard() or _strided(p)):
            raise DistloadError(f"refit: {name!r} is a DTensor with placement {p} on mesh dim {m}; send it "
                                f"reduced (Replicate or Shard), e.g. .redistribute() or .full_tensor()")
        if _strided(p):
            _check_split_factor(name, placements, mesh_shape, m)
        d, n = p.dim, mesh_shape[m]
        total = sum(b - a for a, b in ranges[d])
        size = math.ceil(total / n) if total else 0   # torch.chunk's split, as DTensor's Shard and FSDP2's
        ranges[d] = _take(ranges[d], min(coord[m] * size, total), min((coord[m] + 1) * size, total))
    return ranges


def _strided(p) -> bool:
    return type(p).__name__ == "_StridedShard"


def _check_split_factor(name: str, placements: tuple, mesh_shape: tuple, m: int) -> None:
    """A strided shard on mesh dim m must split what exactly the later mesh dims' shards of its dim made."""
    d = placements[m].dim
    later = [k for k in range(m + 1, len(placements)) if placements[k].is_shard() and placements[k].dim == d]
    earlier = [k for k in range(m) if placements[k].is_shard() and placements[k].dim == d]
    if earlier or placements[m].split_factor != math.prod(mesh_shape[k] for k in later):
        raise DistloadError(f"refit: {name!r} has placements {placements} on a mesh of {mesh_shape}: a "
                            f"_StridedShard distload reads only as FSDP2 makes it (split factor = the later mesh "
                            f"dims' shards of dim {d}); send it redistributed to Shard / Replicate placements")


def _take(runs: list[tuple[int, int]], start: int, stop: int) -> list[tuple[int, int]]:
    """Positions [start, stop) of the indices the runs list, in order, as runs."""
    out, at = [], 0
    for a, b in runs:
        lo, hi = max(start - at, 0), min(stop - at, b - a)
        if lo < hi:
            out.append((a + lo, a + hi))
        at += b - a
    return out


def _boxes(name: str, shape: tuple, ranges: list) -> tuple:
    """Per-dim runs -> boxes of the 2-D view, with where each starts in the local 2-D view."""
    if any(not runs for runs in ranges) or any(a == b for runs in ranges for a, b in runs):
        return ()
    if len(shape) <= 1:
        rows = ranges[0] if shape else [(0, 1)]
        cols, inner = [(0, 1)], 1
    else:
        inner = math.prod(shape[1:-1])
        if any(runs != [(0, n)] for runs, n in zip(ranges[1:-1], shape[1:-1])):
            raise DistloadError(f"refit: {name!r} is split along a middle dim of {shape}; split dim 0 or the "
                                f"last dim (or send a Piece per contiguous block)")
        rows, cols = ranges[0], ranges[-1]
    boxes, local_row = [], 0
    for r0, r1 in rows:
        local_col = 0
        for c0, c1 in cols:
            boxes.append((r0 * inner, r1 * inner, c0, c1, local_row, local_col))
            local_col += c1 - c0
        local_row += (r1 - r0) * inner
    return tuple(boxes)
