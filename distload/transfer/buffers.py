"""Staging buffers: reused host/device pools, a reader's shared-memory slots, the read-ahead thread,
and the byte views every copy goes through."""

from __future__ import annotations

import mmap
import os
import queue
import threading
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from . import host_memory
from ..plan import Bucket
from ..plan.shard import view2d
from .collectives import require_contiguous


@dataclass
class TransferStats:
    bytes_read: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    bytes_from_other_nodes: int = 0      # of bytes_received, what came from a reader on another node
    buckets: int = 0
    # How bytes reached this rank's params: "buckets" (engine.py), "node-pulls" (node_pull.py), "owner-reads".
    path: str = "buckets"
    written: dict[str, list[tuple[int, int, int, int]]] = field(default_factory=dict)  # param -> rectangles

    def record(self, param: str, piece) -> None:
        """Note the rectangle of `param` a piece filled (what reconcile.py checks: written once, all of it)."""
        r0, c0 = piece.dst_row, piece.dst_col
        self.written.setdefault(param, []).append((r0, r0 + piece.rows[1] - piece.rows[0],
                                                   c0, c0 + piece.cols[1] - piece.cols[0]))


def typed2d(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's 2-D view, the same one the plan uses (shard.view2d: 1-D [n] is [n, 1])."""
    require_contiguous(t, "param")
    return t.view(view2d(tuple(t.shape)))


def as_bytes2d(t: torch.Tensor) -> torch.Tensor:
    """The same view in bytes: [rows, cols * itemsize] (bit-exact for every dtype, float8 included)."""
    rows, cols = view2d(tuple(t.shape))
    return t.reshape(-1).view(torch.uint8).view(rows, cols * t.element_size())


def piece_bytes(dst: torch.Tensor, piece) -> torch.Tensor:
    """The rectangle of `dst` a piece fills, as bytes: uint8 [rows, cols * itemsize] (rows may be strided)."""
    isz = dst.element_size()
    r0, c0 = piece.dst_row, piece.dst_col
    rows, cols = piece.rows[1] - piece.rows[0], piece.cols[1] - piece.cols[0]
    return as_bytes2d(dst)[r0:r0 + rows, c0 * isz:(c0 + cols) * isz]


def write_piece(dst: torch.Tensor, piece, block_bytes: torch.Tensor, src_dtype: torch.dtype) -> None:
    """Copy a block of source bytes (uint8 [rows, cols * itemsize of src_dtype]) into the piece's rectangle
    of `dst`; if the caller's param has another dtype, convert while copying (one piece at a time)."""
    if dst.dtype == src_dtype:
        piece_bytes(dst, piece).copy_(block_bytes)
        return
    r0, c0 = piece.dst_row, piece.dst_col
    rows, cols = piece.rows[1] - piece.rows[0], piece.cols[1] - piece.cols[0]
    typed2d(dst)[r0:r0 + rows, c0:c0 + cols].copy_(block_bytes.contiguous().view(src_dtype).view(rows, cols))


def shared_memfd(name: str, nbytes: int) -> tuple[int, mmap.mmap]:
    """(fd, map) of fresh shared memory that other processes of this node can map (map_peer_fd)."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, nbytes)
        return fd, mmap.mmap(fd, nbytes)
    except BaseException:
        os.close(fd)
        raise


def map_peer_fd(pid: int, fd: int) -> mmap.mmap:
    """Map another process's memfd (shared_memfd) into this one, through /proc/<pid>/fd/<fd>."""
    handle = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR)
    try:
        return mmap.mmap(handle, os.fstat(handle).st_size)
    finally:
        os.close(handle)


