"""distload.plan.wire: the ops each rank posts for each bucket agree across ranks (no processes).

Plans are built from metadata only (made-up entries, the shipped Llama and Mixtral rules). For every
bucket of every plan: each send r -> d has its receive on d from r, in the same order, with the same size,
tag and content kind; a broadcast is posted by every rank alike; a receiver's messages hold exactly its
items and bytes; a failed rank's stand-in gives every op a buffer of the op's size; and the reader's
messages, as the transfer builds them, are exactly the sizes its peers receive.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from distload.plan import build_plan
from distload.plan.wire import (BROADCAST, BUCKET_BYTES, DIRECT, FANOUT, PACKED, RECV, SEND, SHM_DONE, SHM_TOKEN,
                                describe, from_reader, stand_in_slices, via_shm, wire_ops)
from distload.rules import rules_for
from distload.topology import Layout
from distload.transfer.pieces import message
from plan_checks import EXPERTS, HEADS, KV_HEADS, LAYERS, H, I, V, decoder  # noqa: F401  (the decoder's sizes)



LAYOUTS = {
    "tp2": Layout(world=2, tp=2),
    "tp4": Layout(world=4, tp=4),
    "tp2-replicas-two-readers": Layout(world=4, tp=2, readers=(0, 3)),
    "two-nodes": Layout(world=4, tp=4, readers=(0, 2), local_world=2),
    "two-nodes-four-readers": Layout(world=4, tp=4, readers=(0, 1, 2, 3), local_world=2),
    "two-nodes-tp8": Layout(world=8, tp=8, readers=(0, 4), local_world=4),
    "moe-ep2": Layout(world=4, tp=4, ep=2),
    "moe-ep4-two-nodes": Layout(world=4, tp=4, ep=4, readers=(0, 2), local_world=2),
}
STAGING = {"default": 16 << 20, "tiny": 64 << 10}


@pytest.fixture(scope="module")
def plans():
    cache = {}

    def get(layout_name: str, staging: str):
        if (layout_name, staging) not in cache:
            ents, config = decoder(moe=layout_name.startswith("moe"))
            cache[layout_name, staging] = build_plan(ents, config, rules_for(config), LAYOUTS[layout_name],
                                                     staging_bytes=STAGING[staging])
        return cache[layout_name, staging]
    return get


def every_rank(plan, bucket, shm: bool) -> list[tuple]:
    return [wire_ops(plan, bucket, r, shm) for r in range(plan.layout.world)]


def signature(op) -> tuple:
    return op.nbytes, op.tag, op.carries


@pytest.mark.parametrize("shm", [True, False], ids=["shm", "no-shm"])
@pytest.mark.parametrize("staging", list(STAGING))
@pytest.mark.parametrize("layout_name", list(LAYOUTS))
def test_every_send_has_its_receive_and_every_rank_its_broadcast(plans, layout_name, staging, shm):
    plan = plans(layout_name, staging)
    world = plan.layout.world
    kinds = Counter()
    for bucket in plan.buckets:
        ops = every_rank(plan, bucket, shm)
        for r, mine in enumerate(ops):
            kinds.update(op.carries for op in mine)
            assert all(op.tag == bucket.index for op in mine)
            assert all(op.peer != r for op in mine if op.kind not in (BROADCAST, FANOUT))
            if r != bucket.reader:  # a receiver talks to the reader only (replicas: and to their group's leader)
                assert all(op.peer == bucket.reader for op in mine if op.kind != FANOUT)
        # A fan-out is posted alike by every member of its group, its leader (the root) among them.
        fanouts = {}
        for r, mine in enumerate(ops):
            for op in mine:
                if op.kind == FANOUT:
                    assert r in op.group and op.peer in op.group
                    fanouts.setdefault(op.group, {})[r] = (op.peer, op.nbytes, [(i.param, i.piece) for i, _ in op.packed])
        for group, by_rank in fanouts.items():
            assert sorted(by_rank) == list(group.members()) and len(set(map(repr, by_rank.values()))) == 1, (bucket.index, group)
        for s in range(world):
            for d in range(world):
                sent = [signature(op) for op in ops[s] if op.kind == SEND and op.peer == d]
                received = [signature(op) for op in ops[d] if op.kind == RECV and op.peer == s]
                assert sent == received, (bucket.index, s, d)
        broadcasts = [[(op.peer, op.nbytes) for op in mine if op.kind == BROADCAST] for mine in ops]
        assert all(b == broadcasts[0] for b in broadcasts), bucket.index
        assert broadcasts[0] == ([(bucket.reader, bucket.read_bytes)] if bucket.broadcast else [])
    assert kinds[BUCKET_BYTES] and (kinds[SHM_TOKEN] if shm else not kinds[SHM_TOKEN])
    if not shm or not plan.layout.one_node:  # large contiguous pieces travel on their own, small ones packed
        assert kinds[DIRECT] if staging == "default" else kinds[PACKED] and not kinds[DIRECT]


@pytest.mark.parametrize("shm", [True, False], ids=["shm", "no-shm"])
@pytest.mark.parametrize("layout_name", ["tp4", "two-nodes", "moe-ep4-two-nodes"])
def test_a_receivers_messages_hold_exactly_its_items(plans, layout_name, shm):
    plan = plans(layout_name, "tiny")
    for bucket in plan.buckets:
        if bucket.broadcast:
            continue
        for r in range(plan.layout.world):
            ops = wire_ops(plan, bucket, r, shm)
            if r == bucket.reader or not bucket.recv_bytes[r]:
                assert r == bucket.reader or ops == ()
                continue
            if via_shm(plan, bucket, r, shm):  # the token in, the reply out; the pieces come from the slot
                assert [(op.kind, op.carries) for op in ops] == [(RECV, SHM_TOKEN), (SEND, SHM_DONE)]
                continue
            assert sum(op.nbytes for op in ops) == bucket.recv_bytes[r]
            carried = []
            for i, op in enumerate(ops):
                if op.carries == PACKED:
                    assert i == 0
                    at = 0
                    for item, offset in op.packed:
                        assert offset == at
                        at += item.nbytes
                        carried.append(item)
                    assert at == op.nbytes
                else:
                    assert op.carries == DIRECT and op.nbytes == op.item.nbytes
                    carried.append(op.item)
            key = lambda it: (it.chunk, it.param, it.piece)  # noqa: E731
            assert sorted(map(key, carried), key=repr) == sorted(map(key, plan.items(bucket, r)), key=repr)


@pytest.mark.parametrize("shm", [True, False], ids=["shm", "no-shm"])
@pytest.mark.parametrize("layout_name", list(LAYOUTS))
def test_the_stand_in_posts_exactly_the_real_op_sizes(plans, layout_name, shm):
    plan = plans(layout_name, "tiny")
    for bucket in plan.buckets:
        for ops in every_rank(plan, bucket, shm):
            slices, need = stand_in_slices(ops)  # StandIn.post: scratch[a:b] for each op
            filled = []
            for op, (a, b) in zip(ops, slices):
                assert 0 <= a and b - a == op.nbytes and b <= need
                if op.fills:
                    filled.append((a, b))
            assert all(b1 <= a2 for (_, b1), (a2, _) in zip(filled, filled[1:]))  # receives never overlap


@pytest.mark.parametrize("layout_name", ["tp4", "two-nodes", "moe-ep2"])
def test_the_readers_messages_are_the_sizes_its_peers_receive(plans, layout_name):
    plan = plans(layout_name, "default")
    for bucket in plan.buckets:
        ops = wire_ops(plan, bucket, bucket.reader, False)
        staged = torch.zeros(bucket.read_bytes, dtype=torch.uint8)
        spare = torch.zeros(sum(bucket.recv_bytes), dtype=torch.uint8)
        at = 0
        for op in ops:
            if op.kind == BROADCAST:
                continue
            buf, used = message(plan, staged, spare[at:], bucket, op)
            assert buf.numel() == op.nbytes and buf.is_contiguous()
            at += used


def test_describe_names_the_peer_of_the_failed_op(plans):
    plan = plans("tp4", "default")
    bucket = next(b for b in plan.buckets if not b.broadcast)
    ops = wire_ops(plan, bucket, bucket.reader, False)
    last = ops[-1].peer
    assert describe(plan, bucket, bucket.reader, ops, len(ops) - 1) == f"sending bucket {bucket.index} to rank {last}"
    assert describe(plan, bucket, bucket.reader, ops).startswith(f"sending bucket {bucket.index} to ranks ")
    other = (bucket.reader + 1) % 4
    assert describe(plan, bucket, other, wire_ops(plan, bucket, other, False)) == \
        f"receiving bucket {bucket.index} (message from rank {bucket.reader})"


@pytest.mark.parametrize("shm", [True, False], ids=["shm", "no-shm"])
@pytest.mark.parametrize("layout", [LAYOUTS["tp2-replicas-two-readers"],
                                    Layout(world=8, tp=2, readers=(0, 4), local_world=4)], ids=["one-node", "two-nodes"])
def test_replicas_take_their_items_once_from_the_reader_or_their_leader(layout, shm):
    """Data-parallel replicas: a rank gets each of its items exactly once, from the reader (it leads the
    item's group) or from its group's fan-out; the reader sends each group's bytes once."""
    ents, config = decoder(moe=False)
    plan = build_plan(ents, config, rules_for(config), layout, staging_bytes=STAGING["tiny"])
    key = lambda it: (it.chunk, it.param, it.piece)  # noqa: E731
    fanned = 0
    for bucket in plan.buckets:
        if bucket.broadcast:
            continue
        for r in range(plan.layout.world):
            ops = wire_ops(plan, bucket, r, shm)
            got = []
            for op in ops:
                if op.kind == FANOUT:
                    fanned += 1
                    if op.peer != r:
                        got += [it for it, _ in op.packed]
                elif op.carries == PACKED and op.kind == RECV:
                    got += [it for it, _ in op.packed]
                elif op.carries == DIRECT and op.kind == RECV:
                    got.append(op.item)
                elif op.carries == SHM_TOKEN and op.kind == RECV:
                    got += from_reader(plan, bucket, r)
            if r == bucket.reader:
                got += [it for it in plan.items(bucket, r)]
            assert sorted(map(key, got), key=repr) == sorted(map(key, plan.items(bucket, r)), key=repr), (bucket.index, r)
        sent = sum(op.nbytes for op in wire_ops(plan, bucket, bucket.reader, False) if op.kind == SEND)
        assert sent <= bucket.read_bytes * plan.layout.tp  # each group once, not once per replica
    assert fanned
