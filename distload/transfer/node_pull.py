"""One node, host params: every rank copies its pieces straight out of its reader's map of the files.

When the whole job is one node, the page cache is shared by all its processes, and what a load costs is
copies and hand-offs, not storage reads. The bucketed transfer (engine.py) costs a rank two copies
(file -> the reader's shared slot -> its param) and two messages per bucket. Here:

- each reader maps the files it reads (mapping reads nothing) and broadcasts where the maps are;
- every rank, the readers included, copies each of its pieces once, from the reader's map into its
  param, with `process_vm_readv` (pull.py): the kernel reads the pages from the page cache (from the disk
  the first time: still once per node), and a row-parallel piece is one call with one segment per row;
- the ranks go through the readers' buckets in plan order, a window (~8 MiB) at a time, and count the
  windows they finished on a progress board in shared memory; a reader drops its page-table entries for
  a window once every rank is past it (the pages stay in the page cache), and no rank runs more than
  LEAD windows ahead of the slowest, so what the ranks pulled through a reader's map never piles up in
  its RSS. No message per bucket: waiting ranks poll the board, and tell a dead rank (its process gone)
  or a silent one (no progress for the process group's timeout) from a slow one.

Only the readers open weight files, and each byte of the checkpoint is read from storage once. Used when
every rank is on one node, params are host memory and the files are safetensors read as they are (no
post-load steps); the readers decide whether they can serve pulls (pull.py says when not) and tell every
rank in the same broadcast, so a job where they cannot takes the bucketed path on every rank.
"""

from __future__ import annotations

import logging
import os
import time

import numpy as np
import torch
import torch.distributed as dist

from .. import faults, host_memory
from ..dtypes import torch_dtype
from ..errors import DistloadError
from ..plan import Bucket, LoadPlan
from .agreement import LostPeer
from .buffers import TransferStats, map_peer_fd, piece_bytes, shared_memfd, write_piece
from .pull import AllowPulls, FileMaps, pull_rows, why_not_usable

log = logging.getLogger("distload")

# The readers' page-table entries for what the ranks pulled through their maps are dropped a window at a
# time, once every rank is past it; a rank never runs more than LEAD windows ahead of the slowest, so a
# reader's RSS holds at most about (LEAD + 1) windows of the files.
WINDOW_BYTES = 8 << 20
MAX_WINDOWS = 4096
LEAD = 4
_TABLE_HEAD = 3   # usable, pid, progress board fd
_SLOT = 8   # int64 per rank on the progress board: one cache line each
_POLL_S = 0.0002
_POLL_MAX_S = 0.005
_ALIVE_CHECK_S = 0.05


