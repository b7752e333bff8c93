"""Data-parallel replicas on real gloo ranks: 4 ranks at tp 2 hold two replicas of each shard.

The reader delivers each group's bytes once, to the group's member in its own block, and that leader
fans them out to the other replicas (plan/wire.py FANOUT): every rank still holds exactly the oracle's
tp-2 shard, the job reads each byte from storage once, and a rank receives its shard and nothing more.
"""

from __future__ import annotations

from checks import differences, tensor_bytes
from spawn import run_ranks

FAMILIES = ("llama", "llama_mqa_tied", "qwen3")


def _expected(path: str, rank: int, tp: int) -> dict:
    from hf_models import checkpoint_tensors, read_config
    from layout_oracle import serving_shards

    return serving_shards(checkpoint_tensors(path), read_config(path), rank, tp)


def _load_replicas(checkpoints: dict, nodes: int) -> dict:
    import os

    import torch.distributed as dist

    import distload

    rank, world = dist.get_rank(), dist.get_world_size()
    local = world // nodes
    # One node: the bucketed transfer (not node pulls), through shared memory and over gloo's sockets.
    os.environ.update(LOCAL_WORLD_SIZE=str(local), GROUP_RANK=str(rank // local), LOCAL_RANK=str(rank % local),
                      DISTLOAD_PULL="0")
    problems, reports = [], {}
    for fam, staging, shm in [(fam, 1, "1") for fam in FAMILIES] + [("llama", 0.05, "0")]:
        os.environ["DISTLOAD_SHM"] = shm
        result = distload.load(checkpoints[fam], tp=2, staging_mib=staging, progress=False)
        problems += differences(result.params, _expected(checkpoints[fam], rank % 2, 2),
                                f"{fam} {nodes} node(s) staging {staging} MiB shm {shm} rank{rank}")
        if result.report["route"]["kind"] != "wire":
            problems.append(f"{fam}: route {result.report['route']}, not the wire")
        reports[fam, staging] = result.report
    return {"problems": problems, "reports": reports}


def _check(dense_checkpoints, nodes: int) -> None:
    import distload

    results = run_ranks(4, _load_replicas, dense_checkpoints, nodes, timeout=600)
    problems = [p for r in results for p in r["problems"]]
    assert not problems, "\n".join(problems)
    for (fam, staging), report in results[0]["reports"].items():
        path = dense_checkpoints[fam]
        assert report["ok"], (fam, staging)
        assert report["storage_bytes_read"] == report["checkpoint_bytes"] == tensor_bytes(path), (fam, staging)
        plan = distload.inspect(path, tp=2, world=4, local_world=4 // nodes, staging_mib=staging)
        for r in report["per_rank"]:
            rank = r["rank"]
            kept = sum(s.nbytes for s in plan.specs[rank].values() if not s.alias_of)
            # what a rank receives is exactly its pieces of the buckets others read: its shard, nothing more
            assert r["bytes_received"] == sum(b.recv_bytes[rank] for b in plan.buckets if b.reader != rank), (fam, r)
            assert r["bytes_received"] <= kept, (fam, staging, r)


def test_replicas_on_one_node_hold_their_shards(dense_checkpoints):
    _check(dense_checkpoints, nodes=1)


def test_replicas_on_two_nodes_hold_their_shards(dense_checkpoints):
    _check(dense_checkpoints, nodes=2)
