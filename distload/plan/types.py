"""The plan's value types: what one rank holds, what is read, what travels in which bucket.

Vocabulary: a *source* is a checkpoint tensor; a *param* is a target tensor in the serving layout; a
*share* is one rectangle of a source (2-D view) that every rank of a group (ranks.Ranks: the
data-parallel replicas of one shard) copies into one of its params, a *delivery* the same seen from one
member; a
*chunk* is a row range of a source (the unit of reading, so a huge embedding never needs a staging
buffer of its own size); a *bucket* is a run of chunks read by one reader and sent as one collective.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from ..dtypes import itemsize
from ..rules import ParamRule
from ..topology import Layout
from .ranks import Ranks
from .shard import Piece, view2d
from .source_shares import SourceShares, share_takers, takers_broadcast


@dataclass(frozen=True)
class ParamSpec:
    """One param as one rank holds it."""
    name: str
    style: str
    dtype: str                                   # safetensors dtype name
    global_shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    padding: tuple[tuple[int, int, int, int], ...] = ()   # zero regions of the local 2-D view
    alias_of: str | None = None                  # tied: same tensor object as that param
    experts: tuple[int, ...] = ()                # expert params: global expert id of each local slot

    @property
    def nbytes(self) -> int:
        return math.prod(self.local_shape) * itemsize(self.dtype)


@dataclass(frozen=True)
class Target:
    """One expanded param: its name and, per logical part, the source it comes from."""
    name: str
    rule: ParamRule
    sources: tuple[str, ...]            # distinct source names (fused: one)
    expert_sources: tuple[tuple[str, ...], ...] = ()   # style expert: per global expert, its sources


@dataclass(frozen=True)
class Step:
    """One post-load rewrite on one rank, run once every input has fully arrived (postprocess.py runs the op by
    its name: quant/'s ops, and plan/transpose.py's). Inputs that are not final params are released after it;
    outputs replace the params of the same name. Ops that need more say so in a subclass (quant/steps.py)."""
    op: str
    inputs: tuple[str, ...]            # staging params read (a weight first)
    outputs: tuple[str, ...]           # final params written (a weight first)

    @property
    def only_checks(self) -> bool:
        """A check_* op leaves its params as they landed: a save holding them holds the checkpoint's cut."""
        return self.op.startswith("check_")


@dataclass(frozen=True)
class Delivery:
    """One rank's piece of a source (a Share seen from one member)."""
    rank: int
    param: str
    piece: Piece


class Share(NamedTuple):
    """One rectangle of a source that every rank of a group copies into one of its params. (A tuple, as
    ranks.Ranks: planning makes one per group and piece of the whole job.)"""
    ranks: Ranks
    param: str
    piece: Piece


@dataclass(frozen=True)
class Source:
    """A checkpoint tensor that is read, and where its pieces go."""
    name: str
    file: str
    offset: int
    dtype: str
    shape: tuple[int, ...]
    shares: tuple[Share, ...]
    broadcast: bool                              # every rank receives the whole tensor
    # Read on every node that takes it, by that node's reader, for its own ranks only (a tied embedding that
    # the first and the last pipeline stage hold: no byte of it crosses between the stages' nodes).
    per_node: bool = False

    # Derived once: planning asks for these for every source, chunk and share; a Source never changes, and
    # these are not fields (equality, hashing and repr ignore them). Set eagerly: functools.cached_property's
    # first access takes a lock (Python 3.11) and costs more than the arithmetic.
    def __post_init__(self):
        rows, row_bytes, nbytes, isz = geometry(self.shape, self.dtype)
        # takers: per share (first row, end row, bytes per row, group) as plain values, which the chunk loops of
        # buckets.py and spans.py walk for every chunk and share of the whole checkpoint.
        takers = self.shares.takers if isinstance(self.shares, SourceShares) else share_takers(self.shares, isz)
        self.__dict__.update(rows=rows, row_bytes=row_bytes, nbytes=nbytes, takers=interned(takers))

    @classmethod
    def planned(cls, name: str, file: str, offset: int, dtype: str, shape: tuple, shares, broadcast: bool,
                per_node: bool, geometry: tuple, takers: tuple) -> "Source":
        """A Source with its derived values given (geometry: rows, row_bytes, nbytes; takers as __post_init__
        makes them, interned; a SourceShares' are one object per alike source already). Planning makes one per
        checkpoint tensor, where the frozen dataclass's field-by-field __init__ costs more than all the rest:
        the same object, its fields set at once."""
        rows, row_bytes, nbytes = geometry
        return made(cls, name=name, file=file, offset=offset, dtype=dtype, shape=shape, shares=shares,
                    broadcast=broadcast, per_node=per_node, rows=rows, row_bytes=row_bytes, nbytes=nbytes,
                    takers=takers)

    @property
    def deliveries(self) -> tuple[Delivery, ...]:
        """Every member's piece, one Delivery each: O(world), for tools and tests (planning uses shares)."""
        return tuple(Delivery(r, s.param, s.piece) for s in self.shares for r in s.ranks.members())