def windows_of(plan: LoadPlan) -> list[tuple[int, list[Bucket]]]:
    """(reader, buckets): runs of consecutive buckets of one reader, each about WINDOW_BYTES or more."""
    size = max(WINDOW_BYTES, plan.checkpoint_bytes // MAX_WINDOWS)
    out: list[tuple[int, list[Bucket]]] = []
    filled = 0
    for bucket in plan.buckets:
        if not out or out[-1][0] != bucket.reader or filled >= size:
            out.append((bucket.reader, []))
            filled = 0
        out[-1][1].append(bucket)
        filled += bucket.read_bytes
    return out


class ProgressBoard:
    """How many windows each rank of the node has copied: one int64 per rank in a memfd that the first
    reader makes and every rank maps (through /proc/<pid>/fd, as the shared slots are). Ranks only ever
    store their own count and load the others'; a stale load only delays a drop or a step."""

    def __init__(self, world: int, fd: int | None = None, pid: int | None = None):
        self.world, self.own_fd = world, None
        if fd is None:
            self.own_fd, self.map = shared_memfd("distload-progress", world * _SLOT * 8)
        else:
            self.map = map_peer_fd(pid, fd)
        board = np.frombuffer(self.map, dtype=np.int64)
        self.counts, self.pids = board[::_SLOT], board[1::_SLOT]

    def set(self, rank: int, windows: int) -> None:
        self.counts[rank] = windows

    def announce(self, rank: int) -> None:
        """Publish this process's pid, so that ranks waiting for it can tell a dead rank from a slow one."""
        self.pids[rank] = os.getpid()

    def gone(self, rank: int) -> bool:
        """Has that rank's process exited (or been killed)? Unknown (not yet announced) counts as alive."""
        pid = int(self.pids[rank])
        if pid <= 0:
            return False
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return True
        return state in ("Z", "X")  # a zombie is dead: killed, not yet reaped by its launcher

    def slowest(self) -> tuple[int, int]:
        """(windows done by the slowest rank, that rank)."""
        rank = int(self.counts.argmin())
        return int(self.counts[rank]), rank

    def close(self) -> None:
        if self.own_fd is not None:
            os.close(self.own_fd)
            self.own_fd = None


def _others_bytes(bucket: Bucket, world: int) -> int:
    """Bytes of a bucket that ranks other than its reader take."""
    if bucket.broadcast:
        return bucket.read_bytes * (world - 1)
    return sum(n for d, n in enumerate(bucket.recv_bytes) if d != bucket.reader)


class NodePulls:
    """Fills this rank's params by pulling from the readers' maps; `run()` returns TransferStats, or None
    on every rank when a reader cannot serve pulls (then the caller runs the bucketed transfer)."""

    def __init__(self, plan: LoadPlan, rank: int, params: dict[str, torch.Tensor], reader=None,
                 timeout_s: float = 600.0):
        self.plan, self.rank, self.params, self.reader = plan, rank, params, reader
        self.timeout_s = timeout_s
        self.stats = TransferStats(path="node-pulls")
        self.error: BaseException | None = None  # reported at the phase's agreement step
        self.files = sorted({src.file for src in plan.sources.values()})
        self._file_index = {f: i for i, f in enumerate(self.files)}
        self._maps: FileMaps | None = None
        self._board: ProgressBoard | None = None

    # -- where each reader's maps are -----------------------------------------------------------------

    def _my_table(self, first: bool) -> torch.Tensor:
        """[usable, pid, progress board fd (the first reader's), address of each file's map (0: not read
        here)], as this reader broadcasts it."""
        table = torch.zeros(_TABLE_HEAD + len(self.files), dtype=torch.int64)
        why = why_not_usable()
        if why is None and os.environ.get("DISTLOAD_SHM", "1") == "0":
            why = "DISTLOAD_SHM=0: no memory shared between ranks"
        if why is None and self.reader.strategy == "odirect":
            why = "the reader reads with O_DIRECT, around the page cache"
        if why is not None:
            log.info("pulls from the reader's map: not here (%s); using the bucketed transfer", why)
            return table
        try:
            self._maps = FileMaps()
            mine = {self.plan.sources[c.source].file for b in self.plan.buckets if b.reader == self.rank for c in b.chunks}
            for f in mine:
                table[_TABLE_HEAD + self._file_index[f]] = self._maps.address(self.reader.fd_of(f), 0)
            if first:
                self._board = ProgressBoard(self.plan.layout.world)
                table[2] = self._board.own_fd
        except Exception as exc:  # cannot map: say so; every rank then takes the bucketed path
            log.info("pulls from the reader's map: cannot map the files (%s); using the bucketed transfer", exc)
            table.zero_()
            return table
        table[0], table[1] = 1, os.getpid()
        return table

    def _tables(self) -> dict[int, tuple[int, list[int]]] | None:
        """Every reader's (pid, file addresses), the same on every rank; None if any reader cannot serve."""
        tables, usable = {}, True
        readers = sorted({b.reader for b in self.plan.buckets})
        for r in readers:
            table = (self._my_table(first=r == readers[0]) if r == self.rank
                     else torch.zeros(_TABLE_HEAD + len(self.files), dtype=torch.int64))
            try:
                dist.broadcast(table, src=r)
            except Exception as exc:
                raise LostPeer(f"receiving the map addresses of reader rank {r}", exc) from exc
            ok, pid, board_fd, *addresses = (int(x) for x in table)
            usable = usable and bool(ok)  # every rank sees every table: all decide alike
            tables[r] = (pid, addresses)
            if r == readers[0] and ok and self._board is None:
                self._board = ProgressBoard(self.plan.layout.world, fd=board_fd, pid=pid)
        return tables if usable else None

    # -- the copies --------------------------------------------------------------------------------

    def _pull_bucket(self, bucket: Bucket, pid: int, addresses: list[int]) -> None:
        for item in self.plan.items(bucket, self.rank):
            src = self.plan.sources[item.chunk.source]
            isz = torch_dtype(src.dtype).itemsize
            piece = item.piece
            rows, seg = piece.rows[1] - piece.rows[0], (piece.cols[1] - piece.cols[0]) * isz
            remote = (addresses[self._file_index[src.file]] + src.offset + piece.rows[0] * src.row_bytes
                      + piece.cols[0] * isz)
            dst = self.params[item.param]
            as_is = dst.dtype == torch_dtype(src.dtype)
            block = piece_bytes(dst, piece) if as_is else torch.empty((rows, seg), dtype=torch.uint8)
            if as_is:
                host_memory.populate(block)
            try:
                if bucket.reader == self.rank and block.is_contiguous() and seg == src.row_bytes:
                    # Its own whole rows, a reader reads straight into the param: nothing comes into its map.
                    self.reader.read_into(src.file, src.offset + piece.rows[0] * src.row_bytes, block.view(-1),
                                          tally=False)
                else:
                    pull_rows(pid, remote, src.row_bytes, block)
            except OSError as exc:
                raise DistloadError(
                    f"rank {self.rank} could not copy {item.param} (from {src.name} in {src.file}) out of reader "
                    f"rank {bucket.reader}'s map of it (process {pid}): {exc}. On one node ranks copy their pieces "
                    "out of their reader's memory (process_vm_readv: same user, Yama ptrace_scope <= 1); set "
                    "DISTLOAD_PULL=0 to use the bucketed transfer instead") from exc
            if not as_is:  # the caller's module has another dtype: pulled into scratch, converted into it
                write_piece(dst, piece, block, torch_dtype(src.dtype))
            self.stats.record(item.param, piece)
            if bucket.reader != self.rank:
                self.stats.bytes_received += rows * seg

    def run(self) -> TransferStats | None:
        world = self.plan.layout.world
        allow = AllowPulls() if any(b.reader == self.rank for b in self.plan.buckets) else None
        try:
            tables = self._tables()
            if tables is None:
                return None
            windows = windows_of(self.plan)
            board = self._board
            if board is None:  # nothing to read at all
                return self.stats
            board.announce(self.rank)
            dropped = 0  # this reader's windows before this one are out of its RSS
            for w, (reader, buckets) in enumerate(windows):
                if self.error is None:
                    try:
                        dropped = self._wait_for_slowest(w - LEAD, windows, dropped)
                        for bucket in buckets:
                            faults.hit("transfer")  # test hook (DISTLOAD_FAULT), a no-op otherwise
                            self._pull_bucket(bucket, *tables[reader])
                            self.stats.buckets += 1
                    except LostPeer:
                        raise
                    except Exception as exc:  # keep going (counting): the agreement step reports it
                        self.error = exc
                board.set(self.rank, w + 1)
                if reader == self.rank:  # the job reads these bytes once: through this reader's maps
                    read = sum(b.read_bytes for b in buckets)
                    self.stats.bytes_read += read
                    self.reader.count_read(read)
                    self.stats.bytes_sent += sum(_others_bytes(b, world) for b in buckets)
                dropped = self._drop_done(windows, dropped)
            if any(reader == self.rank for reader, _ in windows):  # keep the maps until every rank is done
                self._wait_for_slowest(len(windows), windows, dropped)
            return self.stats
        except BaseException:
            if self._board is not None:  # nobody waits for a rank that has stopped
                self._board.set(self.rank, 1 << 62)
            raise
        finally:
            if allow is not None:
                allow.close()
            if self._maps is not None:
                self._maps.close()
            if self._board is not None:
                self._board.close()

    def _wait_for_slowest(self, windows_done: int, windows, dropped: int) -> int:
        """Until every rank has copied `windows_done` windows; a reader drops what they finish meanwhile.
        Fails if the slowest rank makes no progress for the process group's timeout. Returns `dropped`."""
        seen, since, checked, nap = None, time.monotonic(), time.monotonic(), _POLL_S
        while True:
            dropped = self._drop_done(windows, dropped)
            slowest, rank = self._board.slowest()
            if slowest >= windows_done:
                return dropped
            if slowest != seen:
                seen, since, checked, nap = slowest, time.monotonic(), time.monotonic(), _POLL_S
            elif time.monotonic() - checked > _ALIVE_CHECK_S:
                checked = time.monotonic()
                if self._board.gone(rank):
                    raise LostPeer(f"waiting for rank {rank} to copy its pieces (it has done {slowest} of "
                                   f"{windows_done} windows)", ProcessLookupError(f"rank {rank}'s process is gone"))
            if time.monotonic() - since > self.timeout_s:
                raise LostPeer(f"waiting for rank {rank} to copy its pieces (it has done {slowest} of "
                               f"{windows_done} windows)", TimeoutError(f"no progress in {self.timeout_s:.0f} s"))
            time.sleep(nap)
            nap = min(nap * 2, _POLL_MAX_S)  # a long wait (a slow disk) costs no CPU to speak of

    def _drop_done(self, windows, dropped: int) -> int:
        """Drop this reader's windows that every rank has copied; returns the first window not dropped."""
        if self._maps is None:
            return dropped
        slowest, _ = self._board.slowest()
        while dropped < min(slowest, len(windows)):
            reader, buckets = windows[dropped]
            if reader == self.rank:
                self._drop(buckets)
            dropped += 1
        return dropped

    def _drop(self, buckets: list[Bucket]) -> None:
        """Forget this reader's page-table entries for the buckets' bytes (their pages stay cached)."""
        for bucket in buckets:
            for chunk in bucket.chunks:
                src = self.plan.sources[chunk.source]
                self._maps.drop(self.reader.fd_of(src.file), src.offset + chunk.rows[0] * src.row_bytes,
                                (chunk.rows[1] - chunk.rows[0]) * src.row_bytes)
