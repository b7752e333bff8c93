"""A reader's side of the bucketed transfer: reading each of its buckets, own pieces straight into its params
where they can take the bytes, and naming the next buckets to storage ahead of time."""

from __future__ import annotations

import torch

from ..checkpoint import Reader
from ..plan import Bucket, LoadPlan, clip
from ..plan.shard import view2d
from .pieces import landing_region

# How many of its next buckets a reader asks storage for while it reads one (RangeReader.prefetch: only
# readers without kernel read-ahead, or with the prefetch strategy, act on it): a reader that reads exactly
# its rows has nothing else fetching ahead of it (BENCHMARKS.md).
PREFETCH_BUCKETS = 2


class BucketReads:
    """Reads this reader's buckets (`mine`, in transfer order) into read buffers laid out as the bucket."""

    def __init__(self, plan: LoadPlan, rank: int, params: dict[str, torch.Tensor], reader: Reader | None,
                 device: torch.device, mine: list[Bucket]):
        self.plan, self.rank, self.params, self.reader, self.device = plan, rank, params, reader, device
        self.mine = mine
        self._place = {b.index: i for i, b in enumerate(mine)}   # of each bucket in this reader's order
        # Decided before the read-ahead starts, so that its thread and the transfer's only read these.
        self._direct_reads = {(b.index, c): self._direct_candidates(b, c) for b in mine for c in b.chunks}

    def _direct_candidates(self, bucket: Bucket, chunk) -> list:
        """This reader's own pieces of a chunk that may be read from the file straight into its params: whole
        rows of the source (one byte range) that no other share needs from the read buffer, and that no
        replica of this reader takes (their fan-out is packed from the read buffer). Whether the param can
        take the bytes as they are (dtype, device, allocated yet) is checked when reading."""
        if self.device.type != "cpu" or (self.plan.layout.world > 1 and bucket.broadcast):
            return []  # params on a device / the whole read buffer goes on the wire
        src = self.plan.sources[chunk.source]
        clipped = [(d, clip(d.piece, chunk.rows)) for d in src.shares]
        clipped = [(d, p) for d, p in clipped if p is not None]
        out = []
        for d, piece in clipped:
            if self.rank not in d.ranks or d.ranks.count > 1 or piece.cols != (0, view2d(src.shape)[1]):
                continue
            if any(o is not d and o_p.rows[0] < piece.rows[1] and piece.rows[0] < o_p.rows[1] for o, o_p in clipped):
                continue
            out.append((d, piece))
        return out

    def fill(self, bucket: Bucket, buf: torch.Tensor) -> list:
        """Read one bucket (on the read-ahead thread, or inline): own pieces straight into params where they
        can take them, the rest into `buf` (same layout as the bucket). Returns the deliveries read straight
        into params."""
        # Storage fetches what comes next while this bucket is read and sent (the first fill names the first).
        i = self._place[bucket.index]
        upto = i + PREFETCH_BUCKETS + 1
        for later in self.mine[0 if i == 0 else upto - 1:upto]:
            self.prefetch(later)
        at, direct, reads = 0, [], []
        for chunk in bucket.chunks:
            src = self.plan.sources[chunk.source]
            start, n = src.offset + chunk.rows[0] * src.row_bytes, (chunk.rows[1] - chunk.rows[0]) * src.row_bytes
            ranges = []
            for d, piece in self._direct_reads[(bucket.index, chunk)]:
                region = landing_region(self.params, d.param, piece, src.dtype, torch.device("cpu"))
                if region is not None:
                    lo = (piece.rows[0] - chunk.rows[0]) * src.row_bytes
                    ranges.append((lo, lo + region.numel(), region))
                    direct.append(d)
            ranges.sort(key=lambda r: r[0])
            pos = 0
            for lo, hi, region in ranges + [(n, n, None)]:
                if lo > pos:  # bytes others need (or that need converting): into the read buffer, same layout
                    reads.append((src.file, start + pos, buf[at + pos:at + lo]))
                if region is not None:
                    reads.append((src.file, start + lo, region))
                pos = hi
            at += n
        self.reader.read_many(reads)   # in this order; object storage fetches them at once
        return direct

    def prefetch(self, bucket: Bucket) -> None:
        for chunk in bucket.chunks:
            src = self.plan.sources[chunk.source]
            self.reader.prefetch(src.file, src.offset + chunk.rows[0] * src.row_bytes,
                                 (chunk.rows[1] - chunk.rows[0]) * src.row_bytes)
