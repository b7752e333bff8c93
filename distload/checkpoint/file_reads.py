"""The system calls under every checkpoint read: exact preads, WILLNEED advice, page-cache eviction."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from distload import faults
from distload.errors import CheckpointError

log = logging.getLogger("distload")

DIRECT_ALIGN = 4096  # O_DIRECT alignment: covers 512-byte and 4 KiB logical block sizes


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


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def early_eof(root: str, rel: str, offset: int, wanted: int, done: int) -> CheckpointError:
    return CheckpointError(
        f"{root}: {rel!r} ended after {done} of the {wanted} bytes requested at offset {offset} "
        "(file truncated since its header was read?); re-download the file"
    )


def pread_exactly(fd: int, root: str, rel: str, offset: int, view: memoryview) -> int:
    wanted, done = len(view), 0
    while done < wanted:  # preadv may return short counts (signals, network FS, the ~2 GiB per-call cap)
        try:
            faults.hit("read")  # test hook (DISTLOAD_FAULT), a no-op otherwise
            got = os.preadv(fd, [view[done:]], offset + done)
        except OSError as e:
            raise CheckpointError(f"{root}: reading {rel!r} at offset {offset + done} failed: {e}") from e
        if got == 0:
            raise early_eof(root, rel, offset, wanted, done)
        done += got
    return wanted


def as_byte_view(out: memoryview | torch.Tensor) -> memoryview:
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


