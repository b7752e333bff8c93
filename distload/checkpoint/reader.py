"""Read byte ranges of checkpoint files into caller-provided buffers (DESIGN §5).

The caller owns the memory (reusable staging buffers, pinned on CUDA); we only fill it. One file
descriptor per file, opened lazily and kept until `close()`. Strategies:

- plain:    `os.preadv` straight into the buffer; the kernel's readahead does the rest (local disks).
- prefetch: plain, plus `posix_fadvise(WILLNEED)` for the range after each read and for explicit
            `prefetch()` hints, so network file systems fetch the next bucket while we copy this one.
- threaded: a large range is split into pieces read by a small thread pool at once: a network or
            parallel file system (or an NVMe drive) serves several outstanding requests much faster than
            one, and unlike prefetch this does not fill the page cache ahead of us.
- threaded-cold: what the page cache holds is copied inline (`preadv` with `RWF_NOWAIT`), only the rest
            as threaded pieces: a lone reader gets the storage's concurrency cold without paying threads to
            copy cached pages on a host with few CPUs.
- odirect:  `O_DIRECT` through an aligned bounce buffer, bypassing the page cache (no second copy of the
            checkpoint in RAM); falls back to plain, with a warning, where the file system refuses it.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import threading
from pathlib import Path

import psutil
import torch

from distload import faults
from distload.errors import CheckpointError, DistloadError

from .discover import resolve_inside
from .legacy import LEGACY_SUFFIXES, LegacyFile, forget_legacy, is_legacy_file, open_legacy

log = logging.getLogger("distload")

STRATEGIES = ("plain", "threaded", "threaded-cold", "prefetch", "odirect")
# File systems where every read is a network round trip, so hinting ahead pays off.
NETWORK_FS_PREFIXES = ("nfs", "lustre", "fuse", "ceph", "gpfs")
# Prefetched pages live in the page cache; past half of free RAM they would evict each other (or the app).
PREFETCH_RAM_FRACTION = 0.5
_DIRECT_ALIGN = 4096  # covers 512-byte and 4 KiB logical block sizes
_BOUNCE_BYTES = 8 * 1024 * 1024
# threaded: ranges up to twice this are one pread; larger ones become pieces of at least this size,
# at most THREADED_WORKERS of them in flight.
THREADED_PIECE_BYTES = 4 * 1024 * 1024
THREADED_WORKERS = 8
# A rank whose params live on a device reads into a host buffer first; one thread's copies out of the page
# cache cap that (4.4 GB/s warm on an H200 host, against 6.1 GB/s threaded and 55 GB/s pinned H2D:
# BENCHMARKS.md). With at least this many CPUs per rank of the node, threaded reads are chosen there.
THREADED_MIN_CPUS_PER_RANK = 4


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
        view = _as_byte_view(out)
        if is_legacy_file(entry_file):
            count = self._legacy_file(entry_file).read_into(offset, view)
        else:
            fd = self._fd(entry_file)
            if self.strategy == "prefetch" and not self.exact:  # an exact reader's next range may be another's
                self._advise_willneed(fd, offset + len(view), len(view))
            if entry_file in self._direct:
                count = self._read_direct(entry_file, fd, offset, view)
            elif self.strategy in ("threaded", "threaded-cold") and len(view) >= 2 * THREADED_PIECE_BYTES:
                count = self._read_threaded(entry_file, fd, offset, view)
            else:
                count = _pread_exactly(fd, self.root, entry_file, offset, view)
        if tally:
            with self._lock:
                self.bytes_read += count
        return count

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
        # keeps the disk busy with large requests. Measured cold on this VM (1 GiB, one process): 1.6 GB/s
        # instead of 0.85-1.0. An exact reader skips rows: with read-ahead, two emulated nodes each reading
        # half of every column-parallel tensor took 1.5x the checkpoint from the disk (scripts/bench.py).
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

    def _advise_willneed(self, fd: int, offset: int, nbytes: int) -> None:
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, offset, nbytes, os.POSIX_FADV_WILLNEED)

    def _read_threaded(self, rel: str, fd: int, offset: int, view: memoryview) -> int:
        """One range as up to THREADED_WORKERS concurrent preads of page-aligned pieces (threaded-cold: after
        copying inline what the page cache already holds from its start)."""
        from concurrent.futures import ThreadPoolExecutor

        total = len(view)
        cached = self._read_cached(rel, fd, offset, view) if self.strategy == "threaded-cold" else 0
        if cached == total:
            return total
        offset, view = offset + cached, view[cached:]
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(THREADED_WORKERS, thread_name_prefix="distload-pread")
        wanted = len(view)
        piece = max(THREADED_PIECE_BYTES, _round_up(-(-wanted // THREADED_WORKERS), _DIRECT_ALIGN))
        futures = [self._pool.submit(_pread_exactly, fd, self.root, rel, offset + at, view[at:at + piece])
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
            aligned = position - position % _DIRECT_ALIGN
            skip = position - aligned
            length = min(_BOUNCE_BYTES, _round_up(skip + wanted - done, _DIRECT_ALIGN))
            try:
                got = os.preadv(fd, [bounce[:length]], aligned) - skip
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise CheckpointError(f"{self.root}: reading {rel!r} at offset {position} failed: {e}") from e
                # Some file systems accept the O_DIRECT open but refuse the read itself.
                log.warning("O_DIRECT read of %s refused (%s); falling back to plain reads", rel, e)
                return done + self._reopen_plain(rel, fd, position, view[done:])
            if got <= 0:
                raise _early_eof(self.root, rel, offset, wanted, done)
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
        return _pread_exactly(fd, self.root, rel, offset, view)


def advise_willneed(fd: int, offset: int, nbytes: int, piece: int) -> None:
    """Ask the kernel to fetch [offset, offset + nbytes) of the file, in WILLNEED calls of at most `piece`
    bytes (willneed_piece: one longer call would fetch only its first piece)."""
    for at in range(offset, offset + nbytes, piece):
        os.posix_fadvise(fd, at, min(piece, offset + nbytes - at), os.POSIX_FADV_WILLNEED)


def willneed_piece(fd: int) -> int:
    """The most one posix_fadvise(WILLNEED) fetches of this file: Linux clips it to the larger of its
    device's largest request (max_sectors_kb) and read-ahead window (read_ahead_kb), so a longer range is
    asked for in pieces of this size. 1 MiB where sysfs does not say (below both on common disks)."""
    st = os.fstat(fd)
    base = f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    for queue in (f"{base}/queue", f"{base}/../queue"):  # a partition's queue is its disk's
        try:
            kib = [int(Path(queue, name).read_text()) for name in ("max_sectors_kb", "read_ahead_kb")]
        except (OSError, ValueError):
            continue
        return max(max(kib) << 10, 1 << 17)
    return 1 << 20


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _early_eof(root: str, rel: str, offset: int, wanted: int, done: int) -> CheckpointError:
    return CheckpointError(
        f"{root}: {rel!r} ended after {done} of the {wanted} bytes requested at offset {offset} "
        "(file truncated since its header was read?); re-download the file"
    )


def _pread_exactly(fd: int, root: str, rel: str, offset: int, view: memoryview) -> int:
    wanted, done = len(view), 0
    while done < wanted:  # preadv may return short counts (signals, network FS, the ~2 GiB per-call cap)
        try:
            faults.hit("read")  # test hook (DISTLOAD_FAULT), a no-op otherwise
            got = os.preadv(fd, [view[done:]], offset + done)
        except OSError as e:
            raise CheckpointError(f"{root}: reading {rel!r} at offset {offset + done} failed: {e}") from e
        if got == 0:
            raise _early_eof(root, rel, offset, wanted, done)
        done += got
    return wanted


def _as_byte_view(out: memoryview | torch.Tensor) -> memoryview:
    """A writable, flat byte view of the caller's buffer (no copy)."""
    if isinstance(out, torch.Tensor):
        if out.device.type != "cpu" or out.dtype != torch.uint8 or not out.is_contiguous():
            raise TypeError(
                f"out must be a contiguous uint8 CPU tensor, got {out.dtype} on {out.device} "
                f"(contiguous={out.is_contiguous()})"
            )
        return memoryview(out.view(-1).numpy())
    view = memoryview(out)
    if view.readonly or not view.c_contiguous:
        raise TypeError("out must be a writable, C-contiguous buffer")
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def choose_strategy(root: str | os.PathLike, checkpoint_bytes: int | None = None, device: str = "cpu",
                    ranks_on_node: int = 1, reading_on_node: int | None = None) -> tuple[str, str]:
    """Pick a read strategy from the file system type of `root`, free RAM and, for params on a device, the
    CPUs each rank of the node has; returns (strategy, reason). reading_on_node: how many ranks of the node
    read the files at once (all of them when each copies its own pieces; its readers otherwise; default
    ranks_on_node): a lone one is a single stream."""
    if reading_on_node is None:
        reading_on_node = ranks_on_node
    real = os.path.realpath(root)
    fstype, mountpoint = _filesystem_of(real)
    if checkpoint_bytes is None:
        checkpoint_bytes = _weight_file_bytes(real)
    available = psutil.virtual_memory().available
    gib = 1024**3
    where = f"{real} is on {fstype} (mounted at {mountpoint})"
    cpus = usable_cpus()
    if not fstype.startswith(NETWORK_FS_PREFIXES):
        if not device.startswith("cpu") and cpus >= THREADED_MIN_CPUS_PER_RANK * max(ranks_on_node, 1):
            strategy, reason = "threaded", (
                f"{where}, a local file system, and params on {device} with {cpus} CPUs for {ranks_on_node} "
                f"rank(s) of this node: {THREADED_WORKERS} concurrent preads per range fill the host buffer "
                f"faster than one thread")
        elif reading_on_node <= 1:
            strategy, reason = "threaded-cold", (
                f"{where}, a local file system, and one rank of this node reads: pages not yet cached are read "
                f"as {THREADED_WORKERS} concurrent preads per range (one stream leaves most disks idle), cached "
                f"ones copied inline")
        else:
            strategy, reason = "plain", f"{where}, a local file system: kernel readahead suffices"
    elif checkpoint_bytes < PREFETCH_RAM_FRACTION * available:
        strategy, reason = "prefetch", (
            f"{where}, a network file system, and the checkpoint ({checkpoint_bytes / gib:.1f} GiB) is under "
            f"{PREFETCH_RAM_FRACTION:.0%} of available RAM ({available / gib:.1f} GiB): prefetching with posix_fadvise"
        )
    else:
        strategy, reason = "threaded", (
            f"{where}, a network file system, but the checkpoint ({checkpoint_bytes / gib:.1f} GiB) is not under "
            f"{PREFETCH_RAM_FRACTION:.0%} of available RAM ({available / gib:.1f} GiB): prefetched pages would "
            f"evict each other, so {THREADED_WORKERS} concurrent preads per range instead"
        )
    log.info("read strategy %s: %s", strategy, reason)
    return strategy, reason


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity: a container's or job's share, not the machine's)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _filesystem_of(path: str) -> tuple[str, str]:
    # all=True: without it psutil hides "nodev" file systems, which is exactly what NFS and FUSE are.
    best = None
    for part in psutil.disk_partitions(all=True):
        mount = part.mountpoint
        inside = path == mount or path.startswith(mount.rstrip("/") + "/")
        if inside and (best is None or len(mount) > len(best.mountpoint)):
            best = part
    return (best.fstype.lower(), best.mountpoint) if best else ("unknown", "?")


def _weight_file_bytes(directory: str) -> int:
    try:
        with os.scandir(directory) as it:
            return sum(
                e.stat().st_size for e in it if e.name.endswith((".safetensors", *LEGACY_SUFFIXES)) and e.is_file()
            )
    except OSError:
        return 0


def evict_from_page_cache(path: str | os.PathLike) -> None:
    """Drop a file's cached pages so the next read comes from storage (cold-cache benchmarks)."""
    if not hasattr(os, "posix_fadvise"):
        log.warning("posix_fadvise is not available; cannot evict %s from the page cache", path)
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


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

    def prefetch(self, entry_file: str, offset: int, nbytes: int) -> None:
        """Nothing: the ranges named are of the outer (virtual) file, not of the inner reader's files."""

    def close(self) -> None:
        self.inner.close()
