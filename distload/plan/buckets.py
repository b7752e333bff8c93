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

from .spans import Span
from .types import Bucket, Chunk, made

# One bucket's staging slot (a rank holds a few: see transfer/). Larger buckets mean fewer messages and
# more peak memory per rank; BENCHMARKS.md gives the measured trade-off.
DEFAULT_STAGING_BYTES = 16 << 20


def _sent_per_row(s, takers: tuple) -> int:
    """Bytes per source row its groups take (each group once, whatever its number of replicas): at least what
    the reader sends of any row, since pieces of one source split its rows evenly."""
    sent = sum([(r1 - r0) * width for r0, r1, width, _ in takers])
    return -(-sent // max(1, s.rows))


def buckets_for(reader: int, spans: list[Span], world: int, staging_bytes: int, same_node=None) -> list[tuple]:
    """Chunk and bucket one reader's spans (source, rows); returns (broadcast, chunks, read_bytes, groups), the
    groups (group, bytes) in rank order. A per-node source's reader serves only its own node's groups (their
    shares are split by node: pipeline.split_by_node)."""
    out = []
    cur, cur_read, cur_send, cur_bcast, cur_groups = [], 0, 0, None, []
    # Sources whose shares look alike (one expert's projections in every layer, say) chunk alike: each
    # distinct (shares, rows, span) is chunked once per reader.
    chunked: dict[tuple, list[tuple]] = {}
    summed: dict[tuple, tuple] = {}   # per run of chunks' group tuples (alive in `chunked`): their sum
    for s, (first, end) in spans:
        bcast, row_bytes, name = s.broadcast, s.row_bytes, s.name
        takers = () if bcast else s.takers
        if s.per_node:
            takers = tuple(t for t in takers if same_node(t[3].first, reader))
        # Interned takers (types.Source) are kept alive by their sources: their ids key the memo, unhashed.
        key = (takers if s.per_node else id(takers), s.rows, row_bytes, first, end)
        chunks = chunked.get(key)
        if chunks is None:
            chunks = chunked[key] = _chunks(s, takers, first, end, staging_bytes, reader)
        for a, b, read, send, groups in chunks:
            if cur and (cur_bcast != bcast or cur_read + read > staging_bytes
                        or (not bcast and cur_send + send > staging_bytes)):
                out.append((cur_bcast, tuple(cur), cur_read, _summed_once(summed, cur_groups)))
                cur, cur_read, cur_send, cur_groups = [], 0, 0, []
            cur_bcast = bcast
            cur.append(Chunk(name, (a, b)))
            cur_read += read
            cur_send += send
            cur_groups.append(groups)
    if cur:
        out.append((cur_bcast, tuple(cur), cur_read, _summed_once(summed, cur_groups)))
    return out


def _summed_once(memo: dict, per_chunk: list[tuple]) -> tuple:
    if len(per_chunk) == 1:   # a bucket of one chunk (the common case): its groups as they are
        return per_chunk[0]
    key = tuple(map(id, per_chunk))
    known = memo.get(key)
    if known is None:
        known = memo[key] = _summed(per_chunk)
    return known


def _summed(per_chunk: list[tuple]) -> tuple:
    """The chunks' (group, bytes) added up per group, in rank order; one chunk's as they are (a bucket of one
    chunk, the common case, then shares its tuple with every chunk alike)."""
    if len(per_chunk) == 1:
        return per_chunk[0]
    groups = [g for g, _ in per_chunk[0]]
    if all([g for g, _ in chunk] == groups for chunk in per_chunk[1:]):  # the same groups (a weight and its scale)
        return tuple(zip(groups, map(sum, zip(*([n for _, n in chunk] for chunk in per_chunk)))))
    return _per_group([pair for chunk in per_chunk for pair in chunk])


def _chunks(s, takers: tuple, first: int, end: int, staging_bytes: int, reader: int) -> list[tuple]:
    """Rows [first, end) of `s` as chunks: (first row, end row, bytes read, bytes the reader sends, per group
    its bytes)."""
    # A chunk must fit the staging buffer both as read and as sent: replicated pieces (kv heads when
    # tp > kv heads) make a row's sent bytes a multiple of its read bytes.
    row_bytes = s.row_bytes
    per_chunk = max(1, staging_bytes // max(row_bytes, _sent_per_row(s, takers) if takers else 0, 1))
    out = []
    for a in range(first, max(end, first + 1), per_chunk):
        b = min(a + per_chunk, end)
        # Per share its bytes in rows [a, b) (plain comparisons: this runs per chunk and share of the job).
        taken = [(g, (hi - lo) * width) for r0, r1, width, g in takers
                 for lo, hi in (((r0 if r0 > a else a), (r1 if r1 < b else b)),) if lo < hi]
        # The reader's own bytes stay local; `reader in group` spelled out (a group is (first, step, count)):
        # every reader asks it of every group of every pattern it reads.
        send = sum([n for (f, step, count), n in taken
                    if (reader - f) % step or not 0 <= (reader - f) // step < count])
        out.append((a, b, (b - a) * row_bytes, send, _per_group(taken)))
    return out


def _per_group(taken: list[tuple]) -> tuple:
    """(group, bytes) pairs added up per group, in rank order (Ranks sort as their (first, step, count))."""
    groups = dict(taken)
    if len(groups) != len(taken):  # a group twice in the chunk: add up its bytes
        groups = {}
        for g, n in taken:
            groups[g] = groups.get(g, 0) + n
    return tuple(sorted(groups.items()))


def interleaved(per_reader: dict[int, list[tuple]], readers, world: int, block_own: dict | None = None
                ) -> tuple[Bucket, ...]:
    """Number the readers' buckets (buckets_for's), taking one from each reader in turn, so that every reader
    has work in flight at the same time. block_own: per reader, the buckets of its block's own rows (spans.py's
    second phase), after all the others: the k-th of the reader at position p is number first + k x readers + p,
    which every rank agrees on without planning other blocks' own buckets (a rank's plan has its block's only)."""
    buckets = []
    for group in itertools.zip_longest(*(per_reader[r] for r in readers)):
        for reader, b in zip(readers, group):
            if b is not None:
                buckets.append(_bucket(len(buckets), reader, b, world))
    if block_own:
        first, n = len(buckets), len(readers)
        numbered = sorted((first + k * n + p, reader) for p, reader in enumerate(readers)
                          for k in range(len(block_own.get(reader, ()))))
        buckets += [_bucket(i, reader, block_own[reader][(i - first) // n], world) for i, reader in numbered]
    return tuple(buckets)


def _bucket(index: int, reader: int, planned: tuple, world: int) -> Bucket:
    bcast, chunks, read, groups = planned
    return made(Bucket, index=index, reader=reader, broadcast=bcast, chunks=chunks, read_bytes=read, groups=groups,
                world=world)


TAIL_BUCKETS = 2


def transfer_order(plan) -> tuple[Bucket, ...]:
    """The order in which a rank posts its plan's buckets: the job-wide ones in index order (the same on every rank
    of the job), each reader's block-own ones (spans.py's second phase) spread among that reader's job-wide ones
    in proportion to their bytes. Job-wide rows are what crosses between nodes; read first and alone they made a
    node's link the slower side at the start of a load and idle after it (BENCHMARKS.md, "Cluster"), spread out
    they cross while the reader streams its own rows. Only the block's ranks take its own buckets and they all
    plan the same part of the job, so they agree on this order; every other rank still sees the job-wide ones in
    index order."""
    first = plan.block_own_from
    if first is None or first >= len(plan.buckets):
        return plan.buckets
    job_wide, own = plan.buckets[:first], plan.buckets[first:]
    pending: dict[int, list[Bucket]] = {}
    for b in own:
        pending.setdefault(b.reader, []).append(b)
    wide_bytes = dict.fromkeys(pending, 0)
    for b in job_wide:
        if b.reader in wide_bytes:
            wide_bytes[b.reader] += b.read_bytes
    # Spread all but the last TAIL_BUCKETS: those follow the job-wide ones, so storage is still busy while the
    # last crossing bytes drain from the links.
    own_bytes = {r: sum(b.read_bytes for b in bs[:-TAIL_BUCKETS]) for r, bs in pending.items()}
    taken = {r: [0, 0] for r in pending}   # per reader: own buckets placed, their bytes
    wide_done = dict.fromkeys(pending, 0)
    out = []

    def place(reader: int, progress: float) -> None:   # its own buckets due by `progress` of its job-wide bytes
        queue, at = pending[reader], taken[reader]
        while at[0] < len(queue) - TAIL_BUCKETS and at[1] <= progress * own_bytes[reader]:
            out.append(queue[at[0]])
            at[1] += queue[at[0]].read_bytes
            at[0] += 1

    alone = [r for r in pending if not wide_bytes[r]]   # readers with no job-wide bytes: by the job-wide count
    for i, b in enumerate(job_wide):
        if b.reader in pending:
            place(b.reader, wide_done[b.reader] / wide_bytes[b.reader])
            wide_done[b.reader] += b.read_bytes
        for r in alone:
            place(r, i / len(job_wide))
        out.append(b)
    for reader, queue in pending.items():   # what is left: after the job-wide ones, in index order
        queue[:taken[reader][0]] = []
    out += sorted((b for queue in pending.values() for b in queue), key=lambda b: b.index)
    return tuple(out)
