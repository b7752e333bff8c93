"""Read byte ranges of checkpoint files into caller-provided buffers (DESIGN §5).

The caller owns the memory (reusable staging buffers, pinned on CUDA); we only fill it. One file
descriptor per file, opened lazily and kept until `close()`. The strategies (plain, prefetch, threaded,
threaded-cold, odirect) are described, and chosen, in strategy.py.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol, runtime_checkable

import torch

from distload import faults
from distload.errors import CheckpointError, DistloadError

from .discover import resolve_inside
from .file_reads import (DIRECT_ALIGN, advise_willneed, as_byte_view, early_eof, pread_exactly, round_up,
                         willneed_piece)
from .legacy import LegacyFile, forget_legacy, is_legacy_file, open_legacy
from .strategy import STRATEGIES, THREADED_PIECE_BYTES, THREADED_WORKERS

log = logging.getLogger("distload")

_BOUNCE_BYTES = 8 * 1024 * 1024


@runtime_checkable
class Reader(Protocol):
    """What the transfer and the report ask of a checkpoint reader. read_into fills `out` (a contiguous
    uint8 CPU tensor) with exactly its length of `file` at `offset` and returns the count; read_many does so for
    each (file, offset, out) of a list (one bucket's ranges: a reader that can fetch them at once, object storage,
    does; the others read them in order) and returns the total; prefetch is a hint
    that a range is read soon (it may do nothing); close releases descriptors and threads. bytes_read and
    files_opened count what storage served (a wrapper's are its inner reader's); strategy is one of
    strategy.STRATEGIES, or None where none applies (memory)."""

    @property
    def bytes_read(self) -> int: ...
    @property
    def files_opened(self) -> set[str]: ...
    @property
    def strategy(self) -> str | None: ...
    def read_into(self, file: str, offset: int, out: torch.Tensor, /) -> int: ...
    def read_many(self, ranges, /) -> int: ...
    def prefetch(self, file: str, offset: int, nbytes: int, /) -> None: ...
    def close(self) -> None: ...


class RangeReader:
    """Reads `[offset, offset + len(out))` of checkpoint files under `root` into `out`."""

    def __init__(self, root: str, strategy: str = "plain", exact: bool = False):
        """exact: fetch from storage only the ranges read (no read-ahead), for a reader that skips parts of
        the files another node reads: read-ahead would fetch those from storage here too."""
        if strategy not in STRATEGIES:
            raise DistloadError(f"unknown read strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")
        self.root = os.path.abspath(root)
        self.strategy = strategy
        self.exact = exact
        self.bytes_read = 0
        self.files_opened: set[str] = set()
        self._fds: dict[str, int] = {}
        self._direct: set[str] = set()  # files whose fd is open with O_DIRECT
        self._legacy: dict[str, LegacyFile] = {}
        self._lock = threading.Lock()
        self._bounce = threading.local()  # one aligned buffer per reading thread
        self._pool = None  # threaded: the thread pool, made on first use
        self._nowait = hasattr(os, "RWF_NOWAIT")  # threaded-cold: until the file system refuses it
        self._willneed_piece: dict[str, int] = {}

    def read_into(self, entry_file: str, offset: int, out: memoryview | torch.Tensor, tally: bool = True) -> int:
        """Fill `out` with exactly len(out) bytes of `entry_file` at `offset`; returns the count.
        tally=False: the caller counts these bytes itself (see count_read)."""
        view = as_byte_view(out)
        if is_legacy_file(entry_file):
            count = self._legacy_file(entry_file).read_into(offset, view)
        else:
            fd = self._fd(entry_file)
            if self.strategy == "prefetch" and not self.exact and hasattr(os, "posix_fadvise"):
                # the range after this one (an exact reader's next range may be another's)
                os.posix_fadvise(fd, offset + len(view), len(view), os.POSIX_FADV_WILLNEED)
            if entry_file in self._direct:
                count = self._read_direct(entry_file, fd, offset, view)
            elif self.strategy in ("threaded", "threaded-cold") and len(view) >= 2 * THREADED_PIECE_BYTES:
                count = self._read_threaded(entry_file, fd, offset, view)
            else:
                count = pread_exactly(fd, self.root, entry_file, offset, view)
        if tally:
            with self._lock:
                self.bytes_read += count
        return count

    def read_many(self, ranges) -> int:
        """read_into of each (file, offset, out) of `ranges`, in order."""
        return sum(self.read_into(f, offset, out) for f, offset, out in ranges)

    def fd_of(self, entry_file: str) -> int:
        """This reader's descriptor of a safetensors file (opened on first use, closed by close())."""
        return self._fd(entry_file)

    def open_again(self, entry_file: str) -> int:
        """Another descriptor of a safetensors file, with its own file position and read-ahead state,
        owned by the caller (node_pull.py lends one to each rank of the node)."""
        return self._open(entry_file)

    def adopt(self, entry_file: str, fd: int) -> None:
        """Read `entry_file` through `fd`, an open descriptor of it that this reader now owns (one borrowed
        from the node's reader process: transfer/pull.py); the path is not opened. Not with O_DIRECT."""
        with self._lock:
            old = self._fds.get(entry_file)
            if old is not None:
                os.close(old)
            self._fds[entry_file] = fd

    def count_read(self, nbytes: int) -> None:
        """Count bytes this reader's caller copied out of a file another way (a map of it)."""
        with self._lock:
            self.bytes_read += nbytes

    def prefetch(self, entry_file: str, offset: int, nbytes: int) -> None:
        """Ask the kernel to start fetching a range we will read soon: with the prefetch strategy, and for an
        exact reader, which has no kernel read-ahead (the transfer names its next ranges: engine.py)."""
        if not (self.strategy == "prefetch" or (self.exact and self.strategy != "odirect")):
            return
        if is_legacy_file(entry_file) or nbytes <= 0:
            return
        fd = self._fd(entry_file)
        if entry_file not in self._willneed_piece:
            self._willneed_piece[entry_file] = willneed_piece(fd)
        advise_willneed(fd, offset, nbytes, self._willneed_piece[entry_file])

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()
            self._direct.clear()
            for rel in self._legacy:
                forget_legacy(os.path.join(self.root, rel), rel)
            self._legacy.clear()

    def __enter__(self) -> RangeReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- internals --------------------------------------------------------------------------------

    def _path(self, rel: str) -> str:
        # The index already checked its paths; checking again keeps a hand-built entry from escaping too.
        return resolve_inside(self.root, rel, source=f"read of {rel!r}")

    def _fd(self, rel: str) -> int:
        with self._lock:
            fd = self._fds.get(rel)
            if fd is None:
                fd = self._open(rel)
                self._fds[rel] = fd
                self.files_opened.add(rel)
            return fd

    def _open(self, rel: str) -> int:
        path = self._path(rel)
        try:
            if self.strategy == "odirect":
                direct_flag = getattr(os, "O_DIRECT", None)
                if direct_flag is None:
                    log.warning("O_DIRECT is not available on this platform; reading %s with plain reads", rel)
                else:
                    try:
                        fd = os.open(path, os.O_RDONLY | direct_flag)
                        self._direct.add(rel)
                        return fd
                    except OSError as e:
                        if e.errno != errno.EINVAL:
                            raise
                        log.warning("file system refuses O_DIRECT for %s (%s); falling back to plain reads", rel, e)
            fd = os.open(path, os.O_RDONLY)
        except OSError as e:
            raise CheckpointError(f"{self.root}: cannot open {rel!r}: {e}") from e
        # Readers go through a file front to back (buckets are in file order): a doubled readahead window
        # keeps the disk busy with large requests. An exact reader skips rows, which read-ahead would fetch
        # from storage all the same (BENCHMARKS.md).
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM if self.exact else os.POSIX_FADV_SEQUENTIAL)
        return fd

    def _legacy_file(self, rel: str) -> LegacyFile:
        with self._lock:
            legacy = self._legacy.get(rel)
            if legacy is None:
                legacy = open_legacy(self._path(rel), rel)
                self._legacy[rel] = legacy
                self.files_opened.add(rel)
            return legacy

    def _read_threaded(self, rel: str, fd: int, offset: int, view: memoryview) -> int:
        """One range as up to THREADED_WORKERS concurrent preads of page-aligned pieces (threaded-cold: after
        copying inline what the page cache already holds from its start)."""
        total = len(view)
        cached = self._read_cached(rel, fd, offset, view) if self.strategy == "threaded-cold" else 0
        if cached == total:
            return total
        offset, view = offset + cached, view[cached:]
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(THREADED_WORKERS, thread_name_prefix="distload-pread")
        wanted = len(view)
        piece = max(THREADED_PIECE_BYTES, round_up(-(-wanted // THREADED_WORKERS), DIRECT_ALIGN))
        futures = [self._pool.submit(pread_exactly, fd, self.root, rel, offset + at, view[at:at + piece])
                   for at in range(0, wanted, piece)]
        for f in futures:  # wait for all before raising: no thread may still write into `view` afterwards
            f.exception()
        for f in futures:
            f.result()
        return total

    def _read_cached(self, rel: str, fd: int, offset: int, view: memoryview) -> int:
        """Bytes of the range's start that the page cache holds, copied into `view` without waiting for
        storage (RWF_NOWAIT); 0 where nothing is cached or the file system does not do it."""
        done = 0
        while self._nowait and done < len(view):
            try:
                faults.hit("read")  # test hook (DISTLOAD_FAULT), a no-op otherwise
                got = os.preadv(fd, [view[done:]], offset + done, os.RWF_NOWAIT)
            except BlockingIOError:  # the next page is not cached: storage's turn
                break
            except OSError as e:
                if e.errno in (errno.EOPNOTSUPP, errno.EINVAL):
                    self._nowait = False
                    break
                raise CheckpointError(f"{self.root}: reading {rel!r} at offset {offset + done} failed: {e}") from e
            if got == 0:
                break
            done += got
        return done

    def _bounce_view(self) -> memoryview:
        view = getattr(self._bounce, "view", None)
        if view is None:
            # Anonymous mmap memory is page aligned, which is what O_DIRECT requires of the buffer address.
            view = self._bounce.view = memoryview(mmap.mmap(-1, _BOUNCE_BYTES))
        return view

    def _read_direct(self, rel: str, fd: int, offset: int, view: memoryview) -> int:
        bounce = self._bounce_view()
        wanted, done = len(view), 0
        while done < wanted:
            position = offset + done
            aligned = position - position % DIRECT_ALIGN
            skip = position - aligned
            length = min(_BOUNCE_BYTES, round_up(skip + wanted - done, DIRECT_ALIGN))
            try:
                got = os.preadv(fd, [bounce[:length]], aligned) - skip
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise CheckpointError(f"{self.root}: reading {rel!r} at offset {position} failed: {e}") from e
                # Some file systems accept the O_DIRECT open but refuse the read itself.
                log.warning("O_DIRECT read of %s refused (%s); falling back to plain reads", rel, e)
                return done + self._reopen_plain(rel, fd, position, view[done:])
            if got <= 0:
                raise early_eof(self.root, rel, offset, wanted, done)
            take = min(got, wanted - done)
            view[done : done + take] = bounce[skip : skip + take]
            done += take
        return wanted

    def _reopen_plain(self, rel: str, old_fd: int, offset: int, view: memoryview) -> int:
        with self._lock:
            self._direct.discard(rel)
            self._fds[rel] = os.open(self._path(rel), os.O_RDONLY)
            os.close(old_fd)
            fd = self._fds[rel]
        return pread_exactly(fd, self.root, rel, offset, view)


class ReaderWrapper:
    """A reader that serves `read_into` through another one (checksums, DCP's virtual file): the byte
    counters, the files opened and close() are the inner reader's, so reports count real storage reads."""

    def __init__(self, inner):
        self.inner = inner

    @property
    def bytes_read(self) -> int:
        return self.inner.bytes_read

    @property
    def files_opened(self):
        return self.inner.files_opened

    @property
    def strategy(self) -> str | None:
        return getattr(self.inner, "strategy", None)

    def read_into(self, entry_file: str, offset: int, out) -> int:
        """The inner reader's bytes as they are (subclasses check or translate them)."""
        return self.inner.read_into(entry_file, offset, out)

    def read_many(self, ranges) -> int:
        """read_into of each range, in order (this wrapper's read_into: what a subclass checks or translates)."""
        return sum(self.read_into(f, offset, out) for f, offset, out in ranges)

    def prefetch(self, entry_file: str, offset: int, nbytes: int) -> None:
        """Nothing: the ranges named are of the outer (virtual) file, not of the inner reader's files."""

    def close(self) -> None:
        self.inner.close()
