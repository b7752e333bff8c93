"""`--readers owners`: every rank copies the pieces it owns straight out of the checkpoint files.

When every rank of the job shares one page cache (one node), the storage is read once whichever process
asks, and moving bytes through a reader costs a second copy: file -> the reader's staging -> the param,
where copying from the page cache into the param is one. On a CPU-bound node that second copy (and the
per-bucket hand-offs) is most of what distload costs over every-rank-reads (BENCHMARKS.md). In this mode
every rank is a reader, but only of its own bytes:

- a piece made of whole rows of the source (column-parallel splits, vocab shards, replicated tensors,
  experts) is one byte range of the file: one `preadv` straight into the param;
- a piece made of some columns of every row (row-parallel splits) is strided in the file: it is copied
  from a read-only map of the file (page-cache pages, no read into a buffer first), one strided copy.

Across nodes this would read a tensor once per node that needs it, which is what readers exist to avoid:
topology refuses `owners` on more than one node. Post-load steps (quantization), torch.load files and
DCP checkpoints take the normal path (loader.py says so in the log).
"""

from __future__ import annotations

import mmap
import warnings

import torch

from . import host_memory
from .dtypes import torch_dtype
from .plan import LoadPlan
from .shard import view2d
from .transfer import TransferStats, piece_bytes, write_piece


class OwnerReads:
    """Fills one rank's params from the files, the pieces in file order; `run()` returns TransferStats."""

    def __init__(self, plan: LoadPlan, rank: int, params: dict[str, torch.Tensor], reader):
        self.plan, self.rank, self.params, self.reader = plan, rank, params, reader
        self.stats = TransferStats(path="owner-reads")
        self.error: BaseException | None = None  # as Transfer's; this one raises instead

    def run(self) -> TransferStats:
        mine = [(src, d) for src in self.plan.sources.values() for d in src.deliveries if d.rank == self.rank]
        mine.sort(key=lambda sd: (sd[0].file, sd[0].offset + sd[1].piece.rows[0] * sd[0].row_bytes))
        for src, d in mine:
            self._copy(src, d.param, d.piece)
        return self.stats

    def _copy(self, src, param: str, piece) -> None:
        dst = self.params[param]
        rows, cols = piece.rows[1] - piece.rows[0], piece.cols[1] - piece.cols[0]
        isz = torch_dtype(src.dtype).itemsize
        start = src.offset + piece.rows[0] * src.row_bytes
        same_dtype = dst.dtype == torch_dtype(src.dtype)
        if same_dtype:
            region = piece_bytes(dst, piece)
            host_memory.populate(region)
            if cols == view2d(src.shape)[1] and region.is_contiguous():  # whole rows: one byte range
                self.reader.read_into(src.file, start, region.reshape(-1))
                self.stats.record(param, piece)
                return

        def copy_columns(raw: torch.Tensor) -> None:
            write_piece(dst, piece, raw.view(rows, src.row_bytes)[:, piece.cols[0] * isz:piece.cols[1] * isz],
                        torch_dtype(src.dtype))

        _with_mapped(self.reader.fd_of(src.file), start, rows * src.row_bytes, copy_columns)
        self.reader.count_read(rows * cols * isz)
        self.stats.record(param, piece)


def _with_mapped(fd: int, start: int, nbytes: int, use) -> None:
    """Call use(bytes [start, start + nbytes) of the file as a uint8 tensor over a private read-only map),
    then unmap it, so the file's pages never pile up in this rank's RSS. (Private and writable only so
    that torch can wrap it; nothing writes to it.) `use` must not keep the tensor."""
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
