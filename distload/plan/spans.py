"""Reader spans: which rows of which sources each reader reads, in file order, about equal bytes each.

On one node (or with readers on one node only) sources are split into contiguous runs at tensor
boundaries, so each reader's reads stay sequential inside a file. With readers on several nodes, rows
that only one node's ranks take are read by a reader of that node, so they never cross between nodes
(column-parallel and vocab rows, a node's experts); rows some but not all nodes take (an expert group
over two nodes) are read by the least loaded of those nodes; rows every node takes (row-parallel
tensors, replicated ones) are spread over the nodes to even out the bytes each node reads. Every byte is still
read once by the job, except a source marked per_node (a tied embedding several pipeline stages hold), which
each node that takes it reads for its own ranks.

Two phases. Rows that only one block's ranks take (a block: a node, or the nodes an expert group spans), each
rank alone (no replica to fan out to), are the block's own business: read on the node that takes them (or
the least loaded of the block's nodes that do) after the job-wide rows, as buckets only the block's ranks
plan. build.py's rank mode skips the sources other blocks own (`away`, an Elsewhere keeping their bytes for
the quotas), so a rank's planning grows with its block's experts and shards, not with the job. Every other
row is job-wide: every rank plans it, since where it is read depends on all nodes' bytes.
"""

from __future__ import annotations

import operator
from typing import NamedTuple

from ..topology import Layout
from .types import Source

_COUNT = operator.itemgetter(2)   # of a ranks.Ranks (first, step, count)

Span = tuple  # (Source, (first row, end row)): rows of one source that one reader reads


def span_bytes(span: Span) -> int:
    src, (a, b) = span
    return (b - a) * src.row_bytes


def byte_runs(spans: list[Span], readers: tuple[int, ...], quotas: list[float]) -> dict[int, list[Span]]:
    """Split file-ordered spans into contiguous runs at span boundaries, reader i taking about quotas[i] bytes
    (see _Cursor)."""
    runs = {r: [] for r in readers}
    if len(readers) == 1:
        runs[readers[0]].extend(spans)
        return runs
    place = _Cursor(readers, quotas, cut=False).place
    for src, (a, b) in spans:
        place(src, a, b, runs)
    return runs


