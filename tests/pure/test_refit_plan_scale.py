"""Issue 35, plan once: a serving rank's refit plan at real shapes (Llama-3-8B) from 4 and 64 FSDP2 trainer ranks,
by planning only. The plan covers exactly the rank's own shard, each trainer sends only what it holds, and the
check a later step makes (one integer: the trainers' holdings digests summed) does not grow with the trainer's
world. The seconds are scripts/refit_plan_scale.py's (BENCHMARKS.md, "Refit: planning"), never asserted here."""

from __future__ import annotations

import pytest

from distload.dtypes import itemsize
from distload.plan.shard import view2d
from distload.refit.holdings import describe
from distload.refit.routes import DIGEST_BITS
from refit_scale import digest_sum, llama_8b, serving_side, shard0_pieces, trainer_holdings

SERVINGS = 4


@pytest.fixture(scope="module")
def model():
    return llama_8b()


@pytest.fixture(scope="module")
def planned(model):
    """trainers -> (holdings, serving rank 1's side and routes), each planned as the link's first step plans."""
    config, shapes = model
    out = {}
    for trainers in (4, 64):
        holdings = trainer_holdings(shapes, trainers)
        side = serving_side(config, shapes, SERVINGS, rank=1)
        out[trainers] = holdings, side, side.plan_for(holdings, digest_sum(holdings))
    return out


def _moves(routes):
    return [m for msgs in routes.messages.values() for msg in msgs for m in msg]


@pytest.mark.parametrize("trainers", [4, 64])
def test_routes_fill_each_param_of_the_rank_exactly_once(planned, trainers):
    _, side, routes = planned[trainers]
    specs = side.plan.specs[1]
    assert routes.bytes_received == side.own_shard_bytes() > 3.5e9 / SERVINGS   # 8B params, bf16: ~4 GB a rank
    into: dict[str, list] = {}
    for m in _moves(routes):
        into.setdefault(m.param, []).append(m)
    assert set(into) == {n for n, s in specs.items() if not s.alias_of}
    for name, moves in into.items():
        rows, cols = view2d(tuple(specs[name].local_shape))
        boxes = sorted((m.dst_row, m.dst_row + m.rows[1] - m.rows[0], m.dst_col, m.dst_col + m.cols[1] - m.cols[0])
                       for m in moves)
        assert all(0 <= r0 < r1 <= rows and 0 <= c0 < c1 <= cols for r0, r1, c0, c1 in boxes), name
        assert sum((r1 - r0) * (c1 - c0) for r0, r1, c0, c1 in boxes) == rows * cols, name
        for i, (r0, r1, c0, c1) in enumerate(boxes):   # disjoint: with the area equal, every element once
            for s0, _, d0, d1 in boxes[i + 1:]:
                if s0 >= r1:
                    break
                assert d1 <= c0 or c1 <= d0, f"{name}: two moves write rows {r0}..{r1} cols {c0}..{c1} alike"


@pytest.mark.parametrize("trainers", [4, 64])
def test_each_trainer_sends_only_rows_it_holds(planned, trainers):
    holdings, _, routes = planned[trainers]
    for t, msgs in routes.messages.items():
        for m in (m for msg in msgs for m in msg):
            assert m.trainer == t and m.source in holdings[t]
            extents = [(lr, lr + r1 - r0, lc, lc + c1 - c0) for r0, r1, c0, c1, lr, lc in holdings[t][m.source].boxes]
            assert any(a <= m.rows[0] < m.rows[1] <= b and c <= m.cols[0] < m.cols[1] <= d for a, b, c, d in extents), \
                f"trainer {t} asked for {m.source} rows {m.rows} cols {m.cols}, outside what it holds {extents}"


@pytest.mark.parametrize("trainers", [4, 64])
def test_messages_grow_only_with_the_trainers_that_hold_the_ranks_bytes(planned, trainers):
    """The senders are exactly the trainers holding some of the rank's rows, and each pair's moves are packed into
    full staging-sized messages: the count is about own bytes / staging + one per sender, not one per move."""
    holdings, side, routes = planned[trainers]
    wanted = {}
    for name, source in side.plan.sources.items():
        for share in (s for s in source.shares if 1 in s.ranks):
            wanted.setdefault(name, []).append(share.piece)
    holders = {t for t, held in enumerate(holdings) for name, pieces in wanted.items()
               for r0, r1, c0, c1, _, _ in held[name].boxes for p in pieces
               if max(r0, p.rows[0]) < min(r1, p.rows[1]) and max(c0, p.cols[0]) < min(c1, p.cols[1])}
    assert set(routes.messages) == holders
    widest_row = max(view2d(shape)[1] * itemsize("BF16") for shape in (h.shape for h in holdings[0].values()))
    for t, msgs in routes.messages.items():
        sent = sum(m.nbytes for msg in msgs for m in msg)
        assert len(msgs) <= sent // (side.cap - widest_row) + 1, f"trainer {t}: {len(msgs)} messages for {sent} B"
    assert len(_moves(routes)) > len(routes.messages.values())   # more moves than messages: they are packed


@pytest.mark.parametrize("trainers", [4, 64])
def test_a_later_step_checks_one_integer_that_sees_any_trainers_change(model, planned, trainers):
    """Each step every trainer describes its own holdings (one box per tensor at any world) into one digest; the
    all-reduce sums them into one int64; the serving rank compares it with the plan's. Replayed when equal; any
    one trainer's names, shapes, dtypes or rows changed make it differ."""
    _, shapes = model
    holdings, _, routes = planned[trainers]
    assert routes.expected == digest_sum(holdings) < 2 ** 63 and trainers << DIGEST_BITS < 2 ** 63
    assert max(sum(len(h.boxes) for h in held.values()) for held in holdings) == len(shapes)   # not T-dependent
    again = trainer_holdings(shapes, trainers)   # a later step: fresh tensors, same shards
    assert routes.holds(digest_sum(again))
    last, name = trainers - 1, "model.layers.7.mlp.down_proj.weight"
    moved = dict(shard0_pieces(shapes, last, trainers))   # one trainer's rows of one tensor shift by one
    p = moved[name]
    moved[name] = p._replace(local=p.local[1:], offsets=(p.offsets[0] + 1, 0))
    prev = dict(shard0_pieces(shapes, last - 1, trainers))
    q = prev[name]
    prev[name] = q._replace(local=q.local.new_empty((q.local.shape[0] + 1, *q.local.shape[1:])))
    changed = [*again[:-2], describe(prev), describe(moved)]
    assert not routes.holds(digest_sum(changed))
    assert not routes.holds(digest_sum([again[1], again[0], *again[2:]]))   # two trainers swapped their shards
    retyped = dict(shard0_pieces(shapes, last, trainers))
    retyped[name] = retyped[name]._replace(local=retyped[name].local.float())
    assert not routes.holds(digest_sum([*again[:-1], describe(retyped)]))
