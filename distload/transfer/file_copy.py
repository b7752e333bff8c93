"""One piece from a checkpoint file straight into its param: the copy both one-node paths make.

Used where the page cache already holds (or will hold, once) the file for every process of the node, so
copying from it is the only copy: `--readers owners` (owner_reads.py: each rank opens the files) and node
pulls (node_pull.py: each rank reads through descriptors borrowed from its reader).

- a piece made of whole rows of the source (column-parallel splits, vocab shards, replicated tensors,
  experts) is one byte range of the file: one `preadv` straight into the param;
- a piece made of some columns of every row (row-parallel splits) is strided in the file: it is copied
  from a read-only map of the file (page-cache pages, no read into a buffer first), one strided copy,
  and the map is dropped right after, so the file's pages never pile up in the rank's RSS.
"""

from __future__ import annotations

import mmap
import threading
import warnings

import torch

from . import host_memory
from ..checkpoint.strategy import usable_cpus
from ..dtypes import torch_dtype
from ..plan.shard import view2d
from .buffers import piece_bytes, write_piece


def copy_piece(files, src, dst: torch.Tensor, piece) -> int:
    """Copy `piece` of source tensor `src` (a plan Source) from its file into `dst` (its param); returns
    the bytes taken from the file. files: a RangeReader (read_into, fd_of); nothing is tallied on it."""
    rows, cols = piece.rows[1] - piece.rows[0], piece.cols[1] - piece.cols[0]
    src_dtype = torch_dtype(src.dtype)
    isz = src_dtype.itemsize
    start = src.offset + piece.rows[0] * src.row_bytes
    if dst.dtype == src_dtype:
        region = piece_bytes(dst, piece)
        # Fault the destination in with one call, not one page fault per 4 KiB inside the copy.
        host_memory.populate(region)
        if cols == view2d(src.shape)[1] and region.is_contiguous():  # whole rows: one byte range
            return files.read_into(src.file, start, region.reshape(-1), tally=False)

    def copy_columns(raw: torch.Tensor) -> None:
        write_piece(dst, piece, raw.view(rows, src.row_bytes)[:, piece.cols[0] * isz:piece.cols[1] * isz], src_dtype)

    with_mapped(files.fd_of(src.file), start, rows * src.row_bytes, copy_columns)
    return rows * cols * isz


def with_mapped(fd: int, start: int, nbytes: int, use) -> None:
    """Call use(bytes [start, start + nbytes) of the file as a uint8 tensor over a private read-only map),
    then unmap it. (Private and writable only so that torch can wrap it; nothing writes to it.) `use` must
    not keep the tensor."""
    if nbytes == 0:
        return
    lo = start - start % mmap.ALLOCATIONGRANULARITY
    region = mmap.mmap(fd, start + nbytes - lo, offset=lo, flags=mmap.MAP_PRIVATE,
                       prot=mmap.PROT_READ | mmap.PROT_WRITE)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            use(torch.frombuffer(region, dtype=torch.uint8, offset=start - lo, count=nbytes))
    finally:
        try:
            region.close()
        except BufferError:  # `use` raised and its traceback still holds the tensor: unmapped when it goes
            pass


class Prefault:
    """Faults in (host_memory.populate) the params' regions the copies will fill, in the order they fill
    them, on a helper thread, when the rank has a CPU to spare (more CPUs than ranks on the node): zeroing
    a fresh page is CPU work that otherwise runs in line with the copies, between reads that wait on
    storage. A copy that gets there first faults its pages in itself, as it would without this; a region
    faulted in twice costs nothing more. Measured at world 1 (1 GiB, a 1-rank harness alternating distload
    with and without it and every-rank-reads, 10 reps): cold 1.12x -> 0.96x every-rank-reads, warm 0.93x ->
    0.67x. With no CPU to spare (4 ranks on 2 cores) the same thread made warm loads slower (1.19x -> 1.41x),
    so it is not started, and nothing is computed for it.

    pieces: (param name, plan Piece) in copy order; their regions are worked out on the helper thread."""

    def __init__(self, params: dict[str, torch.Tensor], pieces: list, local_ranks: int):
        self._params, self._pieces, self._stop = params, pieces, threading.Event()
        self._thread = None
        if pieces and usable_cpus() > local_ranks:
            self._thread = threading.Thread(target=self._run, daemon=True, name="distload-prefault")
            self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        for param, piece in self._pieces:
            if self._stop.is_set():
                return
            host_memory.populate(piece_bytes(self._params[param], piece))

    def close(self) -> None:
        """Stop (the copies are done: what is left is filled already) and wait for the thread."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

