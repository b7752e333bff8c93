"""One node, host params: every rank copies its pieces straight out of the files its reader opened.

When the whole job is one node, the page cache is shared by all its processes, and what a load costs is
copies and hand-offs, not storage reads. The bucketed transfer (engine.py) costs a rank two copies
(file -> the reader's shared slot -> its param) and two messages per bucket. Here:

- each reader opens each file it reads once per rank of the node and broadcasts which descriptor is
  whose; every other rank takes a duplicate of its own (pull.py: `pidfd_getfd`, the path is not opened
  again), and all ranks agree that they could before anyone copies. One open file per rank, because
  ranks sharing one interleave their reads through one read-ahead state (twice the CPU per byte cold,
  BENCHMARKS.md);
- every rank, the readers included, copies each of its pieces once, from the file into its param
  (file_copy.py: one `preadv` per piece of whole rows, one strided copy out of a transient map for
  row-parallel columns), in plan order, so the ranks walk the files together and the kernel reads each
  page from storage once (cold) for all of them;
- nobody waits for anybody until the phase's agreement step, where a failed, killed or hung rank is
  found as on every other path.

Only the readers open weight files, and each byte of the checkpoint is read from storage once. Used on
the route "node-pulls" (route.py decides it before any byte moves: one node, host params, files read as
they are, the OS lets a process borrow another's files); should the handover itself fail (out of
descriptors, ranks in separate process-id namespaces), every rank learns it in the same collective and
the load takes the wire route, the report saying why.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist

from .. import faults
from ..checkpoint import RangeReader
from ..errors import DistloadError
from ..plan import Bucket, LoadPlan
from .agreement import LostPeer
from .buffers import TransferStats
from .file_copy import Prefault, copy_piece
from .pull import AllowPulls, borrow_fd, make_room_for_descriptors

log = logging.getLogger("distload")

_TABLE_HEAD = 2   # usable, pid


def _others_bytes(bucket: Bucket, world: int) -> int:
    """Bytes of a bucket that ranks other than its reader take."""
    if bucket.broadcast:
        return bucket.read_bytes * (world - 1)
    return sum(n for d, n in enumerate(bucket.recv_bytes) if d != bucket.reader)


class NodePulls:
    """Fills this rank's params from its readers' open files: `handover()`, then `run()` (TransferStats)."""

    def __init__(self, plan: LoadPlan, rank: int, params: dict[str, torch.Tensor], reader: RangeReader,
                 progress=None):
        """reader: this rank's (every rank has one: a reader opens its files with it, the others read
        through it with the descriptors they borrow; the caller closes it after the phase's agreement);
        progress: called with each bucket once this rank has copied its pieces of it."""
        self.plan, self.rank, self.params, self.reader = plan, rank, params, reader
        self.progress = progress
        self.stats = TransferStats(path="node-pulls")
        self.error: BaseException | None = None  # reported at the phase's agreement step
        self.files = sorted({src.file for src in plan.sources.values()})
        self._file_index = {f: i for i, f in enumerate(self.files)}
        self._lent: list[int] = []  # descriptors this reader opened for the other ranks to borrow
        # What this rank copies from each bucket (asked once: both borrowing and copying need it), and the
        # files it reads itself as a reader.
        self._items = [plan.items(bucket, rank) for bucket in plan.buckets]
        self._own_files = {plan.sources[c.source].file for b in plan.buckets if b.reader == rank for c in b.chunks}

    # -- which descriptors each reader holds ---------------------------------------------------------

    def _my_table(self) -> torch.Tensor:
        """[usable, pid, then per rank the descriptor this reader lends it for each file it reads (-1: not
        read here), then each file's inode number], as this reader broadcasts it. Every rank gets its own
        descriptor (its own open file: file position and read-ahead state), opened here: ranks sharing
        one open file interleave their reads through one read-ahead window, which cost them twice the
        CPU per byte read cold on this VM (0.10-0.13 CPU-s per rank for 1 GiB vs 0.05-0.07)."""
        n, world = len(self.files), self.plan.layout.world
        table = torch.full((_TABLE_HEAD + n * (world + 1),), -1, dtype=torch.int64)
        table[0] = 0
        mine = sorted(self._own_files)
        try:
            make_room_for_descriptors(len(mine) * world)
            for f in mine:
                i = self._file_index[f]
                own = self.reader.fd_of(f)
                table[_TABLE_HEAD + n * world + i] = os.fstat(own).st_ino
                for r in range(world):
                    if r == self.rank:
                        table[_TABLE_HEAD + n * r + i] = own
                    else:
                        self._lent.append(self.reader.open_again(f))
                        table[_TABLE_HEAD + n * r + i] = self._lent[-1]
        except (OSError, DistloadError) as exc:  # out of descriptors, say: every rank takes the bucketed path
            log.info("pulls from the reader's files: cannot open them for every rank (%s); using the bucketed "
                     "transfer", exc)
            self._close_lent()
            table[0] = 0
            return table
        table[0], table[1] = 1, os.getpid()
        return table

    def _tables(self) -> dict[int, tuple[int, list[int], list[int]]] | None:
        """Every reader's (pid, the descriptors it lends this rank, inode numbers), the same on every rank;
        None if any reader cannot lend."""
        n, world = len(self.files), self.plan.layout.world
        tables, usable = {}, True
        for r in sorted({b.reader for b in self.plan.buckets}):
            table = (self._my_table() if r == self.rank
                     else torch.zeros(_TABLE_HEAD + n * (world + 1), dtype=torch.int64))
            try:
                dist.broadcast(table, src=r)
            except Exception as exc:
                raise LostPeer(f"receiving the file descriptors of reader rank {r}", exc) from exc
            values = [int(x) for x in table]
            usable = usable and bool(values[0])  # every rank sees every table: all decide alike
            at = _TABLE_HEAD + n * self.rank
            tables[r] = (values[1], values[at:at + n], values[_TABLE_HEAD + n * world:])
        return tables if usable else None

    def _borrow(self, tables: dict[int, tuple[int, list[int], list[int]]]) -> str | None:
        """Give this rank's reader duplicates of the descriptors lent to it for the files it copies from
        and does not read itself; returns why it could not (None: it could)."""
        wanted = {}
        for bucket, items in zip(self.plan.buckets, self._items):
            if bucket.reader != self.rank and items:
                for chunk in bucket.chunks:
                    f = self.plan.sources[chunk.source].file
                    if f not in self._own_files:
                        wanted.setdefault(f, bucket.reader)
        for f, r in sorted(wanted.items()):
            pid, fds, inodes = tables[r]
            i = self._file_index[f]
            try:
                fd = borrow_fd(pid, fds[i])
            except OSError as exc:
                return f"rank {self.rank} could not take reader rank {r}'s descriptor of {f}: {exc}"
            self.reader.adopt(f, fd)
            # Process ids are per pid namespace: ranks in separate containers on one host may see another
            # process under the reader's pid. Never read a file other than the one the reader opened.
            if os.fstat(fd).st_ino != inodes[i]:
                return (f"rank {self.rank}: process {pid} is not reader rank {r} here (its descriptor {fds[i]} is "
                        f"another file than {f}): the ranks do not share a process id namespace")
        return None

    def _close_lent(self) -> None:
        """The reader's copies of what it lent (each rank holds its own duplicate by now)."""
        lent, self._lent = self._lent, []
        for fd in lent:
            os.close(fd)

    # -- the copies ----------------------------------------------------------------------------------

    def _copy_bucket(self, bucket: Bucket, items) -> None:
        for item in items:
            src = self.plan.sources[item.chunk.source]
            try:
                copied = copy_piece(self.reader, src, self.params[item.param], item.piece)
            except OSError as exc:
                raise DistloadError(
                    f"rank {self.rank} could not copy {item.param} (from {src.name} in {src.file}, through reader "
                    f"rank {bucket.reader}'s open file): {exc}") from exc
            self.stats.record(item.param, item.piece)
            if bucket.reader != self.rank:
                self.stats.bytes_received += copied

    def handover(self) -> str | None:
        """Collective: every reader lends its node's ranks its open files and every rank takes the ones it
        copies from; returns why not (the same on every rank; then the caller takes the wire route)."""
        allow = AllowPulls() if self._own_files else None
        try:
            tables = self._tables()
            if tables is None:
                return "a reader cannot open its files for every rank (out of descriptors?)"
            why = self._borrow(tables)
            # Everyone must have its descriptors before a reader stops allowing it, and a rank that could
            # not take them makes every rank take the bucketed path.
            failed = torch.tensor([0 if why is None else 1], dtype=torch.int64)
            try:
                dist.all_reduce(failed)
            except Exception as exc:
                raise LostPeer("agreeing that every rank has its readers' files", exc) from exc
            if failed.item():
                if why is not None:
                    log.warning("pulls from the reader's files: %s; every rank takes the bucketed transfer", why)
                return why or "another rank could not take its readers' descriptors"
            return None
        finally:
            if allow is not None:
                allow.close()
            self._close_lent()

    def run(self) -> TransferStats:
        """The copies (after a successful handover)."""
        world = self.plan.layout.world
        ahead = Prefault(self.params, [(it.param, it.piece) for items in self._items for it in items], world)
        try:
            self._copy_all(world)
        finally:
            ahead.close()
        return self.stats

    def _copy_all(self, world: int) -> None:
        """Every bucket's items, in plan order (the ranks walk the files together)."""
        for bucket, items in zip(self.plan.buckets, self._items):
            if self.error is None:
                try:
                    faults.hit("transfer")  # test hook (DISTLOAD_FAULT), a no-op otherwise
                    self._copy_bucket(bucket, items)
                    self.stats.buckets += 1
                except Exception as exc:  # keep counting: the agreement step reports it
                    self.error = exc
            if bucket.reader == self.rank:  # the job reads these bytes once: through this reader's files
                self.stats.bytes_read += bucket.read_bytes
                self.reader.count_read(bucket.read_bytes)
                self.stats.bytes_sent += _others_bytes(bucket, world)
            if self.progress is not None:
                self.progress(bucket)

