"""The only module that moves bytes between ranks (DESIGN §3, §2 step 5).

Readers read byte ranges of the checkpoint into reusable staging buffers (a read-ahead thread keeps
the next bucket coming while this one is on the wire); each bucket goes out as one collective —
`broadcast` when every rank keeps the whole tensor, point-to-point sends otherwise, so a rank receives
only the bytes it keeps — and receivers copy the pieces into their preallocated params. With gloo on CPU,
ranks on a reader's node take their pieces straight out of its shared-memory read buffers instead (only a
token and a reply per bucket travel): sharded bytes never cross a socket within a node.

Everything on the wire is raw bytes in contiguous uint8 buffers: gloo cannot send float8 and silently
corrupts non-contiguous tensors (it sends the storage's first bytes), while `view(torch.uint8)` of a
contiguous buffer is bit-exact. Backend differences (NCCL needs device buffers, gloo host ones) live
here and nowhere else.
"""

from __future__ import annotations

import itertools
import mmap
import os
import pickle
import queue
import re
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from . import faults, host_memory
from .dtypes import torch_dtype
from .errors import DistloadError, RankFailure
from .plan import Bucket, Item, LoadPlan, Source, broadcast_offset, clip
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


def computed_on_rank0(fn):
    """Run fn on rank 0 only (metadata: headers, manifests) and hand every rank its result; if it
    raised, every rank raises the same exception."""
    payload = None
    if not _active() or dist.get_rank() == 0:
        try:
            payload = ("ok", fn())
        except Exception as exc:
            payload = ("error", exc)
    kind, value = broadcast_object(payload, src=0)
    if kind == "error":
        raise value
    return value


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


def _failure_records(mine: str | None) -> list:
    """Every rank's failure message (None: fine). One small all-reduce when all are fine, as they nearly
    always are; the messages themselves are gathered only when some rank failed."""
    if not _active():
        return [mine]
    failed = torch.tensor([0 if mine is None else 1], dtype=torch.int64, device=_object_device())
    dist.all_reduce(failed, op=dist.ReduceOp.SUM)
    if int(failed.item()) == 0:
        return [None] * dist.get_world_size()
    return all_gather_objects(mine)


def agree(phase: str, error: BaseException | None) -> None:
    """The agreement step that ends every phase: if any rank failed, every rank raises, naming it.

    Each rank contributes (ok, message); nobody is left waiting in a later collective for a peer that
    already raised.
    """
    step = next(_agreement_steps)
    if error is None:
        try:
            faults.hit(phase)  # test hook (DISTLOAD_FAULT), a no-op otherwise
        except Exception as exc:
            error = exc
    mine = None if error is None else f"{type(error).__name__}: {error}"
    if isinstance(error, LostPeer):
        raise _postmortem(phase, step, error) from error  # the group is broken: no collective can agree now
    if mine is not None:
        _tell_store(step, mine)  # so that peers learn why even if the collective below breaks
    try:
        records = _failure_records(mine)
    except Exception as exc:  # a peer died or hung past the timeout during this very step
        raise _postmortem(phase, step, LostPeer(f"agreeing on {phase}", exc)) from exc
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


# ----------------------------------------------------------------------------------------------------
# When a peer is gone: the process group cannot tell who or why, the rendezvous store still can.
#
# A killed rank (OOM killer, lost node) leaves its peers with "Connection closed by peer" from gloo (NCCL:
# a timeout), and a hung one with a timeout, neither naming a rank. Every rank that fails posts its
# reason to the job's store (torchrun's agent holds it; without torchrun, rank 0); a rank whose collective
# broke then waits a moment for its peers' reasons and names the ranks that stayed silent.

POSTMORTEM_WAIT_S = 3.0  # how long a broken rank waits for its peers' reasons: they break at about the same time
_agreement_steps = itertools.count()  # the n-th agreement of this process; equal on all ranks while in step


