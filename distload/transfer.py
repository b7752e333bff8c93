"""The only module that moves bytes between ranks (DESIGN §3, §2 step 5).

Readers read byte ranges of the checkpoint into reusable staging buffers (a read-ahead thread keeps
the next bucket coming while this one is on the wire); each bucket goes out as one collective —
`broadcast` when every rank keeps the whole tensor, point-to-point sends otherwise, so a rank receives
only the bytes it keeps — and receivers copy the pieces into their preallocated params.

Everything on the wire is raw bytes in contiguous uint8 buffers: gloo cannot send float8 and silently
corrupts non-contiguous tensors (it sends the storage's first bytes), while `view(torch.uint8)` of a
contiguous buffer is bit-exact. Backend differences (NCCL needs device buffers, gloo host ones) live
here and nowhere else.
"""

from __future__ import annotations

import pickle
import queue
import threading
from collections import deque
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .dtypes import torch_dtype
from .errors import DistloadError, RankFailure
from .plan import Bucket, Item, LoadPlan, Source, clip
from .shard import view2d

# ----------------------------------------------------------------------------------------------------
# Small collectives (metadata, agreement, the reference forward)


def _active() -> bool:
    return dist.is_initialized() and dist.get_world_size() > 1


def _require_contiguous(t: torch.Tensor, what: str) -> None:
    # gloo sends a non-contiguous tensor's *storage* bytes from its first element: silent corruption.
    if not t.is_contiguous():
        raise RuntimeError(f"{what}: wire buffers must be contiguous (gloo would corrupt a strided tensor)")


def all_reduce_sum(t: torch.Tensor, group=None) -> torch.Tensor:
    """Sum `t` over the group, in place."""
    _require_contiguous(t, "all_reduce_sum")
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


def all_gather_cat(t: torch.Tensor, dim: int, group=None) -> torch.Tensor:
    """Concatenate every rank's `t` along `dim`, in rank order (equal shapes on all ranks)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return t
    t = t.contiguous()
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t, group=group)
    return torch.cat(parts, dim=dim)


def _object_device() -> torch.device:
    # NCCL moves only device tensors; gloo only host ones.
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def broadcast_object(obj, src: int = 0):
    """Send a picklable object from `src` to every rank (metadata: headers, config, errors)."""
    if not _active():
        return obj
    dev = _object_device()
    if dist.get_rank() == src:
        payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(dev)
        size = torch.tensor([payload.numel()], dtype=torch.int64, device=dev)
    else:
        size = torch.zeros(1, dtype=torch.int64, device=dev)
    dist.broadcast(size, src)
    if dist.get_rank() != src:
        payload = torch.empty(int(size.item()), dtype=torch.uint8, device=dev)
    dist.broadcast(payload, src)
    return obj if dist.get_rank() == src else pickle.loads(payload.cpu().numpy().tobytes())


def all_gather_objects(obj) -> list:
    """Every rank's picklable `obj`, in rank order (small records only: all_gather is slow on gloo)."""
    if not _active():
        return [obj]
    dev = _object_device()
    data = pickle.dumps(obj)
    sizes = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64, device=dev))
    longest = max(int(s.item()) for s in sizes)
    mine = torch.zeros(longest, dtype=torch.uint8, device=dev)
    mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    out = [torch.empty(longest, dtype=torch.uint8, device=dev) for _ in sizes]
    dist.all_gather(out, mine)
    return [pickle.loads(o[:int(s.item())].cpu().numpy().tobytes()) for o, s in zip(out, sizes)]


