"""The bucketed transfer: one plan's bytes into this rank's preallocated params."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .. import faults
from ..dtypes import torch_dtype
from ..errors import DistloadError
from ..plan import Bucket, Item, LoadPlan, Source, broadcast_offset, clip
from ..plan.shard import view2d
from .agreement import LostPeer
from .buffers import (SHM_DONE_BYTES, SHM_TOKEN_BYTES, BufferPool, ReadAhead, SharedSlots, TransferStats,
                      attach_slot, piece_bytes, shm_usable, typed2d, write_piece)
from .collectives import require_contiguous


# How many of its next buckets a reader asks storage for while it reads one (RangeReader.prefetch: only
# readers without kernel read-ahead, or with the prefetch strategy, act on it). Two emulated nodes, each
# reader reading exactly its rows (no read-ahead): 0.85-0.89x every-rank-reads cold without asking ahead,
# 0.73x one bucket ahead, 0.69-0.71x two (scripts/bench.py, 2 runs, 7-9 reps, same runs).
PREFETCH_BUCKETS = 2

# Items at least this big whose region is contiguous in the receiver's param travel as a message of
# their own, straight from the read buffer into the param: no pack copy, no unpack copy. Smaller ones
# share one packed message per bucket and destination, so a bucket of tiny tensors costs one message.
DIRECT_MIN_BYTES = 256 << 10


@dataclass(frozen=True)
class Wire:
    """What one rank receives from one point-to-point bucket, in wire order: the packed message (if any),
    then one message per direct item. A pure function of the plan, so sender and receiver agree."""
    packed: tuple[tuple[Item, int], ...]     # (item, offset inside the packed message)
    packed_bytes: int
    direct: tuple[Item, ...]


def _dst_contiguous(local_shape: tuple[int, ...], piece) -> bool:
    """Is the piece's destination one contiguous byte range of the param (whole rows of its 2-D view)?"""
    return piece.cols[1] - piece.cols[0] == view2d(tuple(local_shape))[1] or piece.rows[1] - piece.rows[0] <= 1


def wire_layout(plan: LoadPlan, bucket: Bucket, rank: int) -> Wire:
    packed, at, direct = [], 0, []
    specs = plan.staging_specs(rank)
    for item in plan.items(bucket, rank):
        if item.nbytes >= DIRECT_MIN_BYTES and _dst_contiguous(specs[item.param].local_shape, item.piece):
            direct.append(item)
        else:
            packed.append((item, at))
            at += item.nbytes
    return Wire(tuple(packed), at, tuple(direct))


