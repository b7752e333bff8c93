"""distload.plan.shard: pure style math on 2-D views (DESIGN §4.1).

Sources are filled with `arange + offset` (offset 10_000 per source), so a misplaced element tells which
source and which element it came from. Each rank's local tensor is materialised from its pieces and
compared with an expected slice written independently (plain slices and torch.cat).
"""

from __future__ import annotations

import itertools
import re

import pytest
import torch

from distload.errors import DistloadError, PlanError
from distload.plan.shard import CUTS, LocalLayout, Part, Piece, cut, padded_vocab, view2d
from plan_checks import arange_sources, materialise


# ----------------------------------------------------------------------------------------------------
# Helpers


def check_tiling(layout: LocalLayout, sources: dict[str, torch.Tensor]) -> None:
    """Pieces never overlap, stay inside source and destination, and with the padding cover the local tensor."""
    count = torch.zeros(layout.rows, layout.cols, dtype=torch.int64)
    for pc in layout.pieces:
        rows, cols = sources[pc.source].shape
        assert 0 <= pc.rows[0] < pc.rows[1] <= rows, pc
        assert 0 <= pc.cols[0] < pc.cols[1] <= cols, pc
        nr, nc = pc.rows[1] - pc.rows[0], pc.cols[1] - pc.cols[0]
        assert pc.dst_row >= 0 and pc.dst_col >= 0 and pc.dst_row + nr <= layout.rows and pc.dst_col + nc <= layout.cols
        assert pc.numel == nr * nc
        count[pc.dst_row:pc.dst_row + nr, pc.dst_col:pc.dst_col + nc] += 1
    pad = torch.zeros_like(count)
    for r0, r1, c0, c1 in layout.padding:
        assert 0 <= r0 < r1 <= layout.rows and 0 <= c0 < c1 <= layout.cols
        pad[r0:r1, c0:c1] += 1
    assert pad.numel() == 0 or int(pad.max()) <= 1, "padding regions overlap"
    assert torch.equal(count + pad, torch.ones_like(count)), "pieces + padding must tile the local tensor once"


