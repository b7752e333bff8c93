"""Buckets: each reader's spans cut into chunks that fit one staging buffer, grouped into collectives.

A bucket is what one reader reads into one staging slot and sends as one collective: its chunks are
all broadcast (every rank takes the whole tensor) or all point-to-point. Buckets are sized by the bytes
read, and by the bytes the reader sends: each group of ranks holding one shard counts once (its member
nearest the reader takes the bytes and fans them out to the replicas), so the number of buckets, and a
bucket's bytes, do not change with the number of replicas. Readers' buckets are interleaved so every
reader has work in flight.
"""

from __future__ import annotations

import itertools

from ..dtypes import itemsize
from .spans import Span
from .types import Bucket, Chunk

# One bucket's staging slot (a rank holds a few: see transfer/). Larger buckets mean fewer messages and
# more peak memory per rank; BENCHMARKS.md gives the measured trade-off.
DEFAULT_STAGING_BYTES = 16 << 20


def _takers(s, reader: int, same_node) -> list[tuple]:
    """Per share of a point-to-point source: its rows, its bytes per row, its group, whether it leaves the
    reader (plain numbers: the chunk loop runs once per chunk and share of the whole checkpoint). A per-node
    source's reader serves only its own node's groups (their shares are split by node)."""
    isz = itemsize(s.dtype)
    return [(d.piece.rows[0], d.piece.rows[1], (d.piece.cols[1] - d.piece.cols[0]) * isz, d.ranks,
             reader not in d.ranks) for d in s.shares if not s.per_node or same_node(d.ranks.first, reader)]


def _sent_per_row(s, takers: list[tuple]) -> int:
    """Bytes per source row its groups take (each group once, whatever its number of replicas): at least what
    the reader sends of any row, since pieces of one source split its rows evenly."""
    sent = sum((r1 - r0) * width for r0, r1, width, _, _ in takers)
    return -(-sent // max(1, s.rows))


def buckets_for(reader: int, spans: list[Span], world: int, staging_bytes: int, same_node=None) -> list[tuple]:
    """Chunk and bucket one reader's spans (source, rows); returns (broadcast, chunks, read_bytes, groups)."""
    out = []
    cur, cur_read, cur_send, cur_bcast, cur_groups = [], 0, 0, None, {}

    def flush():
        nonlocal cur, cur_read, cur_send, cur_groups
        if cur:
            out.append((cur_bcast, tuple(cur), cur_read, tuple(cur_groups.items())))
        cur, cur_read, cur_send, cur_groups = [], 0, 0, {}

    for s, (first, end) in spans:
        # A chunk must fit the staging buffer both as read and as sent: replicated pieces (kv heads when
        # tp > kv heads) make a row's sent bytes a multiple of its read bytes.
        bcast, row_bytes, name = s.broadcast, s.row_bytes, s.name
        takers = [] if bcast else _takers(s, reader, same_node)
        per_row = max(row_bytes, _sent_per_row(s, takers), 1)
        per_chunk = max(1, staging_bytes // per_row)
        for a in range(first, max(end, first + 1), per_chunk):
            b = min(a + per_chunk, end)
            read = (b - a) * row_bytes
            taken = [(ranks, (min(r1, b) - max(r0, a)) * width, away) for r0, r1, width, ranks, away in takers
                     if max(r0, a) < min(r1, b)]
            send = sum(n for _, n, away in taken if away)
            if cur and (cur_bcast != bcast or cur_read + read > staging_bytes
                        or (not bcast and cur_send + send > staging_bytes)):
                flush()
            cur_bcast = bcast
            cur.append(Chunk(name, (a, b)))
            cur_read += read
            cur_send += send
            for g, n, _ in taken:
                cur_groups[g] = cur_groups.get(g, 0) + n
    flush()
    return out


def _group_key(group_bytes) -> tuple[int, int, int]:
    g = group_bytes[0]
    return g.first, g.step, g.count


def interleaved(per_reader: dict[int, list[tuple]], readers, world: int) -> tuple[Bucket, ...]:
    """Number the readers' buckets, taking one from each reader in turn, so that every reader has work in
    flight at the same time."""
    buckets = []
    for group in itertools.zip_longest(*(per_reader[r] for r in readers)):
        for reader, b in zip(readers, group):
            if b is not None:
                bcast, chunks, read, groups = b
                buckets.append(Bucket(len(buckets), reader, bcast, chunks, read, tuple(sorted(groups, key=_group_key)), world))
    return tuple(buckets)