def agree(phase: str, error: BaseException | None) -> None:
    """The agreement step that ends every phase: if any rank failed, every rank raises, naming it.

    Each rank contributes (ok, message); nobody is left waiting in a later collective for a peer that
    already raised.
    """
    mine = None if error is None else f"{type(error).__name__}: {error}"
    records = all_gather_objects(mine)
    failures = {r: m for r, m in enumerate(records) if m is not None}
    if not failures:
        return
    if error is not None:
        # This rank failed itself: its own exception (type, traceback) is the most useful thing to raise.
        raise error
    by_message: dict[str, list[int]] = {}
    for r, m in sorted(failures.items()):
        by_message.setdefault(m, []).append(r)
    text = "; ".join(f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: {m}" for m, rs in by_message.items())
    raise RankFailure(f"{phase} failed on {len(failures)} rank(s): {text}", failures)


def barrier() -> None:
    if _active():
        dist.barrier()


# ----------------------------------------------------------------------------------------------------
# Bucketed transfer


@dataclass
class TransferStats:
    bytes_read: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    buckets: int = 0
    written: dict[str, list[tuple[int, int, int, int]]] = field(default_factory=dict)  # param -> rectangles


def _typed2d(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's 2-D view, the same one the plan uses (shard.view2d: 1-D [n] is [n, 1])."""
    _require_contiguous(t, "param")
    return t.view(view2d(tuple(t.shape)))


def _as_bytes2d(t: torch.Tensor) -> torch.Tensor:
    """The same view in bytes: [rows, cols * itemsize] (bit-exact for every dtype, float8 included)."""
    rows, cols = view2d(tuple(t.shape))
    return t.reshape(-1).view(torch.uint8).view(rows, cols * t.element_size())


class _BufferPool:
    """Fixed, reused staging buffers: first-touch page faults cost 3-7x a warm copy, so allocate once."""

    def __init__(self, count: int, nbytes: int, device: torch.device, pin: bool = False):
        self.free: queue.Queue[torch.Tensor] = queue.Queue()
        for _ in range(count):
            buf = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=device, pin_memory=pin)
            self.free.put(buf)

    def get(self) -> torch.Tensor:
        return self.free.get()

    def put(self, buf: torch.Tensor) -> None:
        self.free.put(buf)


class _ReadAhead(threading.Thread):
    """Reads this reader's buckets, in order, into pooled host buffers ahead of the wire."""

    def __init__(self, plan: LoadPlan, buckets: list[Bucket], reader, pool: _BufferPool):
        super().__init__(daemon=True, name="distload-read-ahead")
        self.plan, self.buckets, self.reader, self.pool = plan, buckets, reader, pool
        self.ready: queue.Queue = queue.Queue()
        self.stop = threading.Event()

    def run(self):
        for bucket in self.buckets:
            buf = self.pool.get()
            if self.stop.is_set():
                return
            error = None
            try:
                at = 0
                for chunk in bucket.chunks:
                    src = self.plan.sources[chunk.source]
                    n = (chunk.rows[1] - chunk.rows[0]) * src.row_bytes
                    self.reader.read_into(src.file, src.offset + chunk.rows[0] * src.row_bytes, buf[at:at + n])
                    at += n
            except BaseException as exc:  # reported at the phase's agreement step; the protocol goes on
                error = exc
            self.ready.put((bucket.index, buf, error))


class Transfer:
    """Moves one plan's bytes into this rank's preallocated params."""

    def __init__(self, plan: LoadPlan, rank: int, params: dict[str, torch.Tensor], reader=None,
                 device: torch.device | str = "cpu", depth: int = 2, progress=None):
        self.plan, self.rank, self.params, self.reader = plan, rank, params, reader
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
        # Read buffers: one per in-flight broadcast bucket plus one being filled by the read-ahead.
        # Buckets never exceed the staging size unless a single row does; size to the largest bucket.
        self.read_pool = _BufferPool(self.depth + 2 if mine else 0, biggest_read, torch.device("cpu"), pin=on_cuda)
        self.recv_pool = _BufferPool(self.depth + 1, biggest_recv, self.device) if self.world > 1 else None
        self.send_pool = _BufferPool(self.depth + 1, biggest_send, self.device) if mine and self.world > 1 else None
        self.read_ahead = _ReadAhead(plan, mine, reader, self.read_pool) if mine else None

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
        dst = self.params[param]
        rows, cols = piece.rows[1] - piece.rows[0], piece.cols[1] - piece.cols[0]
        r0, c0 = piece.dst_row, piece.dst_col
        if dst.dtype == torch_dtype(src_dtype):
            isz = dst.element_size()
            _as_bytes2d(dst)[r0:r0 + rows, c0 * isz:(c0 + cols) * isz].copy_(block_bytes)
        else:  # the caller's module has another dtype: convert while copying (one piece at a time)
            typed = block_bytes.contiguous().view(torch_dtype(src_dtype)).view(rows, cols)
            _typed2d(dst)[r0:r0 + rows, c0:c0 + cols].copy_(typed)
        self.stats.written.setdefault(param, []).append((r0, r0 + rows, c0, c0 + cols))

    def _unpack_items(self, buf: torch.Tensor, bucket: Bucket, items: list[Item]) -> None:
        for item in items:
            src = self.plan.sources[item.chunk.source]
            if bucket.broadcast:
                block = self._source_block(buf, item.offset, src, item.chunk.rows[0], item.piece)
            else:
                isz = torch_dtype(src.dtype).itemsize
                rows = item.piece.rows[1] - item.piece.rows[0]
                block = buf[item.offset:item.offset + item.nbytes].view(rows, -1) if rows else buf[:0].view(0, 0)
                if block.shape[1] != (item.piece.cols[1] - item.piece.cols[0]) * isz:
                    raise RuntimeError(f"wire item for {item.param} has {block.shape[1]} bytes per row, plan says "
                                       f"{(item.piece.cols[1] - item.piece.cols[0]) * isz}")
            self._write(item.param, item.piece, block, src.dtype)

    def _local_from_read_buffer(self, host: torch.Tensor, bucket: Bucket) -> None:
        """The reader's own share: straight from the read buffer into its params (no wire)."""
        at = 0
        for chunk in bucket.chunks:
            src = self.plan.sources[chunk.source]
            for d in src.deliveries:
                if d.rank != self.rank:
                    continue
                piece = clip(d.piece, chunk.rows)
                if piece is not None:
                    self._write(d.param, piece, self._source_block(host, at, src, chunk.rows[0], piece), src.dtype)
            at += (chunk.rows[1] - chunk.rows[0]) * src.row_bytes

    def _pack(self, host: torch.Tensor, bucket: Bucket, dst_rank: int, out: torch.Tensor) -> int:
        """Copy dst_rank's pieces of the read buffer into `out` (contiguous), in wire order."""
        chunk_base, at = {}, 0
        for chunk in bucket.chunks:
            chunk_base[chunk] = at
            at += (chunk.rows[1] - chunk.rows[0]) * self.plan.sources[chunk.source].row_bytes
        used = 0
        for item in self.plan.items(bucket, dst_rank):
            src = self.plan.sources[item.chunk.source]
            block = self._source_block(host, chunk_base[item.chunk], src, item.chunk.rows[0], item.piece)
            out[item.offset:item.offset + item.nbytes].view(block.shape).copy_(block)
            used = item.offset + item.nbytes
        return used

    # -- the loop ------------------------------------------------------------------------------------

    def _post(self, bucket: Bucket):
        """Start this rank's part of one bucket; returns (works, finish) to complete it later."""
        me = self.rank
        if bucket.reader == me:
            index, host, read_error = self.read_ahead.ready.get()
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
                _require_contiguous(wire, "broadcast buffer")
                works.append(dist.broadcast(wire, src=me, async_op=True))
                self.stats.bytes_sent += bucket.read_bytes * (self.world - 1)
            elif self.world > 1 and any(n for d, n in enumerate(bucket.recv_bytes) if d != me):
                send = self.send_pool.get()
                release.append(lambda: self.send_pool.put(send))
                staged = host
                if self.device.type != "cpu":  # pack on the device: one H2D copy of the read bytes
                    staged = self.recv_pool.get()
                    staged[:bucket.read_bytes].copy_(host[:bucket.read_bytes], non_blocking=True)
                    release.append(lambda: self.recv_pool.put(staged))
                at = 0
                for dst in range(self.world):
                    n = bucket.recv_bytes[dst]
                    if dst == me or n == 0:
                        continue
                    used = self._pack(staged, bucket, dst, send[at:at + n])
                    if used != n:
                        raise RuntimeError(f"bucket {bucket.index}: packed {used} bytes for rank {dst}, plan says {n}")
                    wire = send[at:at + n]
                    _require_contiguous(wire, "send buffer")
                    works.append(dist.isend(wire, dst=dst, tag=bucket.index))
                    self.stats.bytes_sent += n
                    at += n
            # The reader's own share goes straight from the read buffer into its params, now.
            self._guarded(lambda: self._local_from_read_buffer(host, bucket))
            if works and bucket.broadcast and self.device.type == "cpu":
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
        buf = self.recv_pool.get()
        wire = buf[:n]
        _require_contiguous(wire, "receive buffer")
        if bucket.broadcast:
            works = [dist.broadcast(wire, src=bucket.reader, async_op=True)]
        else:
            works = [dist.irecv(wire, src=bucket.reader, tag=bucket.index)]
        self.stats.bytes_received += n

        def finish():
            try:
                self._unpack_items(wire, bucket, self.plan.items(bucket, me))
            finally:
                self.recv_pool.put(buf)
        return works, finish

    def _guarded(self, fn) -> None:
        try:
            fn()
        except BaseException as exc:  # keep the protocol going; the agreement step reports it
            if self.error is None:
                self.error = exc

    def _complete(self, works, finish) -> None:
        for w in works:
            w.wait()
        self._guarded(finish)

    def run(self) -> TransferStats:
        if self.read_ahead is not None:
            self.read_ahead.start()
        in_flight: deque = deque()
        try:
            for bucket in self.plan.buckets:
                in_flight.append(self._post(bucket))
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
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return self.stats


def zero_padding(params: dict[str, torch.Tensor], specs, stats: TransferStats) -> None:
    """Zero the padded regions (e.g. vocab rows beyond the real vocab) and record them as written."""
    for name, spec in specs.items():
        if spec.alias_of or not spec.padding:
            continue
        for r0, r1, c0, c1 in spec.padding:
            _typed2d(params[name])[r0:r1, c0:c1].zero_()
            stats.written.setdefault(name, []).append((r0, r1, c0, c1))


def require_no_error(transfer: Transfer) -> None:
    if transfer.error is not None and not isinstance(transfer.error, DistloadError):
        raise DistloadError(f"transfer failed: {type(transfer.error).__name__}: {transfer.error}") from transfer.error
    if transfer.error is not None:
        raise transfer.error
