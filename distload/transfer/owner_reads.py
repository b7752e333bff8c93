"""`--readers owners`: every rank copies the pieces it owns straight out of the checkpoint files.

When every rank of the job shares one page cache (one node), the storage is read once whichever process
asks, and moving bytes through a reader costs a second copy: file -> the reader's staging -> the param,
where copying from the page cache into the param is one. On a CPU-bound node that second copy (and the
per-bucket hand-offs) is most of what distload costs over every-rank-reads (BENCHMARKS.md). In this mode
every rank is a reader, but only of its own bytes:

each piece is one `preadv` into the param (whole rows) or one strided copy out of a map of the file
(row-parallel columns): transfer/file_copy.py.

Across nodes this would read a tensor once per node that needs it, which is what readers exist to avoid:
topology refuses `owners` on more than one node. Post-load steps (quantization), torch.load files and
DCP checkpoints take the bucketed transfer (route.py says why).
"""

from __future__ import annotations

import torch

from ..plan import LoadPlan
from .buffers import TransferStats
from .file_copy import Prefault, copy_piece


class OwnerReads:
    """Fills one rank's params from the files, the pieces in file order; `run()` returns TransferStats."""

    def __init__(self, plan: LoadPlan, rank: int, params: dict[str, torch.Tensor], reader, progress=None):
        self.plan, self.rank, self.params, self.reader = plan, rank, params, reader
        self.progress = progress   # a progress.Progress, advanced by each piece's bytes
        self.stats = TransferStats(path="owner-reads")
        self.error: BaseException | None = None  # as Transfer's; this one raises instead

    def run(self) -> TransferStats:
        pieces = self.plan.owned_pieces(self.rank)
        ahead = Prefault(self.params, [(d.param, d.piece) for _, d in pieces],
                         self.plan.layout.local_world or self.plan.layout.world)
        try:
            for src, d in pieces:
                copied = copy_piece(self.reader, src, self.params[d.param], d.piece)
                self.reader.count_read(copied)
                self.stats.record(d.param, d.piece)
                if self.progress is not None:
                    self.progress.advance(copied)
        finally:
            ahead.close()
        return self.stats