class Transfer:
    """Moves one plan's bytes into this rank's preallocated params.

    Copies are what cost on a host (first-touch page faults make a copy into fresh memory 3-7x a warm
    one), so bytes take the shortest path: a reader's own rows go from the file straight into its params
    (one `preadv` per range); a rank on the reader's node copies its pieces straight out of the reader's
    shared-memory read buffer (gloo on CPU); for a rank elsewhere, a large piece whose region is contiguous
    at both ends goes from the read buffer straight onto the wire and from the wire straight into its
    param, and only strided pieces (row-parallel columns) and tiny ones are packed and unpacked.
    """

    def __init__(self, plan: LoadPlan, rank: int, params: dict[str, torch.Tensor], reader=None,
                 device: torch.device | str = "cpu", depth: int = 2, progress=None, on_bucket_done=None):
        self.plan, self.rank, self.params, self.reader = plan, rank, params, reader
        self.on_bucket_done = on_bucket_done  # called with each bucket once this rank's share of it has landed
        self.device = torch.device(device)
        self.depth = max(1, depth)
        self.progress = progress
        self.stats = TransferStats()
        self.error: BaseException | None = None
        self.world = plan.layout.world
        biggest_read = max((b.read_bytes for b in plan.buckets), default=0)
        biggest_recv = max((max(b.recv_bytes) if not b.broadcast else b.read_bytes for b in plan.buckets), default=0)
        biggest_send = max((sum(b.recv_bytes) - b.recv_bytes[b.reader] for b in plan.buckets if not b.broadcast), default=0)
        on_cuda = self.device.type == "cuda"
        mine = [b for b in plan.buckets if b.reader == rank]
        self.shm = shm_usable(self.world, self.device)
        self._slots: SharedSlots | None = None
        self._attached: dict[tuple[int, int], torch.Tensor] = {}   # other readers' slots this rank has mapped
        read_buffers = None
        if any(d != rank and b.recv_bytes[d] and self._via_shm(b, d) for b in mine for d in range(self.world)):
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
        self._wires: dict[tuple[int, int], Wire] = {}
        # Decided before the read-ahead starts, so that its thread and this one only read these.
        self._direct_reads = {(b.index, c): self._direct_candidates(b, c) for b in mine for c in b.chunks}
        self._mine = mine
        self._place = {b.index: i for i, b in enumerate(mine)}   # of each bucket in this reader's order
        # The read-ahead thread overlaps reading with the wire (and, on CUDA, with the copies to the device).
        # Alone on a host there is nothing to overlap, and every hand-off between threads costs a wake-up
        # (milliseconds on a busy machine): read inline.
        self.read_ahead = ReadAhead(mine, self._fill, self.read_pool) if mine and (self.world > 1 or on_cuda) else None

    # -- where bytes go ------------------------------------------------------------------------------

    def _wire(self, bucket: Bucket, rank: int) -> Wire:
        key = (bucket.index, rank)
        if key not in self._wires:
            self._wires[key] = wire_layout(self.plan, bucket, rank)
        return self._wires[key]

    def _dst_region(self, param: str, piece, src_dtype: str, device: torch.device) -> torch.Tensor | None:
        """The piece's region of the param as flat bytes, if bytes can land there as they are."""
        dst = self.params.get(param)
        if dst is None:  # allocated on its first write (postprocess.py: staging of a post-load step)
            return None
        if dst.dtype != torch_dtype(src_dtype) or dst.device != device:
            return None
        region = piece_bytes(dst, piece)
        return region.reshape(-1) if region.is_contiguous() else None

    def _via_shm(self, bucket: Bucket, rank: int) -> bool:
        """Does `rank` take its share of this bucket out of the reader's shared memory (same node, p2p)?"""
        node = self.plan.layout.node
        return self.shm and not bucket.broadcast and node(bucket.reader) == node(rank)

    def _direct_candidates(self, bucket: Bucket, chunk) -> list:
        """This reader's own pieces of a chunk that may be read from the file straight into its params: whole
        rows of the source (one byte range) that no other delivery needs from the read buffer. Whether the
        param can take the bytes as they are (dtype, device, allocated yet) is checked when reading."""
        if self.device.type != "cpu" or (self.world > 1 and bucket.broadcast):
            return []  # params on a device / the whole read buffer goes on the wire
        src = self.plan.sources[chunk.source]
        clipped = [(d, clip(d.piece, chunk.rows)) for d in src.deliveries]
        clipped = [(d, p) for d, p in clipped if p is not None]
        out = []
        for d, piece in clipped:
            if d.rank != self.rank or piece.cols != (0, view2d(src.shape)[1]):
                continue
            if any(o is not d and o_p.rows[0] < piece.rows[1] and piece.rows[0] < o_p.rows[1] for o, o_p in clipped):
                continue
            out.append((d, piece))
        return out

    def _fill(self, bucket: Bucket, buf: torch.Tensor) -> list:
        """Read one bucket (read-ahead thread): own pieces straight into params where they can take them,
        the rest into `buf` (same layout as the bucket). Returns the deliveries read straight into params."""
        # Storage fetches what comes next while this bucket is read and sent (the first fill names the first).
        i = self._place[bucket.index]
        upto = i + PREFETCH_BUCKETS + 1
        for later in self._mine[0 if i == 0 else upto - 1:upto]:
            self._prefetch(later)
        at, direct = 0, []
        for chunk in bucket.chunks:
            src = self.plan.sources[chunk.source]
            start, n = src.offset + chunk.rows[0] * src.row_bytes, (chunk.rows[1] - chunk.rows[0]) * src.row_bytes
            ranges = []
            for d, piece in self._direct_reads[(bucket.index, chunk)]:
                region = self._dst_region(d.param, piece, src.dtype, torch.device("cpu"))
                if region is not None:
                    lo = (piece.rows[0] - chunk.rows[0]) * src.row_bytes
                    ranges.append((lo, lo + region.numel(), region))
                    direct.append(d)
            ranges.sort(key=lambda r: r[0])
            pos = 0
            for lo, hi, region in ranges + [(n, n, None)]:
                if lo > pos:  # bytes others need (or that need converting): into the read buffer, same layout
                    self.reader.read_into(src.file, start + pos, buf[at + pos:at + lo])
                if region is not None:
                    self.reader.read_into(src.file, start + lo, region)
                pos = hi
            at += n
        return direct

    def _prefetch(self, bucket: Bucket) -> None:
        for chunk in bucket.chunks:
            src = self.plan.sources[chunk.source]
            self.reader.prefetch(src.file, src.offset + chunk.rows[0] * src.row_bytes,
                                 (chunk.rows[1] - chunk.rows[0]) * src.row_bytes)

    # -- copying pieces ------------------------------------------------------------------------------

    def _source_block(self, buf: torch.Tensor, base: int, src: Source, chunk_row0: int, piece) -> torch.Tensor:
        """Bytes of `piece` (rows absolute in the source) inside a buffer holding rows from chunk_row0 at base."""
        start = base + (piece.rows[0] - chunk_row0) * src.row_bytes
        stop = base + (piece.rows[1] - chunk_row0) * src.row_bytes
        isz = torch_dtype(src.dtype).itemsize
        block = buf[start:stop].view(piece.rows[1] - piece.rows[0], src.row_bytes)
        return block[:, piece.cols[0] * isz:piece.cols[1] * isz]

    def _write(self, param: str, piece, block_bytes: torch.Tensor, src_dtype: str) -> None:
        """Copy a block (uint8 [rows, cols*itemsize]) into the param's region; record the rectangle."""
        write_piece(self.params[param], piece, block_bytes, torch_dtype(src_dtype))
        self.stats.record(param, piece)

    def _unpack_wire_item(self, block: torch.Tensor, item: Item) -> None:
        """Copy one received (contiguous) item into its param."""
        src = self.plan.sources[item.chunk.source]
        isz = torch_dtype(src.dtype).itemsize
        rows = item.piece.rows[1] - item.piece.rows[0]
        block = block.view(rows, -1) if rows else block[:0].view(0, 0)
        if block.shape[1] != (item.piece.cols[1] - item.piece.cols[0]) * isz:
            raise RuntimeError(f"wire item for {item.param} has {block.shape[1]} bytes per row, plan says "
                               f"{(item.piece.cols[1] - item.piece.cols[0]) * isz}")
        self._write(item.param, item.piece, block, src.dtype)

    def _unpack_broadcast(self, buf: torch.Tensor, items: list[Item]) -> None:
        for item in items:
            src = self.plan.sources[item.chunk.source]
            block = self._source_block(buf, item.offset, src, item.chunk.rows[0], item.piece)
            self._write(item.param, item.piece, block, src.dtype)

    def _local_from_read_buffer(self, host: torch.Tensor, bucket: Bucket, read_direct: list) -> None:
        """The reader's own share: already in its params (read straight there), or copied from the read buffer."""
        at = 0
        direct = {id(d) for d in read_direct}
        for chunk in bucket.chunks:
            src = self.plan.sources[chunk.source]
            for d in src.deliveries:
                if d.rank != self.rank:
                    continue
                piece = clip(d.piece, chunk.rows)
                if piece is None:
                    continue
                if id(d) in direct:
                    self.stats.record(d.param, piece)
                else:
                    self._write(d.param, piece, self._source_block(host, at, src, chunk.rows[0], piece), src.dtype)
            at += (chunk.rows[1] - chunk.rows[0]) * src.row_bytes

    def _item_block(self, staged: torch.Tensor, bucket: Bucket, item: Item) -> torch.Tensor:
        src = self.plan.sources[item.chunk.source]
        base = broadcast_offset(self.plan, bucket, item.chunk)  # the chunk's place in the read buffer
        return self._source_block(staged, base, src, item.chunk.rows[0], item.piece)

    def _send_messages(self, staged: torch.Tensor, send: torch.Tensor, bucket: Bucket, dst: int) -> list[torch.Tensor]:
        """dst's messages of one bucket, in wire order: packed pieces, then direct ones (from the read buffer
        itself where the piece is one byte range of it)."""
        wire = self._wire(bucket, dst)
        messages, at = [], 0
        if wire.packed_bytes:
            out = send[:wire.packed_bytes]
            for item, offset in wire.packed:
                block = self._item_block(staged, bucket, item)
                out[offset:offset + item.nbytes].view(block.shape).copy_(block)
            messages.append(out)
            at = wire.packed_bytes
        for item in wire.direct:
            block = self._item_block(staged, bucket, item)
            if not block.is_contiguous():
                out = send[at:at + item.nbytes]
                out.view(block.shape).copy_(block)
                block, at = out, at + item.nbytes
            messages.append(block.reshape(-1))
        sent = sum(m.numel() for m in messages)
        if sent != bucket.recv_bytes[dst]:
            raise RuntimeError(f"bucket {bucket.index}: {sent} bytes for rank {dst}, "
                               f"plan says {bucket.recv_bytes[dst]}")
        return messages

    # -- the loop ------------------------------------------------------------------------------------

    def _post(self, bucket: Bucket):
        """Start this rank's part of one bucket; returns (works, finish) to complete it later."""
        me = self.rank
        if bucket.reader == me:
            if self.read_ahead is None:
                index, host, read_error, read_direct = bucket.index, self.read_pool.get(), None, []
                try:
                    read_direct = self._fill(bucket, host)
                except Exception as exc:  # reported at the phase's agreement step
                    read_error = exc
            else:
                index, host, read_error, read_direct = self.read_ahead.ready.get()
            if index != bucket.index:
                raise RuntimeError(f"read-ahead out of order: got bucket {index}, expected {bucket.index}")
            if read_error is not None and self.error is None:
                self.error = read_error
            self.stats.bytes_read += bucket.read_bytes
            works, release = [], []
            if self.world > 1 and bucket.broadcast:
                wire = host[:bucket.read_bytes]
                if self.device.type != "cpu":
                    dev = self.recv_pool.get()
                    dev[:bucket.read_bytes].copy_(wire, non_blocking=True)
                    wire = dev[:bucket.read_bytes]
                    release.append(lambda: self.recv_pool.put(dev))
                require_contiguous(wire, "broadcast buffer")
                works.append(dist.broadcast(wire, src=me, async_op=True))
                self.stats.bytes_sent += bucket.read_bytes * (self.world - 1)
            elif self.world > 1 and any(n for d, n in enumerate(bucket.recv_bytes) if d != me):
                staged = host
                if self.device.type != "cpu":  # pack on the device: one H2D copy of the read bytes
                    staged = self.recv_pool.get()
                    staged[:bucket.read_bytes].copy_(host[:bucket.read_bytes], non_blocking=True)
                    release.append(lambda: self.recv_pool.put(staged))
                send, at = None, 0
                for dst in range(self.world):
                    n = bucket.recv_bytes[dst]
                    if dst == me or n == 0:
                        continue
                    if self._via_shm(bucket, dst):  # it copies its pieces out of this read buffer itself
                        if self._slots is None:
                            raise self.error or RuntimeError("no shared-memory staging")
                        token, done = self._slots.token(host), torch.empty(SHM_DONE_BYTES, dtype=torch.uint8)
                        works.append(dist.isend(token, dst=dst, tag=bucket.index))
                        works.append(dist.irecv(done, src=dst, tag=bucket.index))
                        self.stats.bytes_sent += n
                        continue
                    if send is None:
                        send = self.send_pool.get()
                        release.append(lambda: self.send_pool.put(send))
                    for message in self._send_messages(staged, send[at:at + n], bucket, dst):
                        require_contiguous(message, "send buffer")
                        works.append(dist.isend(message, dst=dst, tag=bucket.index))
                    self.stats.bytes_sent += n
                    at += n
            # The reader's own share goes straight from the read buffer into its params, now.
            self._guarded(lambda: self._local_from_read_buffer(host, bucket, read_direct))
            if works and self.device.type == "cpu":
                release.append(lambda: self.read_pool.put(host))  # the read buffer is on the wire
            else:
                if self.device.type == "cuda":
                    torch.cuda.current_stream(self.device).synchronize()  # H2D copies done before reuse
                self.read_pool.put(host)

            def finish():
                for r in release:
                    r()
            return works, finish
        n = bucket.read_bytes if bucket.broadcast else bucket.recv_bytes[me]
        if n == 0:
            return [], lambda: None
        if self._via_shm(bucket, me):
            return self._post_shm_receive(bucket, n)
        buf = self.recv_pool.get()
        self.stats.bytes_received += n
        if self.plan.layout.node(bucket.reader) != self.plan.layout.node(me):
            self.stats.bytes_from_other_nodes += n
        if bucket.broadcast:
            wire = buf[:n]
            require_contiguous(wire, "receive buffer")
            works = [dist.broadcast(wire, src=bucket.reader, async_op=True)]

            def finish_broadcast():
                try:
                    self._unpack_broadcast(wire, self.plan.items(bucket, me))
                finally:
                    self.recv_pool.put(buf)
            return works, finish_broadcast
        layout = self._wire(bucket, me)
        works, scratch, landed, at = [], [], [], layout.packed_bytes
        if layout.packed_bytes:
            works.append(dist.irecv(buf[:layout.packed_bytes], src=bucket.reader, tag=bucket.index))
        for item in layout.direct:
            region = self._dst_region(item.param, item.piece, self.plan.sources[item.chunk.source].dtype, self.device)
            if region is None:  # e.g. the caller's module has another dtype: convert after arrival
                region = buf[at:at + item.nbytes]
                at += item.nbytes
                scratch.append((item, region))
            else:
                landed.append(item)
            require_contiguous(region, "receive buffer")
            works.append(dist.irecv(region, src=bucket.reader, tag=bucket.index))

        def finish():
            try:
                for item, offset in layout.packed:
                    self._unpack_wire_item(buf[offset:offset + item.nbytes], item)
                for item, region in scratch:
                    self._unpack_wire_item(region, item)
                for item in landed:
                    self.stats.record(item.param, item.piece)
            finally:
                self.recv_pool.put(buf)
        return works, finish

    def _post_shm_receive(self, bucket: Bucket, n: int):
        """This rank's share of a bucket whose reader is on this node: wait for its token, copy the pieces
        out of the reader's shared slot, then tell it the slot is free again."""
        token = torch.empty(SHM_TOKEN_BYTES, dtype=torch.uint8)
        works = [dist.irecv(token, src=bucket.reader, tag=bucket.index)]
        self.stats.bytes_received += n

        def finish():
            try:
                slot = attach_slot(token, self._attached)
                for item in self.plan.items(bucket, self.rank):
                    src = self.plan.sources[item.chunk.source]
                    self._write(item.param, item.piece, self._item_block(slot, bucket, item), src.dtype)
            finally:  # even after a failed copy: the reader waits for this to reuse the slot
                done = torch.zeros(SHM_DONE_BYTES, dtype=torch.uint8)
                dist.isend(done, dst=bucket.reader, tag=bucket.index).wait()
        return works, finish

    def _guarded(self, fn) -> None:
        try:
            fn()
        except BaseException as exc:  # keep the protocol going; the agreement step reports it
            if self.error is None:
                self.error = exc

    def _complete(self, bucket: Bucket, works, finish) -> None:
        for i, w in enumerate(works):
            try:
                w.wait()
            except Exception as exc:  # a peer is gone or silent past the timeout: this protocol is over
                raise LostPeer(self._doing(bucket, i, len(works)), exc) from exc
        self._guarded(finish)
        if self.on_bucket_done is not None and self.error is None:
            self._guarded(lambda: self.on_bucket_done(bucket))

    def _doing(self, bucket: Bucket, work: int = 0, works: int = 0) -> str:
        """What this rank was doing with whom when op number `work` of a bucket failed (for the message)."""
        if bucket.reader != self.rank:
            how = "broadcast" if bucket.broadcast else "message"
            return f"receiving bucket {bucket.index} ({how} from rank {bucket.reader})"
        to = [d for d in range(self.world) if d != self.rank and (bucket.broadcast or bucket.recv_bytes[d])]
        if not bucket.broadcast:  # one op per message, destinations in rank order
            per_message = [d for d in to for _ in self._message_sizes(bucket, d)]
            to = [per_message[work]] if len(per_message) == works else to
        return f"sending bucket {bucket.index} to rank{'s' if len(to) > 1 else ''} {', '.join(map(str, to))}"

    # -- after this rank failed mid-transfer ---------------------------------------------------------

    _scratch: torch.Tensor | None = None  # stand-in bytes, allocated only once a rank has failed

    def _stand_in(self, bucket: Bucket):
        """This rank's part of `bucket` done with scratch bytes, once it cannot do the real one.

        Its peers are already inside the bucket's collectives: posting ops of the same sizes lets every
        rank finish the transfer and reach the agreement step, which names this rank and its error
        within seconds (what was received meanwhile is never used: the load fails there).
        """
        me = self.rank
        if self.world == 1:
            return [], lambda: None
        done_reply = lambda: torch.zeros(SHM_DONE_BYTES, dtype=torch.uint8)  # noqa: E731  (shared-memory pairs)
        if self._scratch is None:
            most = max([b.read_bytes for b in self.plan.buckets] + [sum(b.recv_bytes) for b in self.plan.buckets])
            self._scratch = torch.zeros(max(most, 1), dtype=torch.uint8, device=self.device)
        scratch, ops = self._scratch, []
        if bucket.broadcast:
            if bucket.reader == me or bucket.read_bytes:
                ops.append(lambda: dist.broadcast(scratch[:bucket.read_bytes], src=bucket.reader, async_op=True))
        elif bucket.reader == me:
            for dst in range(self.world):
                if dst != me and bucket.recv_bytes[dst]:
                    for n in self._message_sizes(bucket, dst):
                        ops.append(lambda n=n, dst=dst: dist.isend(scratch[:n], dst=dst, tag=bucket.index))
                    if self._via_shm(bucket, dst):
                        ops.append(lambda dst=dst: dist.irecv(done_reply(), src=dst, tag=bucket.index))
        else:
            at = 0
            for n in self._message_sizes(bucket, me) if bucket.recv_bytes[me] else []:
                ops.append(lambda at=at, n=n: dist.irecv(scratch[at:at + n], src=bucket.reader, tag=bucket.index))
                at += n
            if bucket.recv_bytes[me] and self._via_shm(bucket, me):
                ops.append(lambda: dist.isend(done_reply(), dst=bucket.reader, tag=bucket.index))
        try:
            return [op() for op in ops], lambda: None
        except Exception as exc:
            raise LostPeer(self._doing(bucket), exc) from exc

    def _message_sizes(self, bucket: Bucket, rank: int) -> list[int]:
        """The sizes of the messages `rank` gets from a point-to-point bucket, in wire order."""
        if self._via_shm(bucket, rank):
            return [SHM_TOKEN_BYTES]
        wire = self._wire(bucket, rank)
        return ([wire.packed_bytes] if wire.packed_bytes else []) + [item.nbytes for item in wire.direct]

    def run(self) -> TransferStats:
        if self.read_ahead is not None:
            self.read_ahead.start()
        in_flight: deque = deque()
        try:
            standing_in = False
            for bucket in self.plan.buckets:
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
                    in_flight.append((bucket, *self._stand_in(bucket)))
                self.stats.buckets += 1
                if len(in_flight) > self.depth:
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
                # Its `fill` is a bound method of this Transfer: drop the cycle so the params and buffers
                # are freed when the caller lets go of them, not at some later garbage collection.
                self.read_ahead = None
            if self._slots is not None:
                self._slots.close()
            self._attached = {}
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return self.stats


def zero_padding(params: dict[str, torch.Tensor], specs, stats: TransferStats) -> None:
    """Zero the padded regions (e.g. vocab rows beyond the real vocab) and record them as written."""
    for name, spec in specs.items():
        if spec.alias_of or not spec.padding:
            continue
        for r0, r1, c0, c1 in spec.padding:
            typed2d(params[name])[r0:r1, c0:c1].zero_()
            stats.written.setdefault(name, []).append((r0, r1, c0, c1))
