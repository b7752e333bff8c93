"""Reader spans: which rows of which sources each reader reads, in file order, about equal bytes each.

On one node (or with readers on one node only) sources are split into contiguous runs at tensor
boundaries, so each reader's reads stay sequential inside a file. With readers on several nodes, rows
that only one node's ranks take are read by a reader of that node, so they never cross between nodes
(column-parallel and vocab rows, a node's experts); rows several nodes take (row-parallel tensors,
replicated ones) are spread over the nodes to even out the bytes each node reads. Every byte is still
read once by the job, except a source marked per_node (a tied embedding several pipeline stages hold), which
each node that takes it reads for its own ranks.
"""

from __future__ import annotations

from ..topology import Layout
from .types import Source

Span = tuple  # (Source, (first row, end row)): rows of one source that one reader reads


def span_bytes(span: Span) -> int:
    src, (a, b) = span
    return (b - a) * src.row_bytes


def byte_runs(spans: list[Span], readers: tuple[int, ...], quotas: list[float]) -> dict[int, list[Span]]:
    """Split file-ordered spans into contiguous runs, reader i taking about quotas[i] bytes.

    Contiguous runs keep each reader's reads sequential inside a file; a big file is split at a span
    boundary when that balances better.
    """
    runs = {r: [] for r in readers}
    i, acc, upto = 0, 0, quotas[0] if quotas else 0
    for span in spans:
        while i < len(readers) - 1 and acc >= upto:
            i += 1
            upto += quotas[i]
        runs[readers[i]].append(span)
        acc += span_bytes(span)
    return runs


def node_segments(src: Source, node_of) -> list[tuple[int, int, frozenset]]:
    """The source's rows cut where the set of nodes taking them changes: (first row, end row, nodes). A group
    of replicas on several nodes counts as its first and last member's nodes (all that matters is whether
    one node alone takes the rows)."""
    ends = {node_of(r) for d in src.shares for r in (d.ranks.first, d.ranks.last)}
    if len(ends) == 1:  # one node takes every row (an expert on its host node, say)
        return [(0, src.rows, frozenset(ends))]
    cuts = sorted({0, src.rows} | {r for d in src.shares for r in d.piece.rows if 0 < r < src.rows})
    starts = sorted((d.piece.rows[0], d.piece.rows[1], n) for d in src.shares
                    for n in {node_of(d.ranks.first), node_of(d.ranks.last)})
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
    return segments or [(0, src.rows, frozenset())]


def reader_spans(sources: list[Source], layout: Layout) -> dict[int, list[Span]]:
    """Per reader, the spans it reads (see the module docstring); `sources` are in file order."""
    readers = layout.readers
    whole = [(s, (0, s.rows)) for s in sources]
    total = sum(span_bytes(x) for x in whole)
    if not layout.reads_by_node:
        return byte_runs(whole, readers, [total / len(readers)] * len(readers))
    nodes = layout.reader_nodes
    by_node = {n: layout.readers_on(n) for n in nodes}
    home: dict[int, list[Span]] = {n: [] for n in by_node}
    shared: list[Span] = []
    for s in sources:
        for a, b, takers in node_segments(s, layout.node):
            if s.per_node:   # each taking node's reader reads these rows for its own ranks
                for n in takers:
                    home[n].append((s, (a, b)))
                continue
            only = next(iter(takers)) if len(takers) == 1 else None
            (home[only] if only in home else shared).append((s, (a, b)))
    # Each node reads its share (in proportion to its readers): its own rows, topped up with shared ones.
    quota = [max(0.0, total * len(by_node[n]) / len(readers) - sum(span_bytes(x) for x in home[n])) for n in nodes]
    extra = byte_runs(shared, nodes, quota if sum(quota) else [1.0] * len(nodes))
    order = {s.name: i for i, s in enumerate(sources)}
    out = {}
    for n in nodes:
        spans = merged(sorted(home[n] + extra[n], key=lambda x: (order[x[0].name], x[1])))
        share = sum(span_bytes(x) for x in spans) / len(by_node[n])
        out.update(byte_runs(spans, by_node[n], [share] * len(by_node[n])))
    return out


def merged(spans: list[Span]) -> list[Span]:
    """Adjacent row ranges of one source as one span (fewer, larger chunks)."""
    out = []
    for src, (a, b) in spans:
        if out and out[-1][0] is src and out[-1][1][1] == a:
            out[-1] = (src, (out[-1][1][0], b))
        else:
            out.append((src, (a, b)))
    return out
