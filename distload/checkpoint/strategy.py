"""Read strategies: what each one is, and which one a load gets (RangeReader implements them).

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

import logging
import os

import psutil

from .legacy import LEGACY_SUFFIXES
from ..options import READ_STRATEGIES

log = logging.getLogger("distload")

STRATEGIES = READ_STRATEGIES   # declared with the --read-strategy option
# File systems where every read is a network round trip, so hinting ahead pays off.
NETWORK_FS_PREFIXES = ("nfs", "lustre", "fuse", "ceph", "gpfs")
# Prefetched pages live in the page cache; past half of free RAM they would evict each other (or the app).
PREFETCH_RAM_FRACTION = 0.5
# threaded: ranges up to twice this are one pread; larger ones become pieces of at least this size,
# at most THREADED_WORKERS of them in flight.
THREADED_PIECE_BYTES = 4 * 1024 * 1024
THREADED_WORKERS = 8
# A rank whose params live on a device reads into a host buffer first, and one thread's copies out of the
# page cache cap that (BENCHMARKS.md). With at least this many CPUs per rank of the node, threaded reads
# are chosen there.
THREADED_MIN_CPUS_PER_RANK = 4


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
    """(type, mount point) of the file system holding `path` (the deepest mount containing it)."""
    # all=True: without it psutil hides "nodev" file systems, which is exactly what NFS and FUSE are.
    best = None
    for part in psutil.disk_partitions(all=True):
        mount = part.mountpoint
        inside = path == mount or path.startswith(mount.rstrip("/") + "/")
        if inside and (best is None or len(mount) > len(best.mountpoint)):
            best = part
    return (best.fstype.lower(), best.mountpoint) if best else ("unknown", "?")


def _weight_file_bytes(directory: str) -> int:
    """Bytes of the weight files directly in `directory` (0 where it cannot be listed)."""
    try:
        with os.scandir(directory) as it:
            return sum(
                e.stat().st_size for e in it if e.name.endswith((".safetensors", *LEGACY_SUFFIXES)) and e.is_file()
            )
    except OSError:
        return 0


