"""distload.plan.shard: the styles and mappings added for real architectures: storage transposed (GPT-2
Conv1D, GPT-OSS stacked experts), rank0 (a bias the group sums), qkv_packed (InternLM2 wqkv)."""

from __future__ import annotations

import pytest
import torch

from distload.errors import PlanError
from distload.plan.shard import LocalLayout, Part, Piece, cut
from plan_checks import arange_sources, materialise


# ----------------------------------------------------------------------------------------------------
# Sources stored transposed (GPT-2 Conv1D, GPT-OSS stacked experts)


@pytest.mark.parametrize("style,p", [("column", 2), ("row", 2), ("column", 4), ("merged", 2)])
def test_a_transposed_layout_is_the_cut_of_the_stored_tensor_transposed(style, p):
    from distload.plan.shard import transpose_layout

    serving = {"a": (8, 6), "b": (8, 6)}
    stored = arange_sources({n: (c, r) for n, (r, c) in serving.items()})     # [in, out] on disk
    names = ["a", "b"] if style == "merged" else ["a"]
    parts = [Part(n, 0, 8, 6) for n in names]
    for r in range(p):
        lay = cut(style, parts, p, r, "w")
        want = materialise(lay, {n: t.t() for n, t in stored.items()})   # the serving-orientation cut
        staged = materialise(transpose_layout(lay, serving, lay.rows), stored)
        assert torch.equal(staged.t(), want)


def test_a_transposed_layout_keeps_stacked_matrices_apart():
    """Two experts stacked on disk as [E, in, out]: each piece stays inside its expert's stored matrix."""
    from distload.plan.shard import transpose_layout

    stored = torch.arange(2 * 6 * 8, dtype=torch.float64).reshape(2, 6, 8)    # [E, in=6, out=8]
    serving = stored.transpose(1, 2)                                          # [E, 8, 6]
    parts = [Part("w", e * 8, 8, 6) for e in range(2)]
    lays = [cut("column", [part], 2, 1, "w") for part in parts]              # rank 1: rows 4..8 of each expert
    pieces = tuple(Piece(pc.source, pc.rows, pc.cols, pc.dst_row + slot * 4, pc.dst_col)
                   for slot, lay in enumerate(lays) for pc in lay.pieces)
    staged = transpose_layout(LocalLayout(8, 6, pieces), {"w": (8, 6)}, 4)
    got = materialise(staged, {"w": stored.reshape(12, 8)}).reshape(2, 6, 4).transpose(1, 2)
    assert torch.equal(got, serving[:, 4:8, :])
    with pytest.raises(PlanError, match="spans two stacked matrices"):
        transpose_layout(LocalLayout(16, 6, (Piece("w", (4, 12), (0, 6), 0, 0),)), {"w": (8, 6)}, 16)


def test_rank0_holds_the_whole_tensor_and_the_others_zeros():
    src = arange_sources({"b": (8, 1)})
    parts = [Part("b", 0, 8, 1)]
    assert torch.equal(materialise(cut("rank0", parts, 4, 0, "b"), src), src["b"])
    for r in (1, 2, 3):
        lay = cut("rank0", parts, 4, r, "b")
        assert lay.pieces == () and lay.padding == ((0, 8, 0, 1),)
        assert not materialise(lay, src).any()


@pytest.mark.parametrize("heads,kv,p", [(4, 2, 1), (4, 2, 2), (4, 2, 4), (8, 2, 4), (4, 1, 2), (8, 4, 8)])
def test_qkv_packed_unpacks_the_kv_groups_into_the_qkv_layout(heads, kv, p):
    """InternLM2 wqkv (per kv head: its q heads, k, v) -> cat[q_r, k_r, v_r], as `qkv` cuts separate q/k/v."""
    hd, cols = 2, 3
    src = arange_sources({"w": ((heads + 2 * kv) * hd, cols)})
    packed = src["w"].reshape(kv, heads // kv + 2, hd, cols)
    q, k, v = (x.reshape(-1, cols) for x in packed.split([heads // kv, 1, 1], dim=1))
    plain = {"q": q, "k": k, "v": v}
    for r in range(p):
        want = materialise(cut("qkv", [Part(n, 0, t.shape[0], cols) for n, t in plain.items()], p, r, "w",
                               heads=heads, kv_heads=kv), plain)
        lay = cut("qkv_packed", [Part("w", 0, (heads + 2 * kv) * hd, cols)], p, r, "w", heads=heads, kv_heads=kv)
        assert torch.equal(materialise(lay, src), want)
