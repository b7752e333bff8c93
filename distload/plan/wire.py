"""The wire: which ops each rank posts for each bucket, a pure function of the plan.

The sender, the receiver and a failed rank's stand-in all post what `wire_ops` says, and nothing else: a
send without its receive (or a broadcast some rank skips) is a hang, not an error, so the three must never
disagree. Three protocols share the wire:

- broadcast: a bucket every rank keeps whole goes out as one broadcast of its read bytes;
- point to point: the reader sends each rank its packed message (small or strided pieces, end to end),
  then one message per direct item (a large piece contiguous in the receiver's param, which lands there
  with no copy);
- same-node shared memory (gloo on CPU): the reader sends a token naming its shared read buffer, the
  receiver copies its pieces out of it and answers "done" so the reader may reuse the buffer.

Data-parallel replicas never multiply what a reader sends: for each group of ranks that hold one shard
(plan/ranks.py), the reader delivers the group's bytes to one member, the one in its own block of ranks
(`Ranks.nearest`, on the reader's node when tp fits a node), and that leader fans them out to the
other members by one broadcast within the group (FANOUT), once its own copy has arrived. So a rank
posts O(1) ops per bucket, whatever the number of replicas, and every byte leaves storage once; the
fan-out broadcasts are where NCCL's trees and rings carry the bytes across nodes.

Every point-to-point op of a bucket carries the bucket's index as its tag; messages between one pair of
ranks with one tag match in posting order.
"""

from __future__ import annotations

from dataclasses import dataclass

from .ranks import Ranks
from .types import Bucket, Item, LoadPlan
from .shard import view2d

# Items at least this big whose region is contiguous in the receiver's param travel as a message of
# their own, straight from the read buffer into the param: no pack copy, no unpack copy. Smaller ones
# share one packed message per bucket and destination, so a bucket of tiny tensors costs one message.
DIRECT_MIN_BYTES = 256 << 10

SHM_TOKEN_BYTES = 32    # reader pid, fd, slot index, slot size (int64 each)
SHM_DONE_BYTES = 8

BROADCAST, SEND, RECV, FANOUT = "broadcast", "send", "recv", "fanout"
# What one op's buffer holds.
BUCKET_BYTES = "bucket"      # broadcast: the bucket's read bytes, its chunks end to end
PACKED = "packed"            # point to point: `packed` items at their offsets
DIRECT = "direct"            # point to point: the one `item`
SHM_TOKEN = "shm-token"      # shared memory: which of the reader's slots holds the bucket
SHM_DONE = "shm-done"        # shared memory: the receiver is done with the slot
GROUP_BYTES = "group"        # fan-out: one group's items of the bucket, end to end (`packed` offsets)


@dataclass(frozen=True)
class Wire:
    """What one rank receives from one point-to-point bucket, in wire order: the packed message (if any),
    then one message per direct item."""
    packed: tuple[tuple[Item, int], ...]     # (item, offset inside the packed message)
    packed_bytes: int
    direct: tuple[Item, ...]


@dataclass(frozen=True)
class WireOp:
    """One op a rank posts for a bucket."""
    kind: str                                # BROADCAST, SEND, RECV or FANOUT
    peer: int                                # send: destination; recv: source; (fan-out) broadcast: its root
    nbytes: int
    tag: int                                 # the bucket's index
    carries: str                             # BUCKET_BYTES, PACKED, DIRECT, SHM_TOKEN or SHM_DONE
    packed: tuple[tuple[Item, int], ...] = ()  # PACKED: (item, offset inside the message)
    item: Item | None = None                 # DIRECT: the item
    group: Ranks | None = None               # FANOUT: the ranks that take part (the root: its leader)

    @property
    def fills(self) -> bool:
        """Does posting this op write into its buffer (a receive, or a broadcast on any rank)?"""
        return self.kind != SEND


def _dst_contiguous(local_shape: tuple[int, ...], piece) -> bool:
    """Is the piece's destination one contiguous byte range of the param (whole rows of its 2-D view)?"""
    return piece.cols[1] - piece.cols[0] == view2d(tuple(local_shape))[1] or piece.rows[1] - piece.rows[0] <= 1


def from_reader(plan: LoadPlan, bucket: Bucket, rank: int) -> list[Item]:
    """`rank`'s items of a point-to-point bucket that come from the reader itself (it leads their group)."""
    return [it for it in plan.items(bucket, rank) if it.ranks.nearest(bucket.reader) == rank]


def p2p_bytes(bucket: Bucket, rank: int) -> int:
    """Bytes of a point-to-point bucket that `rank` takes from the reader (for the groups it leads)."""
    return sum(n for g, n in bucket.groups if rank in g and g.nearest(bucket.reader) == rank)


def p2p_receivers(bucket: Bucket) -> list[int]:
    """The ranks the reader sends a point-to-point bucket to, in rank order: each group's leader."""
    return sorted({g.nearest(bucket.reader) for g, n in bucket.groups if n} - {bucket.reader})


def fanout_groups(plan: LoadPlan) -> tuple[Ranks, ...]:
    """Every group that some bucket fans out to (more than one member), sorted: the process groups the
    transfer makes, in the same order on every rank."""
    return tuple(sorted({g for b in plan.buckets if not b.broadcast for g, n in b.groups if n and g.count > 1}))