class LostPeer(RuntimeError):
    """A collective of this rank failed (a peer was killed, crashed, or stayed silent past the timeout)."""

    def __init__(self, doing: str, cause: BaseException):
        self.doing = doing
        super().__init__(f"lost a peer while {doing}: {_first_line(cause)}")


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    line = text[0] if text else type(error).__name__
    # gloo: "[.../gloo/transport/tcp/pair.cc:553] Connection closed by peer [addr]:port. This is typically ..."
    line = re.sub(r"^\[[^\]]*\]\s*", "", line).split(". This is typically")[0]
    return line[:300]


def _store_key(step: int, rank: int) -> str:
    return f"distload/agreement-{step}/rank-{rank}"


def _tell_store(step: int, message: str) -> None:
    try:
        dist.distributed_c10d._get_default_store().set(_store_key(step, dist.get_rank()), message[:4000])
    except Exception:  # the store is gone too; the postmortem will say so
        pass


def _postmortem(phase: str, step: int, error: LostPeer) -> RankFailure:
    """Name who failed and why from the store, after this rank's process group broke."""
    me, world = dist.get_rank(), dist.get_world_size()
    heard: dict[int, str] = {}
    store_error = None
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set(_store_key(step, me), f"LostPeer: {error}")
        deadline = time.monotonic() + POSTMORTEM_WAIT_S
        while len(heard) < world - 1 and time.monotonic() < deadline:
            for r in range(world):
                if r != me and r not in heard and store.check([_store_key(step, r)]):
                    heard[r] = store.get(_store_key(step, r)).decode(errors="replace")
            time.sleep(0.05)
    except Exception as exc:
        store_error = exc
    causes = {r: m for r, m in heard.items() if not m.startswith("LostPeer:")}
    silent = [r for r in range(world) if r != me and r not in heard]
    parts = [f"{phase} failed: rank {me} {error}"]
    parts += [f"rank {r} failed: {m}" for r, m in sorted(causes.items())]
    if silent:
        who = f"rank{'s' if len(silent) > 1 else ''} {', '.join(map(str, silent))}"
        parts.append(f"no word from {who} within {POSTMORTEM_WAIT_S:.0f} s (killed, crashed or hung: see "
                     f"{'their' if len(silent) > 1 else 'its'} log or the launcher's report; a rank still waiting on the "
                     "lost one cannot answer either)")
    if store_error is not None:
        parts.append(f"the job's store is unreachable too ({_first_line(store_error)}): whoever held it is gone "
                     "(rank 0 without torchrun, else torchrun's agent)")
    failures = {**{r: "no word (vanished)" for r in silent}, **causes, me: str(error)}
    return RankFailure("; ".join(parts), failures)


def report_together(seconds: float = 3.0) -> None:
    """Before a failed rank exits: wait (briefly) until every rank has reported its error.

    Under torchrun the first rank to exit gets the others SIGTERMed within 0.1 s, maybe before they
    printed why; ranks that fail together leave together instead. A vanished peer costs `seconds`.
    """
    if not _active():
        return
    try:
        store = dist.distributed_c10d._get_default_store()
        store.add("distload/reported", 1)
        deadline = time.monotonic() + seconds
        while store.add("distload/reported", 0) < dist.get_world_size() and time.monotonic() < deadline:
            time.sleep(0.02)
    except Exception:  # the store went with its host: nobody left to wait for
        pass


def agree_on_plan(plan) -> None:
    """Every rank must hold the same plan: no control message ever travels, so ranks that planned
    differently (different distload versions or rules files on different nodes) would wait forever for
    bytes nobody sends. A digest of the wire schedule, compared once, turns that hang into an error."""
    import hashlib

    digest = hashlib.sha256(repr((plan.buckets, [len(s) for s in plan.specs])).encode()).hexdigest()[:15]
    if not _active():
        return
    # One all-gather of a fixed-size tensor (60 bits of the digest), not two of pickled objects.
    mine = torch.tensor([int(digest, 16)], dtype=torch.int64, device=_object_device())
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    digests = [f"{int(d.item()):015x}" for d in every]
    if len(set(digests)) > 1:
        groups: dict[str, list[int]] = {}
        for r, d in enumerate(digests):
            groups.setdefault(d, []).append(r)
        raise RankFailure("ranks computed different load plans (" + "; ".join(f"ranks {rs}: plan {d}" for d, rs in
                          groups.items()) + "): check that every node runs the same distload version, rules file "
                          "(--config) and options")


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


