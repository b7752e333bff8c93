"""The bucketed transfer: one plan's bytes into this rank's preallocated params."""

from __future__ import annotations

from collections import deque

import torch

from .. import faults
from ..checkpoint import Reader
from ..errors import DistloadError
from ..plan import Bucket, LoadPlan
from ..plan.buckets import transfer_order
from ..plan.wire import (BROADCAST, FANOUT, PACKED, SHM_DONE, SHM_DONE_BYTES, SHM_TOKEN, SHM_TOKEN_BYTES, describe,
                         from_reader, p2p_bytes, p2p_receivers, via_shm, wire_ops)
from .agreement import LostPeer
from .bucket_reads import BucketReads
from .buffers import BufferPool, ReadAhead, SharedSlots, TransferStats, attach_slot, shm_usable
from .fanout import FanOut, close_groups, fanout_bytes, make_groups
from .pieces import ParamWriter, item_block, landing_region, message
from .posting import StandIn, post_all

# Buckets in flight per reader this rank takes bytes from (or is), up to MAX_DEPTH: the readers' buckets take turns in
# the transfer order, so a window of a fixed number of buckets left all but a few of a node's peers idle at 4 and
# 8 nodes (BENCHMARKS.md, "Cluster"). Buffers beyond what the wire holds are never touched (BufferPool is LIFO).
DEPTH_PER_READER = 2
MAX_DEPTH = 16