def geometry(shape, dtype: str) -> tuple[int, int, int, int]:
    """A source's (rows, bytes per row, bytes, itemsize) as its 2-D view."""
    rows, cols = view2d(tuple(shape))
    isz = itemsize(dtype)
    return rows, cols * isz, rows * cols * isz, isz


def made(cls, **fields):
    """A frozen dataclass's instance with its fields (and derived values) set at once: for the types planning
    makes one of per tensor or bucket of the job, where the field-by-field __init__ costs more than the rest."""
    self = object.__new__(cls)
    self.__dict__.update(fields)
    return self


@functools.lru_cache(maxsize=1 << 12)
def interned(takers: tuple) -> tuple:
    """One object per distinct takers tuple: sources with alike shares (one expert's projection, layer after
    layer) hold one copy, and lookups keyed by it compare by identity. (A layer's worth of patterns fits.)"""
    return takers


def shares_of(deliveries) -> tuple[Share, ...]:
    """Per-rank deliveries as shares of one rank each (plans whose ranks hold no replicas: sharded reloads)."""
    return tuple(Share(Ranks.one(d.rank), d.param, d.piece) for d in deliveries)


def is_broadcast(shares, shape: tuple[int, ...], world: int) -> bool:
    """Does every rank of `world` receive the whole tensor (each rank in exactly one share)?"""
    rows, cols = view2d(shape)
    return takers_broadcast(share_takers(shares, 1), rows, cols, world)   # widths in elements: one byte each


class Chunk(NamedTuple):
    """Rows [rows[0], rows[1]) of one source, read as one piece of a bucket (a tuple: one per chunk of the job)."""
    source: str
    rows: tuple[int, int]


@dataclass(frozen=True)
class Bucket:
    index: int
    reader: int
    broadcast: bool
    chunks: tuple[Chunk, ...]
    read_bytes: int
    groups: tuple[tuple[Ranks, int], ...]        # point to point: each group that takes bytes, and how many
    world: int

    @property
    def recv_bytes(self) -> "BucketBytes":
        """Per rank, the bytes it takes from this bucket (the reader's own share is copied locally)."""
        return BucketBytes(self)


class BucketBytes(Sequence):
    """A bucket's bytes per rank, looked up in its groups (never a list of world entries)."""

    def __init__(self, bucket: Bucket):
        self.bucket = bucket

    def __getitem__(self, rank: int) -> int:
        b = self.bucket
        if not 0 <= rank < b.world:
            raise IndexError(rank)
        return b.read_bytes if b.broadcast else sum(n for g, n in b.groups if rank in g)

    def __len__(self) -> int:
        return self.bucket.world


@dataclass(frozen=True)
class Item:
    """One clipped delivery inside a bucket, at `offset` of the wire buffer of its rank."""
    chunk: Chunk
    param: str
    piece: Piece                                 # rows already clipped to the chunk
    offset: int
    nbytes: int
    ranks: Ranks | None = None                   # the group that holds it (None: a broadcast bucket's)