def typed2d(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's 2-D view, the same one the plan uses (shard.view2d: 1-D [n] is [n, 1])."""
    _require_contiguous(t, "param")
    return t.view(view2d(tuple(t.shape)))


def as_bytes2d(t: torch.Tensor) -> torch.Tensor:
    """The same view in bytes: [rows, cols * itemsize] (bit-exact for every dtype, float8 included)."""
    rows, cols = view2d(tuple(t.shape))
    return t.reshape(-1).view(torch.uint8).view(rows, cols * t.element_size())


class _BufferPool:
    """Fixed, reused staging buffers: first-touch page faults cost 3-7x a warm copy, so allocate once."""

    def __init__(self, count: int, nbytes: int, device: torch.device, pin: bool = False, buffers=None):
        self.free: queue.Queue[torch.Tensor] = queue.Queue()
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
# has no name to leak: its memory goes when the last process using it exits, however it exits.
SHM_TOKEN_BYTES = 32    # reader pid, fd, slot index, slot size (int64 each)
SHM_DONE_BYTES = 8


def _shm_usable(world: int, device: torch.device) -> bool:
    """Same answer on every rank of a node: same machine, same environment, same backend."""
    return (world > 1 and device.type == "cpu" and hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd")
            and os.environ.get("DISTLOAD_SHM", "1") != "0" and dist.is_initialized() and dist.get_backend() == "gloo")


class _SharedSlots:
    """A reader's staging buffers, `count` slots of `nbytes`, in one memfd (pages come on first touch)."""

    def __init__(self, count: int, nbytes: int):
        self.slot_bytes = max(nbytes, 1)
        self.fd = os.memfd_create("distload-staging", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, count * self.slot_bytes)
            self.tensor = torch.frombuffer(mmap.mmap(self.fd, count * self.slot_bytes), dtype=torch.uint8)
        except BaseException:
            os.close(self.fd)
            raise
        self.slots = [self.tensor[i * self.slot_bytes:(i + 1) * self.slot_bytes] for i in range(count)]

    def token(self, buf: torch.Tensor) -> torch.Tensor:
        slot = (buf.data_ptr() - self.tensor.data_ptr()) // self.slot_bytes
        return torch.tensor([os.getpid(), self.fd, slot, self.slot_bytes], dtype=torch.int64).view(torch.uint8)

    def close(self) -> None:
        """Close the descriptor (the receivers mapped the memory long before: it lives while mapped)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _attach_slot(token: torch.Tensor, attached: dict) -> torch.Tensor:
    """The slot a token names, mapped into this process (each reader's memory once)."""
    pid, fd, slot, slot_bytes = (int(x) for x in token.view(torch.int64))
    if (pid, fd) not in attached:
        handle = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR)
        try:
            attached[(pid, fd)] = torch.frombuffer(mmap.mmap(handle, os.fstat(handle).st_size), dtype=torch.uint8)
        finally:
            os.close(handle)
    return attached[(pid, fd)][slot * slot_bytes:(slot + 1) * slot_bytes]


class _ReadAhead(threading.Thread):
    """Reads this reader's buckets, in order, into pooled host buffers ahead of the wire.

    `fill(bucket, buf)` does the reading (some byte ranges go straight into this rank's own params).
    """

    def __init__(self, buckets: list[Bucket], fill, pool: _BufferPool):
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
        self.local_world = plan.layout.local_world or self.world
        self.shm = _shm_usable(self.world, self.device)
        self._slots: _SharedSlots | None = None
        self._attached: dict[tuple[int, int], torch.Tensor] = {}   # other readers' slots this rank has mapped
        read_buffers = None
        if any(d != rank and b.recv_bytes[d] and self._via_shm(b, d) for b in mine for d in range(self.world)):
            try:
                self._slots = _SharedSlots(self.depth + 2, biggest_read)
                read_buffers = self._slots.slots
            except OSError as exc:  # no shared memory to be had: this rank stands in (see run), the job fails
                self.error = DistloadError(f"cannot make {self.depth + 2} x {biggest_read >> 20} MiB of shared staging "
                                           f"memory: {exc}; free memory, or set DISTLOAD_SHM=0 to send it over gloo")
        # Read buffers: one per in-flight bucket plus one being filled by the read-ahead. Buckets never
        # exceed the staging size unless a single row does; size to the largest bucket. Pages of a buffer
        # that direct paths never touch cost no memory.
        self.read_pool = _BufferPool(self.depth + 2 if mine else 0, biggest_read, torch.device("cpu"), pin=on_cuda,
                                     buffers=read_buffers)
        self.recv_pool = _BufferPool(self.depth + 1, biggest_recv, self.device) if self.world > 1 else None
        self.send_pool = _BufferPool(self.depth + 1, biggest_send, self.device) if mine and self.world > 1 else None
        self._wires: dict[tuple[int, int], Wire] = {}
        # Decided before the read-ahead starts, so that its thread and this one only read these.
        self._direct_reads = {(b.index, c): self._direct_candidates(b, c) for b in mine for c in b.chunks}
        # The read-ahead thread overlaps reading with the wire. Alone (world 1) there is nothing to overlap,
        # and every hand-off between threads costs a wake-up (milliseconds on a busy machine): read inline.
        self.read_ahead = _ReadAhead(mine, self._fill, self.read_pool) if mine and self.world > 1 else None

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
        isz = dst.element_size()
        r0, c0 = piece.dst_row, piece.dst_col
        rows, cols = piece.rows[1] - piece.rows[0], piece.cols[1] - piece.cols[0]
        region = as_bytes2d(dst)[r0:r0 + rows, c0 * isz:(c0 + cols) * isz]
        return region.reshape(-1) if region.is_contiguous() else None

    def _via_shm(self, bucket: Bucket, rank: int) -> bool:
        """Does `rank` take its share of this bucket out of the reader's shared memory (same node, p2p)?"""
        return self.shm and not bucket.broadcast and bucket.reader // self.local_world == rank // self.local_world

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
            as_bytes2d(dst)[r0:r0 + rows, c0 * isz:(c0 + cols) * isz].copy_(block_bytes)
        else:  # the caller's module has another dtype: convert while copying (one piece at a time)
            typed = block_bytes.contiguous().view(torch_dtype(src_dtype)).view(rows, cols)
            typed2d(dst)[r0:r0 + rows, c0:c0 + cols].copy_(typed)
        self._record(param, piece)

    def _record(self, param: str, piece) -> None:
        r0, c0 = piece.dst_row, piece.dst_col
        rect = (r0, r0 + piece.rows[1] - piece.rows[0], c0, c0 + piece.cols[1] - piece.cols[0])
        self.stats.written.setdefault(param, []).append(rect)

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
                    self._record(d.param, piece)
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
                _require_contiguous(wire, "broadcast buffer")
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
                        _require_contiguous(message, "send buffer")
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
        if bucket.broadcast:
            wire = buf[:n]
            _require_contiguous(wire, "receive buffer")
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
            _require_contiguous(region, "receive buffer")
            works.append(dist.irecv(region, src=bucket.reader, tag=bucket.index))

        def finish():
            try:
                for item, offset in layout.packed:
                    self._unpack_wire_item(buf[offset:offset + item.nbytes], item)
                for item, region in scratch:
                    self._unpack_wire_item(region, item)
                for item in landed:
                    self._record(item.param, item.piece)
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
                slot = _attach_slot(token, self._attached)
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
