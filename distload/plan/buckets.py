"""Buckets: each reader's spans cut into chunks that fit one staging buffer, grouped into collectives.

A bucket is what one reader reads into one staging slot and sends as one collective: its chunks are
all broadcast (every rank takes the whole tensor) or all point-to-point, and both the bytes read and
the bytes sent fit the staging size. Readers' buckets are interleaved so every reader has work in flight.
"""

from __future__ import annotations

import itertools

from ..dtypes import itemsize
from .spans import Span
from .types import Bucket, Chunk, clip

# One bucket's staging slot (a rank holds a few: see transfer/). Larger buckets mean fewer messages and
# more peak memory per rank; BENCHMARKS.md gives the measured trade-off.
DEFAULT_STAGING_BYTES = 16 << 20


def buckets_for(reader: int, spans: list[Span], world: int, staging_bytes: int) -> list[tuple]:
    """Chunk and bucket one reader's spans (source, rows); returns (broadcast, chunks, read_bytes, recv_bytes)."""
    out = []
    cur, cur_read, cur_send, cur_bcast, cur_recv = [], 0, 0, None, [0] * world

    def flush():
        nonlocal cur, cur_read, cur_send, cur_recv
        if cur:
            out.append((cur_bcast, tuple(cur), cur_read, tuple(cur_recv)))
        cur, cur_read, cur_send, cur_recv = [], 0, 0, [0] * world

    for s, (first, end) in spans:
        # A chunk must fit the staging buffer both as read and as sent: replicated pieces (kv heads when
        # tp > kv heads) make a row's sent bytes a multiple of its read bytes.
        sent = 0 if s.broadcast else sum(d.piece.numel for d in s.deliveries) * itemsize(s.dtype)
        per_row = max(s.row_bytes, -(-sent // max(1, s.rows)), 1)
        per_chunk = max(1, staging_bytes // per_row)
        for a in range(first, max(end, first + 1), per_chunk):
            chunk = Chunk(s.name, (a, min(a + per_chunk, end)))
            read = (chunk.rows[1] - chunk.rows[0]) * s.row_bytes
            recv = [0] * world
            for d in s.deliveries:
                piece = clip(d.piece, chunk.rows)
                if piece is not None:
                    recv[d.rank] += read if s.broadcast else piece.numel * itemsize(s.dtype)
            send = sum(recv) - recv[reader]
            if cur and (cur_bcast != s.broadcast or cur_read + read > staging_bytes
                        or (not s.broadcast and cur_send + send > staging_bytes)):
                flush()
            cur_bcast = s.broadcast
            cur.append(chunk)
            cur_read += read
            cur_send += send
            cur_recv = [x + y for x, y in zip(cur_recv, recv)]
    flush()
    return out


def interleaved(per_reader: dict[int, list[tuple]], readers) -> tuple[Bucket, ...]:
    """Number the readers' buckets, taking one from each reader in turn, so that every reader has work in
    flight at the same time."""
    buckets = []
    for group in itertools.zip_longest(*(per_reader[r] for r in readers)):
        for reader, b in zip(readers, group):
            if b is not None:
                bcast, chunks, read, recv = b
                buckets.append(Bucket(len(buckets), reader, bcast, chunks, read, recv))
    return tuple(buckets)
