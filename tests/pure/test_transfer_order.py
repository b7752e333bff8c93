"""distload.plan.buckets.transfer_order: the order in which ranks post their buckets (no processes).

Every rank must see the job-wide buckets in one order (their collectives and messages match up across the
job), and the ranks of a block, which alone take its own buckets, must agree on where those go; a reader's own
buckets are spread among its job-wide ones, so a node's link carries the crossing rows while it reads its own."""

from __future__ import annotations

import pytest

from distload.plan import build_plan
from distload.plan.buckets import TAIL_BUCKETS, transfer_order
from distload.rules import rules_for
from distload.topology import Layout, reader_ranks
from plan_checks import decoder

STAGING = 64 << 10   # many buckets from a small checkpoint


def layout(nodes: int, per_node: int, moe: bool) -> Layout:
    world = nodes * per_node
    return Layout(world=world, tp=world, ep=world if moe else 1, readers=reader_ranks(world, per_node, "per-node"),
                  local_world=per_node)


@pytest.mark.parametrize("nodes,per_node,moe", [(2, 2, False), (4, 1, False), (2, 2, True), (4, 1, True)])
def test_job_wide_in_index_order_block_own_spread_and_agreed(nodes, per_node, moe):
    ents, config = decoder(moe=moe)
    lay = layout(nodes, per_node, moe)
    whole = build_plan(ents, config, rules_for(config), lay, staging_bytes=STAGING)
    assert whole.block_own_from is not None and whole.block_own_from < len(whole.buckets)
    order = transfer_order(whole)
    assert sorted(b.index for b in order) == [b.index for b in whole.buckets]   # a permutation
    wide = [b.index for b in order if b.index < whole.block_own_from]
    assert wide == list(range(whole.block_own_from))
    for reader in lay.readers:
        own = [i for i, b in enumerate(order) if b.reader == reader and b.index >= whole.block_own_from]
        mine_wide = [i for i, b in enumerate(order) if b.reader == reader and b.index < whole.block_own_from]
        assert [order[i].index for i in own] == sorted(order[i].index for i in own)
        if len(own) > TAIL_BUCKETS + 1 and mine_wide:   # spread: some before its last job-wide bucket, the tail after
            assert own[0] < mine_wide[-1] and all(i > mine_wide[-1] for i in own[-TAIL_BUCKETS:])
    orders = {}
    for rank in range(lay.world):
        part = build_plan(ents, config, rules_for(config), lay, staging_bytes=STAGING, rank=rank)
        mine = transfer_order(part)
        assert [b.index for b in mine if b.index < part.block_own_from] == wide
        orders.setdefault(lay.node(rank), set()).add(tuple(b.index for b in mine))
    assert all(len(seen) == 1 for seen in orders.values()), "ranks of one block disagree on its order"


def test_one_node_keeps_the_plans_order():
    ents, config = decoder(moe=False)
    plan = build_plan(ents, config, rules_for(config), Layout(world=4, tp=4), staging_bytes=STAGING)
    assert transfer_order(plan) == plan.buckets