def source_counts(layouts: list[LocalLayout], sources: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """How many ranks receive each source element."""
    counts = {n: torch.zeros(t.shape, dtype=torch.int64) for n, t in sources.items()}
    for lay in layouts:
        for pc in lay.pieces:
            counts[pc.source][pc.rows[0]:pc.rows[1], pc.cols[0]:pc.cols[1]] += 1
    return counts


def blk(t: torch.Tensor, r: int, p: int, dim: int = 0) -> torch.Tensor:
    """Block r of p along dim, by plain slicing."""
    n = t.shape[dim] // p
    return t[r * n:(r + 1) * n] if dim == 0 else t[:, r * n:(r + 1) * n]


def run_all_ranks(style, parts, p, sources, **sizes):
    layouts = [cut(style, parts, p, r, "w (test)", **sizes) for r in range(p)]
    for lay in layouts:
        check_tiling(lay, sources)
    return layouts, [materialise(lay, sources) for lay in layouts]


def whole(name: str, t: torch.Tensor) -> Part:
    return Part(name, 0, t.shape[0], t.shape[1])


# ----------------------------------------------------------------------------------------------------
# Small pieces


def test_view2d():
    assert view2d(()) == (1, 1)
    assert view2d((7,)) == (7, 1)
    assert view2d((3, 5)) == (3, 5)
    assert view2d((2, 3, 5)) == (6, 5)


def test_piece_numel():
    assert Piece("x", (2, 5), (1, 4), 0, 0).numel == 9


def test_cuts_is_the_closed_set_of_dense_styles():
    assert set(CUTS) == {"replicate", "column", "row", "vocab", "merged", "qkv", "kv", "qkv_grouped", "qkv_packed",
                         "rank0"}


@pytest.mark.parametrize("vocab,p,pad_to,expected", [
    (250, 1, 64, 256), (250, 2, 64, 256), (250, 3, 64, 384), (250, 4, 64, 256),
    (256, 4, 64, 256), (10, 3, 4, 12), (10, 4, 4, 12), (5, 4, 8, 8), (1, 1, 1, 1), (7, 3, 1, 9),
])
def test_padded_vocab(vocab, p, pad_to, expected):
    assert padded_vocab(vocab, p, pad_to) == expected


# ----------------------------------------------------------------------------------------------------
# Styles


@pytest.mark.parametrize("p", [1, 2, 3, 4])
@pytest.mark.parametrize("shape", [(12, 5), (12, 1)])
def test_replicate(p, shape):
    src = arange_sources({"w": shape})
    layouts, locals_ = run_all_ranks("replicate", [whole("w", src["w"])], p, src)
    for lay, local in zip(layouts, locals_):
        assert (lay.rows, lay.cols, lay.padding) == (shape[0], shape[1], ())
        assert torch.equal(local, src["w"])
    assert torch.equal(source_counts(layouts, src)["w"], torch.full(shape, p))


@pytest.mark.parametrize("p", [1, 2, 3, 4])
@pytest.mark.parametrize("shape", [(12, 5), (24, 1)])   # weight, and a 1-D bias seen as [n, 1]
def test_column(p, shape):
    src = arange_sources({"w": shape})
    layouts, locals_ = run_all_ranks("column", [whole("w", src["w"])], p, src)
    for r, local in enumerate(locals_):
        assert torch.equal(local, src["w"][r * shape[0] // p:(r + 1) * shape[0] // p])
    assert torch.equal(torch.cat(locals_), src["w"])
    assert torch.equal(source_counts(layouts, src)["w"], torch.ones(shape, dtype=torch.int64))


@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_row(p):
    src = arange_sources({"w": (5, 12)})
    layouts, locals_ = run_all_ranks("row", [whole("w", src["w"])], p, src)
    for r, local in enumerate(locals_):
        assert local.shape == (5, 12 // p)
        assert torch.equal(local, src["w"][:, r * 12 // p:(r + 1) * 12 // p])
    assert torch.equal(torch.cat(locals_, dim=1), src["w"])
    assert torch.equal(source_counts(layouts, src)["w"], torch.ones(5, 12, dtype=torch.int64))


def test_row_of_a_1d_tensor_at_p1_is_the_whole_tensor():
    # At p > 1 the plan replicates a row layer's 1-D bias (tested in test_plan); shard sees [n] as [n, 1].
    src = arange_sources({"b": (12, 1)})
    (lay,), (local,) = run_all_ranks("row", [whole("b", src["b"])], 1, src)
    assert torch.equal(local, src["b"])


def expected_vocab(t: torch.Tensor, r: int, p: int, pad_to: int) -> torch.Tensor:
    n = t.shape[0]
    padded = next(k for k in itertools.count(n) if k % pad_to == 0 and k % p == 0)
    full = torch.cat([t, torch.zeros(padded - n, t.shape[1], dtype=t.dtype)])
    return blk(full, r, p)


@pytest.mark.parametrize("p", [1, 2, 3, 4])
@pytest.mark.parametrize("vocab,pad_to", [(16, 4), (10, 4), (5, 8), (13, 1), (250, 64)])
def test_vocab(p, vocab, pad_to):
    src = arange_sources({"e": (vocab, 3)})
    layouts, locals_ = run_all_ranks("vocab", [whole("e", src["e"])], p, src, pad_to=pad_to)
    for r, (lay, local) in enumerate(zip(layouts, locals_)):
        want = expected_vocab(src["e"], r, p, pad_to)
        assert torch.equal(local, want)
        # Padding regions are exactly the zero rows beyond the real vocab.
        block = lay.rows
        real = max(0, min(vocab - r * block, block))
        assert lay.padding == (((real, block, 0, 3),) if real < block else ())
    glued = torch.cat(locals_)
    assert glued.shape[0] % p == 0 and glued.shape[0] % pad_to == 0
    assert torch.equal(glued[:vocab], src["e"])
    assert not glued[vocab:].any()
    assert torch.equal(source_counts(layouts, src)["e"], torch.ones(vocab, 3, dtype=torch.int64))


def test_vocab_rank_entirely_in_padding():
    src = arange_sources({"e": (5, 2)})
    lay = cut("vocab", [whole("e", src["e"])], 4, 3, "embed", pad_to=8)
    assert lay.pieces == () and lay.padding == ((0, 2, 0, 2),) and (lay.rows, lay.cols) == (2, 2)


@pytest.mark.parametrize("p", [1, 2, 3, 4])
@pytest.mark.parametrize("rows", [(12, 12), (12, 24), (12, 12, 36)])
def test_merged_separate_sources(p, rows):
    shapes = {f"part{i}": (n, 5) for i, n in enumerate(rows)}
    src = arange_sources(shapes)
    parts = [whole(n, t) for n, t in src.items()]
    layouts, locals_ = run_all_ranks("merged", parts, p, src)
    for r, local in enumerate(locals_):
        assert torch.equal(local, torch.cat([blk(t, r, p) for t in src.values()]))
    # Reassemble: each rank's local splits back into its per-part blocks, concatenated over ranks.
    split = [local.split([n // p for n in rows]) for local in locals_]
    for i, (name, t) in enumerate(src.items()):
        assert torch.equal(torch.cat([s[i] for s in split]), t)
        assert torch.equal(source_counts(layouts, src)[name], torch.ones_like(t, dtype=torch.int64))


@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_merged_fused_single_source(p):
    src = arange_sources({"gate_up": (24, 5)})
    parts = [Part("gate_up", 0, 12, 5), Part("gate_up", 12, 12, 5)]
    layouts, locals_ = run_all_ranks("merged", parts, p, src)
    gate, up = src["gate_up"][:12], src["gate_up"][12:]
    for r, local in enumerate(locals_):
        assert torch.equal(local, torch.cat([blk(gate, r, p), blk(up, r, p)]))
        assert len(layouts[r].pieces) == 2 and {pc.source for pc in layouts[r].pieces} == {"gate_up"}
    halves = [local.split(12 // p) for local in locals_]
    assert torch.equal(torch.cat([torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])]),
                       src["gate_up"])
    assert torch.equal(source_counts(layouts, src)["gate_up"], torch.ones(24, 5, dtype=torch.int64))


# qkv: (heads, kv_heads) and the group sizes in 1..4 that are valid for them.
QKV_CASES = [
    ((4, 2), [1, 2, 4]),        # GQA; p = 4 > kv heads: each kv head on 2 ranks
    ((4, 4), [1, 2, 4]),        # MHA
    ((4, 1), [1, 2, 4]),        # MQA
    ((12, 1), [1, 2, 3, 4]),    # MQA at p = 3
    ((12, 3), [1, 3]),
    ((12, 6), [1, 2, 3]),
    ((12, 2), [1, 2, 4]),
]
QKV_PARAMS = [(h, kv, p) for (h, kv), ps in QKV_CASES for p in ps]
QKV_INVALID = [(h, kv, p) for (h, kv), ps in QKV_CASES for p in range(1, 5) if p not in ps]


def kv_heads_of(r: int, p: int, kv: int) -> list[int]:
    """The kv heads rank r holds: a block of kv/p heads, or the single head floor(r * kv / p) if p > kv."""
    if p <= kv:
        return list(range(r * kv // p, (r + 1) * kv // p))
    return [r * kv // p]


def expected_qkv(q, k, v, r, p, heads, kv, d):
    qs = q[r * (heads // p) * d:(r + 1) * (heads // p) * d]
    ks = torch.cat([k[h * d:(h + 1) * d] for h in kv_heads_of(r, p, kv)])
    vs = torch.cat([v[h * d:(h + 1) * d] for h in kv_heads_of(r, p, kv)])
    return torch.cat([qs, ks, vs])


def check_qkv_reassembly(locals_, q, k, v, p, heads, kv, d):
    q_rows, kv_rows = heads * d // p, max(kv // p, 1) * d
    split = [local.split([q_rows, kv_rows, kv_rows]) for local in locals_]
    assert torch.equal(torch.cat([s[0] for s in split]), q)
    if p <= kv:
        assert torch.equal(torch.cat([s[1] for s in split]), k)
        assert torch.equal(torch.cat([s[2] for s in split]), v)
    else:  # head h is held, whole, by ranks h * p/kv .. (h + 1) * p/kv - 1
        rep = p // kv
        for r, s in enumerate(split):
            h = r // rep
            assert torch.equal(s[1], k[h * d:(h + 1) * d]) and torch.equal(s[2], v[h * d:(h + 1) * d])
        assert torch.equal(torch.cat([split[h * rep][1] for h in range(kv)]), k)


@pytest.mark.parametrize("cols", [3, 1])        # weight, and the 1-D bias seen as [n, 1]
@pytest.mark.parametrize("heads,kv,p", QKV_PARAMS)
def test_qkv_separate_sources(heads, kv, p, cols):
    d = 2
    src = arange_sources({"q": (heads * d, cols), "k": (kv * d, cols), "v": (kv * d, cols)})
    parts = [whole(n, src[n]) for n in "qkv"]
    layouts, locals_ = run_all_ranks("qkv", parts, p, src, heads=heads, kv_heads=kv)
    for r, local in enumerate(locals_):
        assert torch.equal(local, expected_qkv(src["q"], src["k"], src["v"], r, p, heads, kv, d))
    check_qkv_reassembly(locals_, src["q"], src["k"], src["v"], p, heads, kv, d)
    counts = source_counts(layouts, src)
    assert torch.equal(counts["q"], torch.ones(heads * d, cols, dtype=torch.int64))
    kv_times = max(1, p // kv)
    assert torch.equal(counts["k"], torch.full((kv * d, cols), kv_times))
    assert torch.equal(counts["v"], torch.full((kv * d, cols), kv_times))


@pytest.mark.parametrize("heads,kv,p", QKV_PARAMS)
def test_qkv_fused_single_source(heads, kv, p):
    d, cols = 2, 3
    src = arange_sources({"qkv": ((heads + 2 * kv) * d, cols)})
    t = src["qkv"]
    parts = [Part("qkv", 0, heads * d, cols), Part("qkv", heads * d, kv * d, cols),
             Part("qkv", (heads + kv) * d, kv * d, cols)]
    q, k, v = t.split([heads * d, kv * d, kv * d])
    layouts, locals_ = run_all_ranks("qkv", parts, p, src, heads=heads, kv_heads=kv)
    for r, local in enumerate(locals_):
        assert torch.equal(local, expected_qkv(q, k, v, r, p, heads, kv, d))
        assert {pc.source for pc in layouts[r].pieces} == {"qkv"}
    check_qkv_reassembly(locals_, q, k, v, p, heads, kv, d)


def test_qkv_mqa_every_rank_gets_the_single_kv_head():
    d = 2
    src = arange_sources({"q": (4 * d, 3), "k": (d, 3), "v": (d, 3)})
    parts = [whole(n, src[n]) for n in "qkv"]
    for r in range(4):
        lay = cut("qkv", parts, 4, r, "qkv", heads=4, kv_heads=1)
        k_piece = [pc for pc in lay.pieces if pc.source == "k"]
        assert [(pc.rows, pc.dst_row) for pc in k_piece] == [((0, d), d)]


# ----------------------------------------------------------------------------------------------------
# Errors: PlanError naming the tensor, the numbers and the valid sizes


def valid_sizes_in(message: str, label: str = "tp") -> list[int]:
    m = re.search(rf"\(try {re.escape(label)} ([0-9, ]+)\)", message)
    assert m, message
    return [int(x) for x in m.group(1).split(", ")]


def test_column_not_divisible():
    part = Part("model.layers.0.mlp.up_proj.weight", 0, 8, 4)
    with pytest.raises(PlanError) as exc:
        cut("column", [part], 3, 0, "model.layers.0.mlp.up (rule column)")
    msg = str(exc.value)
    assert "model.layers.0.mlp.up (rule column)" in msg
    assert "rows of model.layers.0.mlp.up_proj.weight=8" in msg and "tp=3" in msg
    assert valid_sizes_in(msg) == [1, 2, 4, 8]


def test_row_not_divisible_lists_valid_sizes():
    with pytest.raises(PlanError) as exc:
        cut("row", [Part("o", 0, 4, 64)], 3, 1, "o_proj.weight (rule row)")
    msg = str(exc.value)
    assert "columns of o=64" in msg and "tp=3" in msg
    sizes = valid_sizes_in(msg)
    assert sizes == [1, 2, 4, 8, 16, 32, 64]
    for p in sizes:   # every suggestion works
        cut("row", [Part("o", 0, 4, 64)], p, 0, "o")


def test_merged_not_divisible_names_the_part():
    parts = [Part("gate", 0, 12, 4), Part("up", 0, 10, 4)]
    with pytest.raises(PlanError, match="rows of up=10") as exc:
        cut("merged", parts, 4, 0, "gate_up (rule merged)")
    assert valid_sizes_in(str(exc.value)) == [1, 2, 5, 10]


@pytest.mark.parametrize("heads,kv,p", QKV_INVALID)
def test_qkv_invalid_group_size(heads, kv, p):
    parts = [Part("q", 0, heads * 2, 3), Part("k", 0, kv * 2, 3), Part("v", 0, kv * 2, 3)]
    with pytest.raises(PlanError) as exc:
        cut("qkv", parts, p, 0, "qkv_proj.weight (rule qkv)", heads=heads, kv_heads=kv)
    msg = str(exc.value)
    assert msg.startswith("qkv_proj.weight (rule qkv): ")
    assert f"num_attention_heads={heads}" in msg and f"num_key_value_heads={kv}" in msg and f"tp={p}" in msg
    sizes = valid_sizes_in(msg)
    assert p not in sizes
    for q in sizes:
        for r in range(q):
            cut("qkv", parts, q, r, "qkv", heads=heads, kv_heads=kv)


def test_qkv_tp3_message_matches_the_design():
    parts = [Part("q", 0, 8, 3), Part("k", 0, 4, 3), Part("v", 0, 4, 3)]
    with pytest.raises(PlanError, match=r"tp must divide 4 and divide 2 or be a multiple of it \(try tp 1, 2, 4\)"):
        cut("qkv", parts, 3, 0, "qkv", heads=4, kv_heads=2)


def test_error_label_is_configurable():
    with pytest.raises(PlanError) as exc:
        cut("column", [Part("w", 0, 6, 2)], 4, 0, "w1 expert 3", label="tp-in-expert-group")
    assert "tp-in-expert-group=4" in str(exc.value)
    assert valid_sizes_in(str(exc.value), "tp-in-expert-group") == [1, 2, 3, 6]


def test_plan_error_is_a_distload_error():
    assert issubclass(PlanError, DistloadError)


# ----------------------------------------------------------------------------------------------------
# Head-aware cuts of one tensor: kv (a k norm over the whole projection), qkv_grouped (InternLM2 wqkv)


def expected_kv_rows(t: torch.Tensor, r: int, p: int, kv: int) -> torch.Tensor:
    """Rank r's kv heads of t (kv equal row blocks), written independently: replicated past p = kv."""
    heads = list(t.chunk(kv))
    if p <= kv:
        return torch.cat(heads[r * kv // p:(r + 1) * kv // p])
    return heads[r // (p // kv)]


@pytest.mark.parametrize("kv,p", [(2, 1), (2, 2), (2, 4), (4, 2), (1, 4)])
def test_kv_cuts_by_kv_heads_and_replicates_past_them(kv, p):
    d, cols = 3, 2
    src = arange_sources({"k_norm": (kv * d, cols)})
    _, locals_ = run_all_ranks("kv", [whole("k_norm", src["k_norm"])], p, src, heads=4, kv_heads=kv)
    for r, local in enumerate(locals_):
        assert torch.equal(local, expected_kv_rows(src["k_norm"], r, p, kv))


def grouped_qkv(heads: int, kv: int, d: int, cols: int) -> tuple[torch.Tensor, list]:
    """A wqkv packed per kv group and, per group, its (q heads, k, v) blocks by plain slicing."""
    q_per = heads // kv
    t = arange_sources({"wqkv": (kv * (q_per + 2) * d, cols)})["wqkv"]
    groups = [g.split([q_per * d, d, d]) for g in t.chunk(kv)]
    return t, groups


@pytest.mark.parametrize("heads,kv,p", [(4, 2, 1), (4, 2, 2), (4, 2, 4), (8, 2, 4), (8, 4, 2), (8, 1, 4), (8, 2, 8)])
def test_qkv_grouped_keeps_the_packed_order_per_rank(heads, kv, p):
    d, cols = 2, 3
    t, groups = grouped_qkv(heads, kv, d, cols)
    src = {"wqkv": t}
    layouts, locals_ = run_all_ranks("qkv_grouped", [whole("wqkv", t)], p, src, heads=heads, kv_heads=kv)
    for r, local in enumerate(locals_):
        if p <= kv:
            want = torch.cat([torch.cat(groups[g]) for g in range(r * kv // p, (r + 1) * kv // p)])
        else:
            q, k, v = groups[r // (p // kv)]
            share = heads // p
            j = r % (p // kv)
            want = torch.cat([q[j * share * d:(j + 1) * share * d], k, v])
        assert torch.equal(local, want), (r, p)
    counts = source_counts(layouts, src)["wqkv"]
    # Every q row once; k and v rows once per rank sharing their kv head.
    kv_times = max(1, p // kv)
    for q, k, v in (c.split([heads // kv * d, d, d]) for c in counts.chunk(kv)):
        assert torch.equal(q, torch.ones_like(q))
        assert torch.equal(k, torch.full_like(k, kv_times)) and torch.equal(v, torch.full_like(v, kv_times))


def test_qkv_grouped_differs_from_plain_qkv_on_the_same_tensor():
    """The shapes agree, so no plan can tell the two apart: the shards must not."""
    heads, kv, d, cols = 4, 2, 2, 3
    t, _ = grouped_qkv(heads, kv, d, cols)
    src = {"wqkv": t}
    plain = [Part("wqkv", 0, heads * d, cols), Part("wqkv", heads * d, kv * d, cols),
             Part("wqkv", (heads + kv) * d, kv * d, cols)]
    a = materialise(cut("qkv_grouped", [whole("wqkv", t)], 2, 0, "w", heads=heads, kv_heads=kv), src)
    b = materialise(cut("qkv", plain, 2, 0, "w", heads=heads, kv_heads=kv), src)
    assert a.shape == b.shape and not torch.equal(a, b)


@pytest.mark.parametrize("style", ["kv", "qkv_grouped"])
def test_head_cuts_refuse_a_group_size_that_splits_a_head(style):
    with pytest.raises(PlanError, match="tp must divide 4 and divide 2 or be a multiple of it"):
        cut(style, [Part("w", 0, 16, 2)], 3, 0, "w", heads=4, kv_heads=2)
    with pytest.raises(PlanError, match="not a whole number per head"):
        cut(style, [Part("w", 0, 15, 2)], 2, 0, "w", heads=4, kv_heads=2)
