"""distload.plan.predict: the bytes each node moves, from the plan alone, and the load time they need on a cluster
of given rates (no processes). The per-node bytes are checked against the plan's own accounting
(LoadPlan.bytes_from_other_nodes, the buckets' read bytes), the times against the arithmetic they stand for."""

from __future__ import annotations

import pytest

from distload.errors import DistloadError
from distload.plan import build_plan
from distload.plan.predict import (ClusterSpec, distload_traffic, every_rank_reads_traffic, parse_cluster,
                                   predict)
from distload.rules import rules_for
from distload.topology import Layout, reader_ranks
from plan_checks import decoder


def plan_for(nodes: int, per_node: int, moe: bool = False, staging: int = 64 << 10):
    ents, config = decoder(moe=moe)
    world = nodes * per_node
    layout = Layout(world=world, tp=world, ep=world if moe else 1,
                    readers=reader_ranks(world, per_node, "per-node"), local_world=per_node)
    return build_plan(ents, config, rules_for(config), layout, staging_bytes=staging)


@pytest.mark.parametrize("nodes,per_node,moe", [(2, 2, False), (4, 1, False), (2, 2, True), (1, 4, False)])
def test_what_each_node_moves_is_what_the_plan_says(nodes, per_node, moe):
    plan = plan_for(nodes, per_node, moe)
    t = distload_traffic(plan, broadcast="star")
    assert len(t.storage) == nodes and sum(t.storage) == plan.checkpoint_bytes
    for k in range(nodes):
        ranks = range(k * per_node, (k + 1) * per_node)
        # star: every rank on another node gets its own copy, as LoadPlan.bytes_from_other_nodes counts it
        assert t.received[k] == sum(plan.bytes_from_other_nodes(r) for r in ranks)
        assert t.storage[k] == sum(b.read_bytes for b in plan.buckets if b.reader in ranks)
    assert sum(t.sent) == sum(t.received)
    tree = distload_traffic(plan, broadcast="tree")
    assert sum(tree.received) <= sum(t.received) and tree.storage == t.storage


def test_every_rank_reads_reads_each_nodes_pieces_widened_by_the_read_ahead():
    plan = plan_for(2, 2)
    exact = every_rank_reads_traffic(plan, read_ahead_kib=0)
    # each node needs every row-parallel and replicated tensor whole and half of the column-parallel rows
    assert plan.checkpoint_bytes / 2 < exact.storage[0] < plan.checkpoint_bytes
    huge = every_rank_reads_traffic(plan, read_ahead_kib=1 << 20)   # a window larger than the file
    assert all(plan.checkpoint_bytes <= s <= plan.checkpoint_bytes + 4096 for s in huge.storage)
    assert every_rank_reads_traffic(plan_for(1, 4), read_ahead_kib=0).storage == (plan.checkpoint_bytes,)
    assert sum(exact.sent) == sum(exact.received) == 0


def test_the_time_is_the_busiest_resource_and_it_is_named():
    plan = plan_for(2, 2)
    storage_bound = predict(plan, ClusterSpec(2, 2, storage="shared", storage_gbps=1e-3, nic_gbps=1.0))
    d = storage_bound["distload"]
    assert d.parts["storage"] == pytest.approx(plan.checkpoint_bytes / 1e6)
    assert d.resource == "storage" and d.bottleneck.startswith("storage")
    assert d.seconds == pytest.approx(d.parts["storage"] + d.parts["fill"])
    assert d.parts["fill"] == pytest.approx(max(b.read_bytes for b in plan.buckets) / 200e9)   # the tail, in-node
    e = storage_bound["every-rank-reads"]
    assert e.seconds == pytest.approx(sum(e.traffic.storage) / 1e6) and e.seconds > d.seconds
    per_node = predict(plan, ClusterSpec(2, 2, storage="per-node", storage_gbps=1e-3, nic_gbps=1.0))["distload"]
    assert per_node.parts["storage"] == pytest.approx(max(per_node.traffic.storage) / 1e6)
    nic_bound = predict(plan, ClusterSpec(2, 2, storage="per-node", storage_gbps=10.0, nic_gbps=1e-6))["distload"]
    assert nic_bound.resource == "nic" and nic_bound.bottleneck.startswith("NIC of node")
    # link-bound, the first bucket is read (at one node's storage rate, its one reader) while the links wait
    assert nic_bound.parts["fill"] == pytest.approx(max(b.read_bytes for b in plan.buckets) / 10e9)
    assert nic_bound.parts["nic"] == pytest.approx(max(max(nic_bound.traffic.sent), max(nic_bound.traffic.received))
                                                   / 1e3)


def test_cluster_descriptions_parse_and_refuse_by_name():
    spec = parse_cluster("storage=per-node,storage-gbps=20,nic-gbit=400,read-ahead-kib=128", 16, 8)
    assert (spec.nodes, spec.gpus_per_node, spec.storage, spec.storage_gbps, spec.nic_gbps, spec.read_ahead_kib) == \
        (16, 8, "per-node", 20.0, 50.0, 128)
    with pytest.raises(DistloadError, match="'nic=400'.*nic-gbps"):
        parse_cluster("nic=400", 2, 8)
    with pytest.raises(DistloadError, match="storage-gbps='fast'"):
        parse_cluster("storage-gbps=fast", 2, 8)
    with pytest.raises(DistloadError, match="storage='nfs'"):
        parse_cluster("storage=nfs", 2, 8)
    with pytest.raises(DistloadError, match="--world 16 --local-world 8"):
        predict(plan_for(2, 2), ClusterSpec(2, 8))
