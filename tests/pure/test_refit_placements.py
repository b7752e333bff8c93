"""What a trainer rank holds of a DTensor, from its placements alone (refit/holdings.placement_ranges), against
the local tensors torch makes: DTensor's Shard splits (torch's own _split_tensor) mesh dim by mesh dim, and for
FSDP2 over tensor parallelism, (_StridedShard(0, sf=tp), Shard(0)), FSDP2's torch.chunk of the local TP shard
(FSDP2 makes its shard that way; torch's left-to-right reading of _StridedShard differs where the splits are
uneven, and to_local() is what FSDP2 made). torch 2.13 no longer makes _StridedShard a Shard: a check of
is_shard() alone refused every FSDP2 + TP param."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard, _StridedShard

from distload.errors import DistloadError
from distload.refit.holdings import placement_ranges

LAYOUTS = [   # (mesh shape, placements): FSDP2 alone, TP alone, FSDP2 + TP (col / row parallel), HSDP + TP
    ((4,), (Shard(0),)),
    ((2, 2), (_StridedShard(0, split_factor=2), Shard(0))),
    ((2, 2), (Shard(0), Shard(1))),
    ((2, 4), (_StridedShard(0, split_factor=4), Shard(0))),
    ((2, 2, 2), (Replicate(), _StridedShard(0, split_factor=2), Shard(0))),
    ((3, 2), (_StridedShard(0, split_factor=2), Shard(0))),
]


def torch_local(rows: torch.Tensor, placements: tuple, mesh_shape: tuple, coord: tuple) -> torch.Tensor:
    """The local tensor of mesh coordinate `coord` as torch makes it: the Shard placements split by DTensor in
    mesh order (tensor parallelism first), then a _StridedShard's dim as FSDP2 cuts its local shard."""
    local = rows
    strided = [m for m, p in enumerate(placements) if isinstance(p, _StridedShard)]
    for m in [m for m in range(len(placements)) if m not in strided] + strided[::-1]:
        p = placements[m]
        if p.is_replicate():
            continue
        pieces, _ = Shard(p.dim)._split_tensor(local, mesh_shape[m], with_padding=False)
        local = pieces[coord[m]]
    return local


@pytest.mark.parametrize("mesh_shape,placements", LAYOUTS)
@pytest.mark.parametrize("n_rows", [250, 64, 7, 5, 1])
def test_ranges_are_the_rows_torch_places_on_each_coordinate(mesh_shape, placements, n_rows):
    shape = (n_rows, 6)
    rows = torch.arange(n_rows).unsqueeze(1).expand(shape)
    cols = torch.arange(6).unsqueeze(0).expand(shape)
    for coord in itertools.product(*map(range, mesh_shape)):
        ranges = placement_ranges("w", shape, placements, mesh_shape, coord)
        want_rows = torch_local(rows, placements, mesh_shape, coord)
        want_cols = torch_local(cols, placements, mesh_shape, coord)
        got_rows = [r for a, b in ranges[0] for r in range(a, b)]
        got_cols = [c for a, b in ranges[1] for c in range(a, b)]
        assert list(want_rows.shape) == [len(got_rows), len(got_cols)], (coord, ranges)
        if want_rows.numel():
            assert want_rows[:, 0].tolist() == got_rows and want_cols[0].tolist() == got_cols, (coord, ranges)


def test_an_uneven_fsdp2_split_of_tp_shards_is_fsdp2s_not_the_left_to_right_reading():
    """7 rows, tp 2 (4 + 3 rows), FSDP2 over 3 ranks: it chunks each TP shard (2, 2, 0 and 1, 1, 1); torch's
    left-to-right reading of (_StridedShard(0, sf=2), Shard(0)) would put row 6 on (2, 0)."""
    want = {(0, 0): [0, 1], (1, 0): [2, 3], (2, 0): [], (0, 1): [4], (1, 1): [5], (2, 1): [6]}
    placements = (_StridedShard(0, split_factor=2), Shard(0))
    for coord, rows in want.items():
        ranges = placement_ranges("w", (7, 6), placements, (3, 2), coord)
        assert [r for a, b in ranges[0] for r in range(a, b)] == rows, coord


def test_placements_it_cannot_read_are_refused_by_name():
    with pytest.raises(DistloadError, match=r"'w' is a DTensor with placement .* on mesh dim 1; send it reduced"):
        placement_ranges("w", (8, 8), (Shard(0), Partial()), (2, 2), (0, 0))
    with pytest.raises(DistloadError, match=r"'w' has placements .*split factor = the later mesh dims' shards"):
        placement_ranges("w", (8, 8), (_StridedShard(0, split_factor=4), Shard(0)), (2, 2), (0, 0))