class BufferPool:
    """Fixed, reused staging buffers: first-touch page faults cost 3-7x a warm copy, so allocate once. Last in,
    first out: the buffers the pipeline needs stay warm, and the pages of those it never needs are never touched."""

    def __init__(self, count: int, nbytes: int, device: torch.device, pin: bool = False, buffers=None):
        self.free: queue.LifoQueue[torch.Tensor] = queue.LifoQueue()
        if buffers is None:
            buffers = [torch.empty(max(nbytes, 1), dtype=torch.uint8, device=device, pin_memory=True) if pin
                       else host_memory.empty((max(nbytes, 1),), torch.uint8, device) for _ in range(count)]
        for buf in buffers:
            self.free.put(buf)

    def get(self) -> torch.Tensor:
        return self.free.get()

    def put(self, buf: torch.Tensor) -> None:
        self.free.put(buf)


# Shared memory between the ranks of one node (gloo on CPU): a reader's staging buffers are one memfd, and
# a rank on its node maps it (through /proc/<reader pid>/fd/<fd>) and copies its pieces straight out of it.
# Over gloo every byte would otherwise be copied into a socket, out of it, and (unless it lands directly)
# out of a receive buffer, on the same CPUs that do the loading. Only two tiny messages per bucket and rank
# travel on the wire: the reader's "bucket b is in slot k" token, and the receiver's "done with it" reply,
# which lets the reader reuse the slot (and brings the timeouts and lost-peer handling of the wire). A memfd
# has no name to leak: its memory goes when the last process using it exits, however it exits. The
# token's and the reply's sizes are part of the wire (plan/wire.py).


def shm_usable(world: int, device: torch.device, allowed: bool) -> bool:
    """Can ranks of one node share read buffers? allowed: the caller's choice (the same on every rank);
    the rest is the same answer on every rank of a node: same machine, same backend."""
    return (allowed and world > 1 and device.type == "cpu" and hasattr(os, "memfd_create")
            and os.path.isdir("/proc/self/fd") and dist.is_initialized() and dist.get_backend() == "gloo")


class SharedSlots:
    """A reader's staging buffers, `count` slots of `nbytes`, in one memfd (pages come on first touch)."""

    def __init__(self, count: int, nbytes: int):
        self.slot_bytes = max(nbytes, 1)
        self.fd, memory = shared_memfd("distload-staging", count * self.slot_bytes)
        self.tensor = torch.frombuffer(memory, dtype=torch.uint8)
        self.slots = [self.tensor[i * self.slot_bytes:(i + 1) * self.slot_bytes] for i in range(count)]

    def token(self, buf: torch.Tensor) -> torch.Tensor:
        """The token naming the slot that `buf` is (plan.wire.SHM_TOKEN_BYTES bytes)."""
        slot = (buf.data_ptr() - self.tensor.data_ptr()) // self.slot_bytes
        return torch.tensor([os.getpid(), self.fd, slot, self.slot_bytes], dtype=torch.int64).view(torch.uint8)

    def close(self) -> None:
        """Close the descriptor (the receivers mapped the memory long before: it lives while mapped)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def attach_slot(token: torch.Tensor, attached: dict) -> torch.Tensor:
    """The slot a token names, mapped into this process (each reader's memory once)."""
    pid, fd, slot, slot_bytes = (int(x) for x in token.view(torch.int64))
    if (pid, fd) not in attached:
        attached[(pid, fd)] = torch.frombuffer(map_peer_fd(pid, fd), dtype=torch.uint8)
    return attached[(pid, fd)][slot * slot_bytes:(slot + 1) * slot_bytes]


class ReadAhead(threading.Thread):
    """Reads this reader's buckets, in order, into pooled host buffers ahead of the wire.

    `fill(bucket, buf)` does the reading (some byte ranges go straight into this rank's own params).
    """

    def __init__(self, buckets: list[Bucket], fill, pool: BufferPool):
        super().__init__(daemon=True, name="distload-read-ahead")
        self.buckets, self.fill, self.pool = buckets, fill, pool
        self.ready: queue.Queue = queue.Queue()
        self.stop = threading.Event()

    def run(self):
        for bucket in self.buckets:
            buf = self.pool.get()
            if self.stop.is_set():
                return
            error, direct = None, []
            try:
                direct = self.fill(bucket, buf)
            except BaseException as exc:  # reported at the phase's agreement step; the protocol goes on
                error = exc
            self.ready.put((bucket.index, buf, error, direct))