@dataclass(frozen=True)
class LoadPlan:
    family: str
    layout: Layout
    specs: Sequence                              # per rank {param: ParamSpec} (ranks.RankSpecs)
    sources: dict[str, Source]
    buckets: tuple[Bucket, ...]
    missing: tuple[str, ...] = ()
    unexpected: tuple[str, ...] = ()
    ignored: tuple[str, ...] = ()                # dropped by rule or by a tie (e.g. rotary inv_freq)
    incomplete: tuple = ()                       # (param, sources present, sources missing): targets.Match's
    checkpoint_bytes: int = 0
    notes: tuple[str, ...] = field(default=(), compare=False)
    # Quantized loads (quant/): `specs` are the final params (what the caller gets and reconcile
    # checks); where post-load steps change them, `staging` holds what the transfer writes, per rank.
    staging: tuple[dict[str, ParamSpec], ...] = ()
    post: tuple[tuple, ...] = ()                 # per rank, the Steps run after their inputs arrive
    quantization: str | None = None              # e.g. 'fp8-block 128x128 (config.json ...)'; None: none
    digest: str = field(default="", compare=False)  # of the plan's inputs (digest.py): what ranks agree on
    # The rank whose block's part this is (build_plan's rank mode): the job-wide buckets and sources, and its
    # block's own; other blocks' own rows are absent. None: the whole job's plan.
    planned_for: int | None = field(default=None, compare=False)
    # Buckets numbered from here carry rows one block alone takes (spans.py's second phase): each reader reads
    # its job-wide buckets in file order, then its block-own ones in file order. None: every bucket is job-wide.
    block_own_from: int | None = None
    # Every checkpoint tensor some rank of the job receives (index entries: name, dtype, shape), other blocks' too:
    # what a sharded save's manifest lists as the original, which a rank's plan cannot take from its sources.
    received: tuple = field(default=(), compare=False, repr=False)

    def owned_bytes(self, rank: int) -> int:
        """Checkpoint bytes of the pieces delivered to `rank` (what it reads itself with owner reads)."""
        return sum((r1 - r0) * width for src in self.sources.values() for r0, r1, width, g in src.takers
                   if rank in g)

    def owned_pieces(self, rank: int) -> list:
        """(source, delivery) of every piece delivered to `rank`, in file order (file, then offset): the order
        in which a rank that copies its own pieces from the files reads them."""
        mine = [(src, Delivery(rank, s.param, s.piece)) for src in self.sources.values()
                if any(rank in t[3] for t in src.takers) for s in src.shares if rank in s.ranks]
        mine.sort(key=lambda sd: (sd[0].file, sd[0].offset + sd[1].piece.rows[0] * sd[0].row_bytes))
        return mine

    def bytes_from_other_nodes(self, rank: int) -> int:
        """Bytes `rank` receives from ranks on other nodes (a reader, or its group's leader fanning out to
        replicas): what crosses the network to it."""
        node = self.layout.node
        total = 0
        for b in self.buckets:
            if b.broadcast:
                total += b.read_bytes if node(b.reader) != node(rank) else 0
                continue
            for item in self.items(b, rank):
                leader = item.ranks.nearest(b.reader)
                sender = b.reader if leader == rank else leader
                total += item.nbytes if node(sender) != node(rank) else 0
        return total

    def staging_specs(self, rank: int) -> dict[str, ParamSpec]:
        """What the transfer writes on `rank` (the final specs unless a post-load step rewrites params)."""
        return self.staging[rank] if self.staging else self.specs[rank]

    def items(self, bucket: Bucket, rank: int) -> list[Item]:
        """What `rank` receives from `bucket`, in wire order (identical computation on every rank)."""
        if not bucket.broadcast and not any(rank in g for g, _ in bucket.groups):
            return []   # asked for every bucket by every rank: only a bucket's takers look at its shares
        out, offset = [], 0
        for chunk in bucket.chunks:
            src = self.sources[chunk.source]
            for d in src.shares:
                if rank not in d.ranks or (src.per_node and not self.layout.same_node(rank, bucket.reader)):
                    continue
                piece = clip(d.piece, chunk.rows)
                if piece is None:
                    continue
                if bucket.broadcast:
                    # The broadcast buffer is the chunks' raw bytes; the item points into it.
                    nbytes = (chunk.rows[1] - chunk.rows[0]) * src.row_bytes
                    out.append(Item(chunk, d.param, piece, broadcast_offset(self, bucket, chunk), nbytes, d.ranks))
                    continue
                nbytes = piece.numel * itemsize(src.dtype)
                out.append(Item(chunk, d.param, piece, offset, nbytes, d.ranks))
                offset += nbytes
        return out


def clip(piece: Piece, rows: tuple[int, int]) -> Piece | None:
    """The part of `piece` inside source rows [rows[0], rows[1]), or None when they do not meet."""
    a, b = max(piece.rows[0], rows[0]), min(piece.rows[1], rows[1])
    if a >= b:
        return None
    return Piece(piece.source, (a, b), piece.cols, piece.dst_row + a - piece.rows[0], piece.dst_col)


def broadcast_offset(plan: LoadPlan, bucket: Bucket, chunk: Chunk) -> int:
    """Where `chunk` starts in a broadcast bucket's buffer (the chunks' raw bytes, in order)."""
    offset = 0
    for c in bucket.chunks:
        if c == chunk:
            return offset
        offset += (c.rows[1] - c.rows[0]) * plan.sources[c.source].row_bytes
    raise KeyError(chunk)