class Transfer:
    """Moves one plan's bytes into this rank's preallocated params.

    Copies are what cost on a host (first-touch page faults make a copy into fresh memory several times a
    warm one), so bytes take the shortest path: a reader's own rows go from the file straight into its
    params (one `preadv` per range); a rank on the reader's node copies its pieces straight out of the
    reader's shared-memory read buffer (gloo on CPU); for a rank elsewhere, a large piece whose region is
    contiguous at both ends goes from the read buffer straight onto the wire and from the wire straight into
    its param, and only strided pieces (row-parallel columns) and tiny ones are packed and unpacked. Which
    op each rank posts for each bucket is plan.wire.wire_ops: the sender, the receiver and a failed rank's
    stand-in all post exactly those.

    shm: whether ranks of one node may share read buffers (used where the backend and platform allow).
    """

    def __init__(self, plan: LoadPlan, rank: int, params: dict[str, torch.Tensor], reader: Reader | None = None,
                 device: torch.device | str = "cpu", depth: int | None = None, progress=None, on_bucket_done=None,
                 shm: bool = True):
        self.plan, self.rank, self.params, self.reader = plan, rank, params, reader
        self.on_bucket_done = on_bucket_done  # called with each bucket once this rank's share of it has landed
        self.device = torch.device(device)
        self.progress = progress
        self.stats = TransferStats()
        self.error: BaseException | None = None
        self.world = plan.layout.world
        self.writer = ParamWriter(plan, rank, params, self.stats)
        # Collective over the world: first, so that every rank makes the fan-out groups before anything here fails.
        self.groups = make_groups(plan)
        self.order = transfer_order(plan)
        mine = [b for b in self.order if b.reader == rank]
        self.depth = max(1, depth or window(plan, rank))
        biggest_read = max((b.read_bytes for b in plan.buckets), default=0)
        biggest_recv = max((b.read_bytes if b.broadcast else p2p_bytes(b, rank) for b in plan.buckets), default=0)
        biggest_send = max((sum(p2p_bytes(b, d) for d in p2p_receivers(b)) for b in mine if not b.broadcast), default=0)
        biggest_fan = max((fanout_bytes(plan, b, rank) for b in plan.buckets), default=0)
        on_cuda = self.device.type == "cuda"
        self.shm = shm_usable(self.world, self.device, shm)
        self._slots: SharedSlots | None = None
        self._attached: dict[tuple[int, int], torch.Tensor] = {}   # other readers' slots this rank has mapped
        read_buffers = None
        if any(via_shm(plan, b, d, self.shm) for b in mine if not b.broadcast for d in p2p_receivers(b)):
            try:
                self._slots = SharedSlots(self.depth + 2, biggest_read)
                read_buffers = self._slots.slots
            except OSError as exc:  # no shared memory to be had: this rank stands in (see run), the job fails
                self.error = DistloadError(f"cannot make {self.depth + 2} x {biggest_read >> 20} MiB of shared staging "
                                           f"memory: {exc}; free memory, or set DISTLOAD_SHM=0 to send it over gloo")
        # Read buffers: one per in-flight bucket plus one being filled by the read-ahead. Buckets never
        # exceed the staging size unless a single row does; size to the largest bucket. Pages of a buffer
        # that direct paths never touch cost no memory.
        self.read_pool = BufferPool(self.depth + 2 if mine else 0, biggest_read, torch.device("cpu"), pin=on_cuda,
                                     buffers=read_buffers)
        self.recv_pool = BufferPool(self.depth + 1, biggest_recv, self.device) if self.world > 1 else None
        self.send_pool = BufferPool(self.depth + 1, biggest_send, self.device) if mine and self.world > 1 else None
        # Fan-out buffers: a reader packs its groups' at posting (up to depth + 1 in flight), others at completion.
        self.fan_pool = BufferPool(self.depth + 2, biggest_fan, self.device) if biggest_fan else None
        self.reads = BucketReads(plan, rank, params, reader, self.device, mine)
        self.stand_in = StandIn(plan, rank, self.shm, self.device, self.groups)
        # The read-ahead thread overlaps reading with the wire (and, on CUDA, with the copies to the device).
        # Alone on a host there is nothing to overlap, and every hand-off between threads costs a wake-up
        # (milliseconds on a busy machine): read inline.
        self.read_ahead = ReadAhead(mine, self.reads.fill, self.read_pool) if mine and (self.world > 1 or on_cuda) else None

    def _ops(self, bucket: Bucket):
        return wire_ops(self.plan, bucket, self.rank, self.shm)

    # -- the reader's side ---------------------------------------------------------------------------

    def _next_read(self, bucket: Bucket) -> tuple[torch.Tensor, list]:
        """This reader's read buffer holding `bucket`, and the deliveries read straight into params."""
        if self.read_ahead is None:
            index, host, read_error, read_direct = bucket.index, self.read_pool.get(), None, []
            try:
                read_direct = self.reads.fill(bucket, host)
            except Exception as exc:  # reported at the phase's agreement step
                read_error = exc
        else:
            index, host, read_error, read_direct = self.read_ahead.ready.get()
        if index != bucket.index:
            raise RuntimeError(f"read-ahead out of order: got bucket {index}, expected {bucket.index}")
        if read_error is not None and self.error is None:
            self.error = read_error
        self.stats.bytes_read += bucket.read_bytes
        return host, read_direct

    def _post_as_reader(self, bucket: Bucket, ops):
        host, read_direct = self._next_read(bucket)
        release = []
        staged = host
        if ops and self.device.type != "cpu":  # one H2D copy of the read bytes; broadcast or pack from there
            staged = self.recv_pool.get()
            staged[:bucket.read_bytes].copy_(host[:bucket.read_bytes], non_blocking=True)
            release.append(lambda: self.recv_pool.put(staged))
        fan = FanOut(self.rank, ops, self.fan_pool)
        ops = [op for op in ops if op.kind != FANOUT]
        if ops and ops[0].kind == BROADCAST:
            works = post_all([(ops[0], staged[:bucket.read_bytes])])
            self.stats.bytes_sent += bucket.read_bytes * (self.world - 1)
        else:
            works = post_all(self._sends(bucket, ops, host, staged, release)) if ops else []
            self.stats.bytes_sent += sum(p2p_bytes(bucket, d) for d in {op.peer for op in ops})
        # The reader's own share goes straight from the read buffer into its params, now; what its groups'
        # replicas take is packed for their fan-out before the read buffer is reused.
        self._guarded(lambda: self.writer.own_share(host, bucket, read_direct))
        if fan:
            self._guarded(lambda: fan.pack(lambda item: item_block(self.plan, host, bucket, item)))
        if works and self.device.type == "cpu":
            release.append(lambda: self.read_pool.put(host))  # the read buffer is on the wire
        else:
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()  # H2D copies done before reuse
            self.read_pool.put(host)

        def finish(fan):
            for r in release:
                r()
        return works, finish, fan

    def _sends(self, bucket: Bucket, ops, host: torch.Tensor, staged: torch.Tensor, release: list) -> list:
        """The buffer of each of the reader's point-to-point ops: shared-memory tokens naming its read buffer
        (and room for the replies), packed messages in the send buffer, direct pieces from the read buffer."""
        pairs, spare, at, sent = [], None, 0, {}
        for op in ops:
            if op.carries == SHM_TOKEN:  # it copies its pieces out of this read buffer itself
                if self._slots is None:
                    raise self.error or RuntimeError("no shared-memory staging")
                pairs.append((op, self._slots.token(host)))
            elif op.carries == SHM_DONE:
                pairs.append((op, torch.empty(SHM_DONE_BYTES, dtype=torch.uint8)))
            else:
                if spare is None:
                    spare = self.send_pool.get()
                    release.append(lambda: self.send_pool.put(spare))
                buf, used = message(self.plan, staged, spare[at:], bucket, op)
                pairs.append((op, buf))
                at += used
                sent[op.peer] = sent.get(op.peer, 0) + buf.numel()
        for dst, n in sent.items():
            if n != p2p_bytes(bucket, dst):
                raise RuntimeError(f"bucket {bucket.index}: {n} bytes for rank {dst}, "
                                   f"plan says {p2p_bytes(bucket, dst)}")
        return pairs

    # -- a receiver's side ---------------------------------------------------------------------------

    def _post_as_receiver(self, bucket: Bucket, ops):
        me = self.rank
        fan = FanOut(me, ops, self.fan_pool)
        ops = [op for op in ops if op.kind != FANOUT]
        if not ops:
            return [], lambda fan: None, fan
        n = bucket.read_bytes if bucket.broadcast else p2p_bytes(bucket, me)
        if ops[0].carries == SHM_TOKEN:
            return (*self._post_shm_receive(bucket, ops, n), fan)
        buf = self.recv_pool.get()
        self.stats.bytes_received += n
        if self.plan.layout.node(bucket.reader) != self.plan.layout.node(me):
            self.stats.bytes_from_other_nodes += n
        if ops[0].kind == BROADCAST:
            wire = buf[:n]
            works = post_all([(ops[0], wire)])

            def finish_broadcast(fan):
                try:
                    self.writer.unpack_broadcast(wire, self.plan.items(bucket, me))
                finally:
                    self.recv_pool.put(buf)
            return works, finish_broadcast, fan
        pairs, scratch, landed, at = [], [], [], 0
        arrived = {}   # item -> its bytes as they arrived (flat), for this rank's fan-outs as a leader
        for op in ops:
            if op.carries == PACKED:  # first, at the start of the receive buffer
                region, at = buf[:op.nbytes], op.nbytes
                for item, offset in op.packed:
                    arrived[item] = buf[offset:offset + item.nbytes]
            else:
                src_dtype = self.plan.sources[op.item.chunk.source].dtype
                region = landing_region(self.params, op.item.param, op.item.piece, src_dtype, self.device)
                if region is None:  # e.g. the caller's module has another dtype: convert after arrival
                    region = buf[at:at + op.nbytes]
                    at += op.nbytes
                    scratch.append((op.item, region))
                else:
                    landed.append(op.item)
                arrived[op.item] = region
            pairs.append((op, region))
        works = post_all(pairs)

        def finish(fan):
            try:
                if fan:
                    fan.pack(lambda item: arrived[item].view(item.piece.rows[1] - item.piece.rows[0], -1))
                for op in ops:
                    for item, offset in op.packed:
                        self.writer.unpack_wire_item(buf[offset:offset + item.nbytes], item)
                for item, region in scratch:
                    self.writer.unpack_wire_item(region, item)
                for item in landed:
                    self.stats.record(item.param, item.piece)
            finally:
                self.recv_pool.put(buf)
        return works, finish, fan

    def _post_shm_receive(self, bucket: Bucket, ops, n: int):
        """This rank's share of a bucket whose reader is on this node: wait for its token, copy the pieces
        out of the reader's shared slot (and pack its groups' fan-outs from there), then tell it the slot
        is free again."""
        token_op, done_op = ops
        token = torch.empty(SHM_TOKEN_BYTES, dtype=torch.uint8)
        works = post_all([(token_op, token)])
        self.stats.bytes_received += n

        def finish(fan):
            try:
                slot = attach_slot(token, self._attached)
                if fan:
                    fan.pack(lambda item: item_block(self.plan, slot, bucket, item))
                self.writer.from_read_buffer(slot, bucket, from_reader(self.plan, bucket, self.rank))
            finally:  # even after a failed copy: the reader waits for this to reuse the slot
                post_all([(done_op, torch.zeros(SHM_DONE_BYTES, dtype=torch.uint8))])[0].wait()
        return works, finish

    # -- the loop ------------------------------------------------------------------------------------

    def _post(self, bucket: Bucket):
        """Start this rank's part of one bucket; returns (works, finish) to complete it later."""
        ops = self._ops(bucket)
        if bucket.reader == self.rank:
            return self._post_as_reader(bucket, ops)
        return self._post_as_receiver(bucket, ops)

    def _post_stand_in(self, bucket: Bucket):
        """This rank's part of `bucket` done with scratch bytes, once it cannot do the real one (StandIn)."""
        try:
            return self.stand_in.post(bucket), lambda fan: None, FanOut(self.rank, (), None)
        except Exception as exc:
            raise LostPeer(describe(self.plan, bucket, self.rank, self._ops(bucket)), exc) from exc

    def _guarded(self, fn) -> None:
        try:
            fn()
        except BaseException as exc:  # keep the protocol going; the agreement step reports it
            if self.error is None:
                self.error = exc

    def _complete(self, bucket: Bucket, works, finish, fan) -> None:
        """Wait for the bucket's ops, land what came; then its fan-outs (posted here, in bucket order on every
        member of a group, once the leader's own copy is complete)."""
        self._wait(bucket, works)
        self._guarded(lambda: finish(fan))
        if fan:
            try:
                self._wait(bucket, post_all(fan.pairs(), self.groups), fanouts=len(fan.ops))
                self._guarded(lambda: self._land_fanout(bucket, fan))
            finally:
                fan.release()
        if self.on_bucket_done is not None and self.error is None:
            self._guarded(lambda: self.on_bucket_done(bucket))

    def _wait(self, bucket: Bucket, works, fanouts: int = 0) -> None:
        """Wait for `works` (the bucket's last `fanouts` ops when that many, else its first ones)."""
        for i, w in enumerate(works):
            try:
                w.wait()
            except Exception as exc:  # a peer is gone or silent past the timeout: this protocol is over
                ops = self._ops(bucket)
                failed = len(ops) - fanouts + i if fanouts else i
                raise LostPeer(describe(self.plan, bucket, self.rank, ops, failed), exc) from exc

    def _land_fanout(self, bucket: Bucket, fan: FanOut) -> None:
        fan.unpack(self.writer)
        node = self.plan.layout.node
        for op in fan.ops:
            if op.peer == self.rank:
                self.stats.bytes_sent += op.nbytes * (op.group.count - 1)
            else:
                self.stats.bytes_received += op.nbytes
                self.stats.bytes_from_other_nodes += op.nbytes if node(op.peer) != node(self.rank) else 0

    def run(self) -> TransferStats:
        if self.read_ahead is not None:
            self.read_ahead.start()
        in_flight: deque = deque()
        active = 0   # buckets in flight with ops of this rank: those alone hold buffers and take the window
        try:
            standing_in = False
            for bucket in self.order:
                if not standing_in:
                    try:
                        faults.hit("transfer")  # test hook (DISTLOAD_FAULT), a no-op otherwise
                        in_flight.append((bucket, *self._post(bucket)))
                    except LostPeer:
                        raise
                    except Exception as exc:  # this rank cannot go on, but its peers wait for it in this bucket
                        if self.error is None:
                            self.error = exc
                        standing_in = True
                if standing_in:
                    in_flight.append((bucket, *self._post_stand_in(bucket)))
                self.stats.buckets += 1
                active += _holds(in_flight[-1])
                while in_flight and (active > self.depth or not _holds(in_flight[0])):
                    active -= _holds(in_flight[0])
                    self._complete(*in_flight.popleft())
                if self.progress is not None:
                    self.progress(bucket)
            while in_flight:
                self._complete(*in_flight.popleft())
        finally:
            if self.read_ahead is not None:
                self.read_ahead.stop.set()
                # A read-ahead blocked on an empty pool (this run raised) sees `stop` once it gets a buffer.
                self.read_pool.put(torch.empty(1, dtype=torch.uint8))
                # Its `fill` holds the params: drop the thread so the params and buffers are freed when the
                # caller lets go of them, not at some later garbage collection.
                self.read_ahead = None
            if self._slots is not None:
                self._slots.close()
            self._attached = {}
            close_groups(self.groups)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return self.stats


def window(plan: LoadPlan, rank: int) -> int:
    """Buckets this rank keeps in flight: DEPTH_PER_READER per reader it takes bytes from or is, up to MAX_DEPTH."""
    readers = {b.reader for b in plan.buckets
               if b.reader == rank or (b.broadcast and b.read_bytes) or p2p_bytes(b, rank) or fanout_bytes(plan, b, rank)}
    return min(MAX_DEPTH, DEPTH_PER_READER * max(1, len(readers)))


def _holds(posted) -> bool:
    """Does a posted bucket (bucket, works, finish, fan) have ops of this rank in flight (and with them buffers)?"""
    _, works, _, fan = posted
    return bool(works) or bool(fan)
