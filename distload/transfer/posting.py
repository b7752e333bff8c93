"""Posting wire ops (plan.wire.wire_ops) on the process group: the one place the bucketed transfer's
messages start, for a working rank and for a failed rank's stand-in alike."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..plan import Bucket, LoadPlan
from ..plan.wire import BROADCAST, FANOUT, SEND, WireOp, stand_in_slices, wire_ops
from .collectives import require_contiguous


def post_all(pairs: list[tuple[WireOp, torch.Tensor]], groups: dict | None = None) -> list:
    """Start every (op, buffer) pair, in order; returns their works. Every buffer is checked before the
    first op starts, so a bucket is posted whole or not at all (a stand-in can then post it instead).
    groups: the fan-out process groups (fanout.make_groups), for FANOUT ops."""
    for op, buf in pairs:
        require_contiguous(buf, f"{op.carries} {op.kind} buffer")
        if buf.numel() != op.nbytes:
            raise RuntimeError(f"bucket {op.tag}: {op.carries} {op.kind} with rank {op.peer} has {buf.numel()} "
                               f"bytes, the plan says {op.nbytes}")
    return [_start(op, buf, groups) for op, buf in pairs]


def _start(op: WireOp, buf: torch.Tensor, groups: dict | None):
    if op.kind == FANOUT:
        return dist.broadcast(buf, src=op.peer, group=groups[op.group], async_op=True)
    if op.kind == BROADCAST:
        return dist.broadcast(buf, src=op.peer, async_op=True)
    if op.kind == SEND:
        return dist.isend(buf, dst=op.peer, tag=op.tag)
    return dist.irecv(buf, src=op.peer, tag=op.tag)


class StandIn:
    """A failed rank's part of each remaining bucket, done with scratch bytes.

    Its peers are already inside the bucket's collectives: posting the same ops (plan.wire.wire_ops) lets
    every rank finish the transfer and reach the agreement step, which names this rank and its error
    within seconds (what was received meanwhile is never used: the load fails there).
    """

    def __init__(self, plan: LoadPlan, rank: int, shm: bool, device: torch.device, groups: dict | None = None):
        self.plan, self.rank, self.shm, self.device, self.groups = plan, rank, shm, device, groups
        self._scratch: torch.Tensor | None = None  # allocated only once a rank has failed

    def post(self, bucket: Bucket) -> list:
        ops = wire_ops(self.plan, bucket, self.rank, self.shm)
        if not ops:
            return []
        if self._scratch is None:
            need = max(stand_in_slices(wire_ops(self.plan, b, self.rank, self.shm))[1] for b in self.plan.buckets)
            self._scratch = torch.zeros(max(need, 1), dtype=torch.uint8, device=self.device)
        slices, _ = stand_in_slices(ops)
        return post_all([(op, self._scratch[a:b]) for op, (a, b) in zip(ops, slices)], self.groups)