class _Cursor:
    """Where the next file-ordered bytes go: reader i takes about quotas[i] bytes, then the next reader.

    Contiguous runs keep each reader's reads sequential inside a file; a big file is split at a span boundary
    when that balances better. cut (between nodes): a span that would overshoot a node's quota by more than a
    sixteenth of it is cut at a row, since one embedding or vocab shard can outweigh a node's share at a
    thousand nodes, and the job waits for its slowest reader."""

    def __init__(self, readers: tuple[int, ...], quotas: list[float], cut: bool):
        self.readers, self.quotas, self.cut = readers, quotas, cut
        self.i, self.acc, self.upto, self.last = 0, 0, quotas[0] if quotas else 0, len(readers) - 1

    def place(self, src: Source, a: int, b: int, runs: dict) -> None:
        """Rows [a, b) of src onto runs[reader] (cut in pieces where quotas end, when cutting)."""
        row_bytes, quotas, last = src.row_bytes, self.quotas, self.last
        i, acc, upto = self.i, self.acc, self.upto
        while True:
            while i < last and acc >= upto:
                i += 1
                upto += quotas[i]
            room = upto - acc
            if not self.cut or i == last or (b - a) * row_bytes - room <= quotas[i] / 16:
                break
            at = a + max(1, -(-int(room) // row_bytes))   # rows that fill reader i's quota
            if at >= b:
                break
            runs[self.readers[i]].append((src, (a, at)))
            acc += (at - a) * row_bytes
            a = at
        runs[self.readers[i]].append((src, (a, b)))
        self.i, self.acc, self.upto = i, acc + (b - a) * row_bytes, upto


class Elsewhere(NamedTuple):
    """A source that other blocks alone take and read, in place of its Source in a rank's plan: per row segment,
    the nodes that take it and its bytes (what the job-wide quotas and the few-nodes choices count). fixed: each
    segment one node's, so its bytes go to that node whatever was read before (see merged_run)."""
    segments: tuple[tuple[frozenset, int], ...]
    nbytes: int
    fixed: bool = False


def merged_run(run) -> Elsewhere:
    """One Elsewhere for a run of fixed ones, (Elsewhere, times) each, with no source planned between them: their
    bytes add to the same nodes in any order, and reader_spans counts one entry, not one per expert tensor."""
    per_nodes: dict[frozenset, int] = {}
    for gone, times in run:
        for nodes, nbytes in gone.segments:
            per_nodes[nodes] = per_nodes.get(nodes, 0) + times * nbytes
    return Elsewhere(tuple(per_nodes.items()), sum(gone.nbytes * times for gone, times in run), True)


def block_nodes(layout: Layout) -> int:
    """Nodes per block: one node, or the nodes an expert group spans (consecutive from node 0), so that an
    expert's rows are its group's own. Rows that only one block's ranks take, each alone, are the block's own
    (the module docstring); any partition is correct, this one keeps the most rows out of other blocks' plans."""
    span = layout.expert_group_size if layout.ep > 1 else 1
    return max(1, -(-span // layout.local_world)) if layout.local_world else 1


def node_segments(takers: tuple, rows: int, local_world: int) -> list[tuple[int, int, frozenset]]:
    """A source's rows (`rows` of them, taken by `takers`: Source.takers) cut where the set of nodes taking them
    changes: (first row, end row, nodes). A group of replicas on several nodes counts as its first and last
    member's nodes (all that matters is whether one node alone takes the rows, and which few nodes do: MANY
    marks groups over more nodes). `local_world`: ranks per node (torchrun numbers ranks node by node)."""
    if not takers:
        return [(0, rows, frozenset())]
    lw = local_world or (1 << 62)   # 0: one node (topology.Layout.node)
    # Nodes grow with ranks, so one node holds every first and last member iff it holds the lowest and highest.
    groups = [t[3] for t in takers]
    low = min(groups)[0] // lw
    if max(groups, key=_COUNT)[2] == 1:   # groups of one rank each (experts, say): their last is their first
        high = max(groups)[0] // lw
    else:
        high = max(g.last for g in groups) // lw
    if low == high:  # an expert on its host node, say
        return [(0, rows, frozenset((low,)))]
    cuts = sorted({0, rows} | {r for r0, r1, _, _ in takers for r in (r0, r1) if 0 < r < rows})
    starts = sorted((r0, r1, n) for r0, r1, _, g in takers for n in _nodes_named(g.first // lw, g.last // lw))
    segments, active, k = [], [], 0
    for a, b in zip(cuts, cuts[1:]):
        while k < len(starts) and starts[k][0] <= a:
            active.append(starts[k])
            k += 1
        active = [x for x in active if x[1] > a]
        nodes = frozenset(node for _, _, node in active)
        if segments and segments[-1][2] == nodes:
            segments[-1] = (segments[-1][0], b, nodes)
        else:
            segments.append((a, b, nodes))
    return segments or [(0, rows, frozenset())]


def unreplicated(takers: tuple) -> bool:
    """Does each rank that takes rows of the source take them alone (no group of replicas to fan out to)?"""
    return max((t[3] for t in takers), key=_COUNT)[2] == 1 if takers else False


def away(takers: tuple, rows: int, row_bytes: int, local_world: int, reader_nodes, per_block: int, home: int):
    """Elsewhere, when every row segment of the source is some block's own (see the module docstring) and none
    is block `home`'s: a rank of that block plans nothing of it. None: it plans the source."""
    if not unreplicated(takers):
        return None
    segments = []
    for a, b, nodes in node_segments(takers, rows, local_world):
        block = _own_block(nodes, reader_nodes, per_block)
        if block is None or block == home:
            return None
        segments.append((nodes, (b - a) * row_bytes))
    return Elsewhere(tuple(segments), rows * row_bytes, all(len(nodes) == 1 for nodes, _ in segments))


def _own_block(nodes: frozenset, reader_nodes, per_block: int) -> int | None:
    """The block whose own rows these are (nodes of one block, each with a reader), or None."""
    if not nodes or MANY in nodes or not nodes <= reader_nodes:
        return None
    block = min(nodes) // per_block
    return block if max(nodes) // per_block == block else None


SHARED = None   # a segment many nodes take (or a node without a reader): spread over all nodes by quota
MANY = -1   # in a segment's nodes: a group whose members span more than two nodes (its nodes are not listed)


def _nodes_named(first: int, last: int) -> tuple:
    """A group's nodes as a segment names them: its first and last member's, and MANY when others lie between."""
    return (first, last) if last - first <= 1 else (first, last, MANY)


def reader_spans(sources: list, layout: Layout) -> tuple[dict[int, list[Span]], dict[int, list[Span]]]:
    """Per reader, the job-wide spans it reads and its block's own (see the module docstring); `sources` are in
    file order, Sources or (a rank's plan) Elsewhere for the sources other blocks alone take."""
    readers = layout.readers
    total = sum(s.nbytes for s in sources)
    if not layout.reads_by_node:
        return byte_runs([(s, (0, s.rows)) for s in sources], readers, [total / len(readers)] * len(readers)), {}
    by_node = layout.readers_by_node()
    nodes, per_block = tuple(by_node), block_nodes(layout)
    home_bytes = dict.fromkeys(by_node, 0)
    reading = home_bytes.keys()
    own: dict[int, list[Span]] = {n: [] for n in nodes}

    def least_loaded(takers):   # of a few nodes that take rows: its share of them never crosses the network
        return min(sorted(takers), key=lambda n: home_bytes[n] / len(by_node[n]))

    def block_reader(takers):   # the node that reads a block's own rows: one Source and its Elsewhere alike
        return next(iter(takers)) if len(takers) == 1 else least_loaded(takers)
    # First pass: where each segment goes (a node, several for a per-node source, or SHARED) and each node's
    # own bytes; the second places shared rows by the quotas those leave, so every list comes out in file order.
    routed: list[tuple] = []
    segmented: dict[tuple, tuple] = {}   # sources with alike shares (an expert's, layer after layer) cut alike
    for s in sources:
        if type(s) is Elsewhere:   # as a Source with these segments would count (below)
            for takers, nbytes in s.segments:
                home_bytes[block_reader(takers)] += nbytes
            continue
        key = (id(s.takers), s.rows)   # interned, and kept alive by the sources
        known = segmented.get(key)
        if known is None:
            known = segmented[key] = (node_segments(s.takers, s.rows, layout.local_world),
                                      unreplicated(s.takers))
        segments, alone = known
        for a, b, takers in segments:
            if s.per_node:   # each taking node's reader reads these rows for its own ranks
                for n in takers:
                    home_bytes[n] += (b - a) * s.row_bytes
                routed.append((s, a, b, tuple(sorted(takers))))
                continue
            if alone and _own_block(takers, reading, per_block) is not None:   # a block's own: its second phase
                only = block_reader(takers)
                home_bytes[only] += (b - a) * s.row_bytes
                own[only].append((s, (a, b)))
                continue
            if len(takers) == 1:
                only = next(iter(takers))
            elif 1 < len(takers) < len(nodes) and takers <= reading:
                # Rows a few nodes take (an expert group across two nodes, a row-parallel expert projection):
                # read on the least loaded of them per reader, so that node's share never crosses the network.
                only = least_loaded(takers)
            else:
                only = None
            if only in home_bytes:
                home_bytes[only] += (b - a) * s.row_bytes
                routed.append((s, a, b, only))
            else:
                routed.append((s, a, b, SHARED))
    # Each node reads its share (in proportion to its readers): its own rows, topped up with shared ones.
    quota = [max(0.0, total * len(by_node[n]) / len(readers) - home_bytes[n]) for n in nodes]
    spread = _Cursor(nodes, quota if sum(quota) else [1.0] * len(nodes), cut=True).place
    per_node: dict[int, list[Span]] = {n: [] for n in nodes}
    for s, a, b, dest in routed:
        if dest is SHARED:
            spread(s, a, b, per_node)
        elif type(dest) is int:
            per_node[dest].append((s, (a, b)))
        else:
            for n in dest:
                per_node[n].append((s, (a, b)))
    job_wide, block_own = {}, {}
    for n in nodes:
        job_wide.update(_evenly(merged(per_node[n]), by_node[n]))
        block_own.update(_evenly(merged(own[n]), by_node[n]))
    return job_wide, block_own


def _evenly(spans: list[Span], readers: tuple[int, ...]) -> dict[int, list[Span]]:
    """One node's spans over its readers, about equal bytes each."""
    share = sum(map(span_bytes, spans)) / len(readers) if len(readers) > 1 else 0.0
    return byte_runs(spans, readers, [share] * len(readers))


def merged(spans: list[Span]) -> list[Span]:
    """Adjacent row ranges of one source as one span (fewer, larger chunks)."""
    out = []
    for src, (a, b) in spans:
        if out and out[-1][0] is src and out[-1][1][1] == a:
            out[-1] = (src, (out[-1][1][0], b))
        else:
            out.append((src, (a, b)))
    return out
