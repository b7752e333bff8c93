"""Fan-out to data-parallel replicas: a group's leader broadcasts the group's items of a bucket to the
other members (plan/wire.py FANOUT), once its own copy has arrived from the reader.

Why a broadcast within each group of ranks holding one shard, after the reader's point-to-point
delivery inside its own block: the reader's messages then do not grow with the number of replicas, and
the bytes cross nodes only in the group broadcasts (NCCL pipelines them over trees and rings; gloo
relays them). The buffer is the group's items end to end, packed by the leader from wherever they
arrived (the read buffer, a shared slot, a packed message, or the param itself for a direct piece).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..plan import Bucket, LoadPlan
from ..plan.wire import FANOUT, WireOp, fanout_groups


def make_groups(plan: LoadPlan) -> dict:
    """One process group per fan-out group of the plan ({Ranks: group}); every rank makes them all, in
    the same order (new_group is collective over the world)."""
    if plan.layout.world == 1 or not dist.is_initialized():
        return {}
    return {g: dist.new_group(ranks=list(g.members())) for g in fanout_groups(plan)}


def close_groups(groups: dict) -> None:
    for pg in groups.values():
        try:
            dist.destroy_process_group(pg)
        except Exception:  # a peer already gone: the group goes with the process
            pass


def fanout_bytes(plan: LoadPlan, bucket: Bucket, rank: int) -> int:
    """Bytes of `bucket` that `rank` broadcasts or receives in fan-outs."""
    if bucket.broadcast:
        return 0
    return sum(n for g, n in bucket.groups if g.count > 1 and rank in g)


class FanOut:
    """This rank's fan-out ops of one bucket and their buffer (one slice per op, in op order)."""

    def __init__(self, rank: int, ops, pool):
        self.rank = rank
        self.ops: list[WireOp] = [op for op in ops if op.kind == FANOUT]
        self.pool = pool
        self.buf = pool.get() if self.ops else None
        self.slices, at = [], 0
        for op in self.ops:
            self.slices.append((at, at + op.nbytes))
            at += op.nbytes

    def __bool__(self) -> bool:
        return bool(self.ops)

    def pack(self, item_bytes) -> None:
        """As the leader: each group's items into the buffer; item_bytes(item) -> its bytes as uint8 [rows, n]."""
        for op, (a, _) in zip(self.ops, self.slices):
            if op.peer != self.rank:
                continue
            for item, offset in op.packed:
                block = item_bytes(item)
                self.buf[a + offset:a + offset + item.nbytes].view(block.shape).copy_(block)

    def pairs(self) -> list[tuple[WireOp, torch.Tensor]]:
        return [(op, self.buf[a:b]) for op, (a, b) in zip(self.ops, self.slices)]

    def unpack(self, writer) -> None:
        """As a replica: copy each received item into its param."""
        for op, (a, _) in zip(self.ops, self.slices):
            if op.peer == self.rank:
                continue
            for item, offset in op.packed:
                writer.unpack_wire_item(self.buf[a + offset:a + offset + item.nbytes], item)

    def release(self) -> None:
        if self.buf is not None:
            self.pool.put(self.buf)
            self.buf = None