def _fanouts(plan: LoadPlan, bucket: Bucket, rank: int) -> list[WireOp]:
    """The group broadcasts `rank` takes part in for a point-to-point bucket: one per group of its with
    bytes in it, groups in sorted order (the same on every member)."""
    mine = sorted(g for g, n in bucket.groups if n and g.count > 1 and rank in g)
    if not mine:
        return []
    items = plan.items(bucket, rank)
    ops = []
    for g in mine:
        packed, at = [], 0
        for it in items:
            if it.ranks == g:
                packed.append((it, at))
                at += it.nbytes
        ops.append(WireOp(FANOUT, g.nearest(bucket.reader), at, bucket.index, GROUP_BYTES, tuple(packed), group=g))
    return ops


def wire_layout(plan: LoadPlan, bucket: Bucket, rank: int) -> Wire:
    """How `rank`'s items from the reader (point to point) are split into its packed message and direct ones."""
    packed, at, direct = [], 0, []
    specs = plan.staging_specs(rank)
    for item in from_reader(plan, bucket, rank):
        if item.nbytes >= DIRECT_MIN_BYTES and _dst_contiguous(specs[item.param].local_shape, item.piece):
            direct.append(item)
        else:
            packed.append((item, at))
            at += item.nbytes
    return Wire(tuple(packed), at, tuple(direct))


def via_shm(plan: LoadPlan, bucket: Bucket, rank: int, shm: bool) -> bool:
    """Does `rank` take its share of this bucket out of the reader's shared memory (same node, p2p)?
    shm: whether shared memory is usable at all (the same answer on every rank)."""
    node = plan.layout.node
    return shm and not bucket.broadcast and node(bucket.reader) == node(rank)


def _exchange(plan: LoadPlan, bucket: Bucket, receiver: int, shm: bool, sending: bool) -> list[WireOp]:
    """The ops between the bucket's reader and `receiver`, as the reader posts them (sending) or as the
    receiver does: the same messages, the same order, mirrored kinds."""
    there, back = (SEND, RECV) if sending else (RECV, SEND)
    peer, tag = (receiver if sending else bucket.reader), bucket.index
    if via_shm(plan, bucket, receiver, shm):
        return [WireOp(there, peer, SHM_TOKEN_BYTES, tag, SHM_TOKEN), WireOp(back, peer, SHM_DONE_BYTES, tag, SHM_DONE)]
    wire = wire_layout(plan, bucket, receiver)
    ops = [WireOp(there, peer, wire.packed_bytes, tag, PACKED, packed=wire.packed)] if wire.packed_bytes else []
    return ops + [WireOp(there, peer, item.nbytes, tag, DIRECT, item=item) for item in wire.direct]


def wire_ops(plan: LoadPlan, bucket: Bucket, rank: int, shm: bool) -> tuple[WireOp, ...]:
    """The ops `rank` posts for `bucket`, in posting order (the reader: destinations in rank order).
    Nothing to move, nothing posted: a bucket nobody else receives (or of no bytes) has no ops."""
    if plan.layout.world == 1:
        return ()
    if bucket.broadcast:
        if not bucket.read_bytes:
            return ()
        return (WireOp(BROADCAST, bucket.reader, bucket.read_bytes, bucket.index, BUCKET_BYTES),)
    if rank != bucket.reader:
        ops = _exchange(plan, bucket, rank, shm, sending=False) if p2p_bytes(bucket, rank) else []
    else:
        ops = [op for dst in p2p_receivers(bucket) for op in _exchange(plan, bucket, dst, shm, sending=True)]
    return tuple(ops + _fanouts(plan, bucket, rank))


def stand_in_slices(ops: tuple[WireOp, ...]) -> tuple[list[tuple[int, int]], int]:
    """Where a stand-in's scratch buffer holds each op's bytes: ([start, stop) per op, bytes needed).
    Ops that fill their buffer get ranges of their own; sends all read from the start (what they send is
    never used)."""
    slices, at = [], 0
    for op in ops:
        if op.fills:
            slices.append((at, at + op.nbytes))
            at += op.nbytes
        else:
            slices.append((0, op.nbytes))
    return slices, max([at] + [op.nbytes for op in ops])


def describe(plan: LoadPlan, bucket: Bucket, rank: int, ops: tuple[WireOp, ...], failed: int | None = None) -> str:
    """What `rank` was doing with whom in a bucket when op number `failed` of `ops` (None: any) failed."""
    if failed is not None and failed < len(ops) and ops[failed].kind == FANOUT:
        op = ops[failed]
        g = op.group
        return (f"{'sending' if op.peer == rank else 'receiving'} bucket {bucket.index} to the replicas of ranks "
                f"{g.first}..{g.last} step {g.step} (fan-out from rank {op.peer})")
    if bucket.reader != rank:
        how = "broadcast" if bucket.broadcast else "message"
        return f"receiving bucket {bucket.index} ({how} from rank {bucket.reader})"
    if bucket.broadcast:
        to = [d for d in range(plan.layout.world) if d != rank]
    elif failed is not None and failed < len(ops):
        to = [ops[failed].peer]
    else:
        to = list(dict.fromkeys(op.peer for op in ops))
    return f"sending bucket {bucket.index} to rank{'s' if len(to) > 1 else ''} {', '.join(map(str, to))}"
