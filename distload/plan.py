"""The load plan: a pure function (checkpoint index, rules, config, layout) -> LoadPlan.

Every rank computes the same plan from the same metadata, so no per-tensor control message ever
travels: a receiver knows from the plan which bytes arrive, in which order, and where they go. All
validation (names, shapes, dtypes, divisibility) happens here, before any byte is read.

Vocabulary: a *source* is a checkpoint tensor; a *param* is a target tensor in the serving layout; a
*delivery* is one rectangle of a source (2-D view) that one rank copies into one of its params; a
*chunk* is a row range of a source (the unit of reading, so a huge embedding never needs a staging
buffer of its own size); a *bucket* is a run of chunks read by one reader and sent as one collective.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass, field

from . import expected_shapes, loop_sets, names, quant_plan
from .dtypes import itemsize
from .errors import PlanError, RuleError
from .rules import FamilyRules, ParamRule
from .shard import HEAD_STYLES, LocalLayout, Part, Piece, cut, view2d
from .topology import Layout

# One bucket (a reader reads it into one staging slot; a rank holds a few: see transfer/). Measured on
# a 1 GiB Llama at 4 ranks (scripts/bench.py, BENCHMARKS.md): 8, 16 and 32 MiB load in the same time within
# noise, and each doubling costs ~30 MiB more peak RSS per rank; smaller buckets mean more messages.
DEFAULT_STAGING_BYTES = 16 << 20


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
class Delivery:
    rank: int
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
    deliveries: tuple[Delivery, ...]
    broadcast: bool                              # every rank receives the whole tensor

    # Cached: planning asks for these thousands of times (several ms per plan at 4 ranks); a Source never
    # changes, and cached values are not fields (equality, hashing, repr and the plan digest ignore them).
    @functools.cached_property
    def rows(self) -> int:
        return view2d(self.shape)[0]

    @functools.cached_property
    def row_bytes(self) -> int:
        return view2d(self.shape)[1] * itemsize(self.dtype)

    @functools.cached_property
    def nbytes(self) -> int:
        return self.rows * self.row_bytes


@dataclass(frozen=True)
class Chunk:
    source: str
    rows: tuple[int, int]


@dataclass(frozen=True)
class Bucket:
    index: int
    reader: int
    broadcast: bool
    chunks: tuple[Chunk, ...]
    read_bytes: int
    recv_bytes: tuple[int, ...]                  # per rank (the reader's own share is copied locally)


@dataclass(frozen=True)
class Item:
    """One clipped delivery inside a bucket, at `offset` of the wire buffer of its rank."""
    chunk: Chunk
    param: str
    piece: Piece                                 # rows already clipped to the chunk
    offset: int
    nbytes: int


@dataclass(frozen=True)
class LoadPlan:
    family: str
    layout: Layout
    specs: tuple[dict[str, ParamSpec], ...]      # per rank
    sources: dict[str, Source]
    buckets: tuple[Bucket, ...]
    missing: tuple[str, ...] = ()
    unexpected: tuple[str, ...] = ()
    ignored: tuple[str, ...] = ()                # dropped by rule or by a tie (e.g. rotary inv_freq)
    checkpoint_bytes: int = 0
    notes: tuple[str, ...] = field(default=(), compare=False)
    # Quantized loads (quant_plan.py): `specs` are the final params (what the caller gets and reconcile
    # checks); where post-load steps change them, `staging` holds what the transfer writes, per rank.
    staging: tuple[dict[str, ParamSpec], ...] = ()
    post: tuple[tuple, ...] = ()                 # per rank, quant_plan.Step s run after their inputs arrive
    quantization: str | None = None              # e.g. 'fp8-block 128x128 (config.json ...)'; None: none

    def owned_bytes(self, rank: int) -> int:
        """Checkpoint bytes of the pieces delivered to `rank` (what it reads itself with owner reads)."""
        return sum(d.piece.numel * itemsize(src.dtype) for src in self.sources.values() for d in src.deliveries
                   if d.rank == rank)

    def owned_pieces(self, rank: int) -> list:
        """(source, delivery) of every piece delivered to `rank`, in file order (file, then offset): the order
        in which a rank that copies its own pieces from the files reads them."""
        mine = [(src, d) for src in self.sources.values() for d in src.deliveries if d.rank == rank]
        mine.sort(key=lambda sd: (sd[0].file, sd[0].offset + sd[1].piece.rows[0] * sd[0].row_bytes))
        return mine

    def bytes_from_other_nodes(self, rank: int) -> int:
        """Bytes `rank` receives from readers on other nodes: what crosses the network to it."""
        node = self.layout.node(rank)
        return sum(b.read_bytes if b.broadcast else b.recv_bytes[rank]
                   for b in self.buckets if self.layout.node(b.reader) != node)

    def staging_specs(self, rank: int) -> dict[str, ParamSpec]:
        """What the transfer writes on `rank` (the final specs unless a post-load step rewrites params)."""
        return self.staging[rank] if self.staging else self.specs[rank]

    def items(self, bucket: Bucket, rank: int) -> list[Item]:
        """What `rank` receives from `bucket`, in wire order (identical computation on every rank)."""
        out, offset = [], 0
        for chunk in bucket.chunks:
            src = self.sources[chunk.source]
            for d in src.deliveries:
                if d.rank != rank:
                    continue
                piece = clip(d.piece, chunk.rows)
                if piece is None:
                    continue
                if bucket.broadcast:
                    # The broadcast buffer is the chunks' raw bytes; the item points into it.
                    nbytes = (chunk.rows[1] - chunk.rows[0]) * src.row_bytes
                    out.append(Item(chunk, d.param, piece, broadcast_offset(self, bucket, chunk), nbytes))
                    continue
                nbytes = piece.numel * itemsize(src.dtype)
                out.append(Item(chunk, d.param, piece, offset, nbytes))
                offset += nbytes
        return out


def clip(piece: Piece, rows: tuple[int, int]) -> Piece | None:
    a, b = max(piece.rows[0], rows[0]), min(piece.rows[1], rows[1])
    if a >= b:
        return None
    return Piece(piece.source, (a, b), piece.cols, piece.dst_row + a - piece.rows[0], piece.dst_col)


def broadcast_offset(plan: LoadPlan, bucket: Bucket, chunk: Chunk) -> int:
    offset = 0
    for c in bucket.chunks:
        if c == chunk:
            return offset
        offset += (c.rows[1] - c.rows[0]) * plan.sources[c.source].row_bytes
    raise KeyError(chunk)


# ----------------------------------------------------------------------------------------------------
# Experts: who hosts what


def expert_hosts(num_experts: int, layout: Layout) -> list[tuple[int, ...]]:
    """Per rank, the global expert ids it hosts, ascending (EPLB maps may repeat an id across ranks)."""
    if layout.expert_map is not None:
        emap = layout.expert_map
        if len(emap) != layout.world:
            raise PlanError(f"--expert-map has {len(emap)} rank entries; the world size is {layout.world}")
        bad = sorted({e for ids in emap for e in ids if not 0 <= e < num_experts})
        if bad:
            raise PlanError(f"--expert-map names experts {bad} outside 0..{num_experts - 1}")
        unhosted = sorted(set(range(num_experts)) - {e for ids in emap for e in ids})
        if unhosted:
            raise PlanError(f"--expert-map hosts no rank for experts {unhosted}; every expert needs a host")
        g = layout.expert_group_size
        for r in range(layout.world):
            if sorted(emap[r]) != sorted(emap[r - r % g]):
                raise PlanError(f"--expert-map: ranks {r - r % g} and {r} are in one expert group (size {g}, "
                                f"ep={layout.ep}) and split its experts by TP, so they must host the same ids")
            if len(set(emap[r])) != len(emap[r]):
                raise PlanError(f"--expert-map: rank {r} lists an expert twice: {list(emap[r])}")
        return [tuple(sorted(ids)) for ids in emap]
    if num_experts % layout.ep:
        ok = [e for e in range(1, layout.world + 1) if layout.world % e == 0 and num_experts % e == 0]
        raise PlanError(f"num_experts={num_experts}, ep={layout.ep}: ep must divide the number of experts "
                        f"(try --ep {', '.join(map(str, ok))})")
    per = num_experts // layout.ep
    hosts = []
    for r in range(layout.world):
        k = layout.ep_rank(r)
        if layout.expert_placement == "linear":
            hosts.append(tuple(range(k * per, (k + 1) * per)))
        else:
            hosts.append(tuple(e for e in range(num_experts) if e % layout.ep == k))
    return hosts


# ----------------------------------------------------------------------------------------------------
# Rules -> targets


@dataclass(frozen=True)
class Target:
    """One expanded param: its name and, per logical part, the source it comes from."""
    name: str
    rule: ParamRule
    sources: tuple[str, ...]            # distinct source names (fused: one)
    expert_sources: tuple[tuple[str, ...], ...] = ()   # style expert: per global expert, its sources


def _loop_ranges(rules: FamilyRules, config: dict) -> dict[str, range]:
    return {var: range(rules.dim(config, dim)) for var, dim in rules.loops.items()}


def _expand_all(template: str, ranges: dict[str, range], fixed: dict[str, int] | None = None) -> list[tuple[dict, str]]:
    fixed = fixed or {}
    free = [v for v in names.variables(template) if v not in fixed]
    out = []
    for combo in itertools.product(*(ranges[v] for v in free)):
        values = {**fixed, **dict(zip(free, combo))}
        out.append((values, names.expand(template, **values)))
    return out


def _in_sets(rule: ParamRule, rules: FamilyRules, config: dict, ranges: dict[str, range]):
    """A predicate on a target's loop values: does the target exist there (`only` / `unless` a [sets] name)?"""
    checks = []
    for set_name, want in ((rule.only, True), (rule.unless, False)):
        if set_name is not None:
            loop = rules.sets[set_name].loop
            checks.append((loop, rules.members(config, set_name, ranges[loop]), want))
    return lambda values: all((values[loop] in members) == want for loop, members, want in checks)


def _expand_form(form: ParamRule, name: str, values: dict, ranges: dict[str, range]) -> Target:
    if form.style == "expert" and not form.stacked:
        per_expert = tuple(tuple(names.expand(p, **values, expert=e) for p in form.parts) for e in ranges["expert"])
        return Target(name, form, tuple(s for ss in per_expert for s in ss), per_expert)
    return Target(name, form, tuple(names.expand(p, **values) for p in form.parts))


def _targets(rules: FamilyRules, config: dict, ranges: dict[str, range],
             tensors) -> tuple[list[Target], dict[str, str]]:
    """Expanded targets, and the tied targets {alias: param it aliases} active for this config.

    A rule with alternative checkpoint forms (per-expert or stacked experts, ...) takes, per target, the
    first form whose tensors are all in the checkpoint, else the most complete one (so `missing` names
    what is really absent).
    """
    tied = {t.target: t.to for t in rules.ties if config.get(t.when)}
    targets = []
    for rule in rules.params:
        if rule.when is not None and not config.get(rule.when):
            continue  # e.g. Cohere's q/k norms exist only with use_qk_norm
        exists = _in_sets(rule, rules, config, ranges)
        for values, name in _expand_all(rule.target, ranges):
            if name in tied or not exists(values):
                continue
            forms = [_expand_form(form, name, values, ranges) for form in rule.forms]
            present = [sum(s in tensors for s in t.sources) for t in forms]
            complete = [t for t, n in zip(forms, present) if n == len(t.sources)]
            targets.append(complete[0] if complete else forms[present.index(max(present))])
    return targets, tied


# ----------------------------------------------------------------------------------------------------
# Target -> logical parts with sizes checked against config.json


def _logical_parts(target: Target, sources: list[str], index: dict, rules: FamilyRules, config: dict,
                   row0: int = 0, rows: int | None = None) -> list[Part]:
    """The logical parts of one target (or of one expert of it), sizes checked against config.json."""
    rule = target.rule
    style = rule.inner if rule.style == "expert" else rule.style
    entries = [index[s] for s in sources]
    shapes = [view2d(e.shape) for e in entries]
    where = f"{target.name} (rule {rule.style} in {rules.source})"
    if len({e.dtype for e in entries}) > 1:
        raise PlanError(f"{where}: parts have different dtypes "
                        + ", ".join(f"{e.name}={e.dtype}" for e in entries) + "; re-save the checkpoint with one dtype")
    if len({c for _, c in shapes}) > 1:
        raise PlanError(f"{where}: parts have different last dims "
                        + ", ".join(f"{e.name}{list(e.shape)}" for e in entries) + "; the checkpoint contradicts itself")
    cols = shapes[0][1]
    if rows is not None:  # one expert of a stacked source
        (src,) = sources
        if rule.split:
            sizes = [rules.dim(config, d) for d in rule.split]
        else:
            sizes = [rows]
        if sum(sizes) != rows:
            raise PlanError(f"{where}: split {list(rule.split)} = {sizes} does not add up to {rows} rows per expert of {src}")
        parts, at = [], row0
        for n in sizes:
            parts.append(Part(src, at, n, cols))
            at += n
        return parts
    if style == "qkv":
        heads, kv = rules.dim(config, "heads"), rules.dim(config, "kv_heads")
        head_dim = rules.dim(config, "head_dim")
        want = [heads * head_dim, kv * head_dim, kv * head_dim]
        if len(sources) == 1:
            total = shapes[0][0]
            if total != sum(want):
                raise PlanError(f"{where}: {sources[0]} has {total} rows but config.json says "
                                f"(num_attention_heads {heads} + 2 x num_key_value_heads {kv}) x head_dim {head_dim} = "
                                f"{sum(want)}; config.json and the checkpoint disagree")
            return [Part(sources[0], sum(want[:i]), want[i], cols) for i in range(3)]
        if len(sources) != 3:
            raise RuleError(f"{where}: style qkv needs 3 parts (q, k, v) or one fused source, got {len(sources)}")
        for s, (r, _), w, label in zip(sources, shapes, want, ("num_attention_heads", "num_key_value_heads", "num_key_value_heads")):
            if r != w:
                raise PlanError(f"{where}: {s} has {r} rows but config.json says {label} x head_dim = {w}; "
                                f"config.json and the checkpoint disagree")
        return [Part(s, 0, r, cols) for s, (r, _) in zip(sources, shapes)]
    if len(sources) == 1 and rule.split:
        sizes = [rules.dim(config, d) for d in rule.split]
        if sum(sizes) != shapes[0][0]:
            raise PlanError(f"{where}: {sources[0]} has {shapes[0][0]} rows but split {list(rule.split)} = {sizes} "
                            f"adds up to {sum(sizes)}; config.json and the checkpoint disagree")
        return [Part(sources[0], sum(sizes[:i]), n, cols) for i, n in enumerate(sizes)]
    if rule.split and len(rule.split) == len(sources):
        # Separate parts with declared sizes (e.g. gate/up = intermediate_size): check them against config.json.
        for src, (r, _), dim_name in zip(sources, shapes, rule.split):
            if r != rules.dim(config, dim_name):
                raise PlanError(f"{where}: {src} has {r} rows but config.json says {dim_name} = "
                                f"{rules.dim(config, dim_name)}; config.json and the checkpoint disagree")
    return [Part(s, 0, r, cols) for s, (r, _) in zip(sources, shapes)]


def _check_vocab(target: Target, parts: list[Part], index, rules: FamilyRules, config: dict) -> None:
    if "vocab" in rules.dims:
        vocab = rules.dim(config, "vocab")
        if parts[0].rows != vocab:
            raise PlanError(f"{target.name} (rule vocab): {parts[0].source} has {parts[0].rows} rows but "
                            f"config.json vocab_size={vocab}; config.json and the checkpoint disagree")


def _local_shape(style: str, global_shape: tuple[int, ...], lay: LocalLayout) -> tuple[int, ...]:
    if style == "replicate":
        return global_shape
    if style == "row":
        return tuple(global_shape[:-1]) + (lay.cols,) if len(global_shape) > 1 else global_shape
    # Row cuts of the 2-D view split dim 0 of an N-D tensor: each dim-0 index spans rows_per_index rows.
    rows_per_index = view2d(global_shape)[0] // global_shape[0] if global_shape and global_shape[0] else 1
    if lay.rows % rows_per_index:
        raise PlanError(f"a {style} cut of a {list(global_shape)} tensor gives {lay.rows} rows of its 2-D view, "
                        f"not a whole number of dim-0 slices ({rows_per_index} rows each)")
    return (lay.rows // rows_per_index,) + tuple(global_shape[1:])


def _effective_style(style: str, ndim: int) -> str:
    # The 1-D bias of a row-parallel layer is replicated: every rank holds it, and the forward adds it
    # once after the all-reduce (vLLM does the same).
    return "replicate" if style == "row" and ndim < 2 else style


def _layouts_for_target(target, index, rules, config, layout: Layout, hosts) -> tuple[list[ParamSpec], list[LocalLayout]]:
    rule = target.rule
    entries = [index[s] for s in target.sources]
    dtype = entries[0].dtype
    sizes = {}
    if (rule.inner or rule.style) in HEAD_STYLES:
        sizes = dict(heads=rules.dim(config, "heads"), kv_heads=rules.dim(config, "kv_heads"))
    if rule.style != "expert":
        parts = _logical_parts(target, list(target.sources), index, rules, config)
        if rule.style == "vocab":
            _check_vocab(target, parts, index, rules, config)
        style = _effective_style(rule.style, len(entries[0].shape))
        shape0 = entries[0].shape
        global_shape = (sum(p.rows for p in parts),) + tuple(shape0[1:]) if len(parts) > 1 or rule.split else shape0
        if style == "qkv" and len(entries) == 1:
            global_shape = shape0
        specs, lays = [], []
        for r in range(layout.world):
            lay = cut(style, parts, layout.tp, layout.tp_rank(r), f"{target.name} (rule {rule.style})",
                      pad_to=rule.pad_to, **sizes)
            lays.append(lay)
            specs.append(ParamSpec(target.name, rule.style, dtype, tuple(global_shape),
                                   _local_shape(style, tuple(global_shape), lay), lay.padding))
        return specs, lays
    # Expert params: [local experts, *inner local shape], slots in ascending global id.
    num_experts = rules.dim(config, "experts")
    g = layout.expert_group_size
    where = f"{target.name} (rule expert/{rule.inner} in {rules.source})"
    if rule.stacked:
        (src,) = target.sources
        shape = tuple(index[src].shape)
        if len(shape) < 2 or shape[0] != num_experts:
            raise PlanError(f"{where}: {src} has shape {list(shape)}, but a stacked expert tensor has dim 0 = "
                            f"num experts = {num_experts} (config.json); the checkpoint and config.json disagree")
        one_expert = shape[1:]
        rows_per = view2d(shape)[0] // num_experts
        per_expert_parts = [_logical_parts(target, [src], index, rules, config, row0=e * rows_per, rows=rows_per)
                            for e in range(num_experts)]
    else:
        per_expert_parts = [_logical_parts(target, list(target.expert_sources[e]), index, rules, config)
                            for e in range(num_experts)]
        one_expert = (sum(p.rows for p in per_expert_parts[0]),) + tuple(entries[0].shape[1:])
        sizes_of = [tuple((p.rows, p.cols) for p in parts) for parts in per_expert_parts]
        odd = [e for e in range(num_experts) if sizes_of[e] != sizes_of[0]]
        if odd:
            raise PlanError(f"{where}: experts {odd} have part shapes {sizes_of[odd[0]]} but expert 0 has "
                            f"{sizes_of[0]}; every expert must have one shape (the checkpoint contradicts itself)")
    inner = _effective_style(rule.inner, len(one_expert))
    global_shape = (num_experts,) + tuple(one_expert)
    specs, lays = [], []
    for r in range(layout.world):
        t = layout.rank_in_expert_group(r)
        # Cut expert 0 too, so that a rank hosting no expert (EPLB) still gets its inner shape.
        lay = cut(inner, per_expert_parts[0], g, t, f"{where} expert 0", label="tp-in-expert-group", **sizes)
        pieces, rows, cols, padding = [], lay.rows, lay.cols, ()
        for slot, e in enumerate(hosts[r]):
            lay = cut(inner, per_expert_parts[e], g, t, f"{where} expert {e}", label="tp-in-expert-group", **sizes)
            pieces += [Piece(p.source, p.rows, p.cols, p.dst_row + slot * lay.rows, p.dst_col) for p in lay.pieces]
        inner_local = _local_shape(inner, tuple(one_expert), LocalLayout(rows, cols, ()))
        local_shape = (len(hosts[r]),) + inner_local
        lays.append(LocalLayout(len(hosts[r]) * rows, cols, tuple(pieces), padding))
        specs.append(ParamSpec(target.name, "expert", dtype, global_shape, local_shape, (), None, hosts[r]))
    return specs, lays


# ----------------------------------------------------------------------------------------------------
# The plan


Span = tuple  # (Source, (first row, end row)): rows of one source that one reader reads


def _byte_runs(spans: list[Span], readers: tuple[int, ...], quotas: list[float]) -> dict[int, list[Span]]:
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
        acc += _span_bytes(span)
    return runs


def _span_bytes(span: Span) -> int:
    src, (a, b) = span
    return (b - a) * src.row_bytes


def _node_segments(src: Source, node_of) -> list[tuple[int, int, frozenset]]:
    """The source's rows cut where the set of nodes taking them changes: (first row, end row, nodes)."""
    cuts = sorted({0, src.rows} | {r for d in src.deliveries for r in d.piece.rows if 0 < r < src.rows})
    starts = sorted((d.piece.rows[0], d.piece.rows[1], node_of(d.rank)) for d in src.deliveries)
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


def _reader_spans(sources: list[Source], layout: Layout) -> dict[int, list[Span]]:
    """Which rows of which sources each reader reads, in file order, about equal bytes per reader.

    On one node (or with readers on one node only) sources are split into contiguous runs at tensor
    boundaries. With readers on several nodes, rows that only one node's ranks take are read by a reader of
    that node, so they never cross between nodes (column-parallel and vocab rows, a node's experts); rows
    several nodes take (row-parallel tensors, replicated ones) are spread over the nodes to even out the
    bytes each node reads. Every byte is still read once by the job.
    """
    readers = layout.readers
    whole = [(s, (0, s.rows)) for s in sources]
    total = sum(_span_bytes(x) for x in whole)
    if not layout.reads_by_node:
        return _byte_runs(whole, readers, [total / len(readers)] * len(readers))
    nodes = layout.reader_nodes
    by_node = {n: layout.readers_on(n) for n in nodes}
    home: dict[int, list[Span]] = {n: [] for n in by_node}
    shared: list[Span] = []
    for s in sources:
        for a, b, takers in _node_segments(s, layout.node):
            only = next(iter(takers)) if len(takers) == 1 else None
            (home[only] if only in home else shared).append((s, (a, b)))
    # Each node reads its share (in proportion to its readers): its own rows, topped up with shared ones.
    quota = [max(0.0, total * len(by_node[n]) / len(readers) - sum(_span_bytes(x) for x in home[n])) for n in nodes]
    extra = _byte_runs(shared, nodes, quota if sum(quota) else [1.0] * len(nodes))
    order = {s.name: i for i, s in enumerate(sources)}
    out = {}
    for n in nodes:
        spans = _merged(sorted(home[n] + extra[n], key=lambda x: (order[x[0].name], x[1])))
        share = sum(_span_bytes(x) for x in spans) / len(by_node[n])
        out.update(_byte_runs(spans, by_node[n], [share] * len(by_node[n])))
    return out


def _merged(spans: list[Span]) -> list[Span]:
    """Adjacent row ranges of one source as one span (fewer, larger chunks)."""
    out = []
    for src, (a, b) in spans:
        if out and out[-1][0] is src and out[-1][1][1] == a:
            out[-1] = (src, (out[-1][1][0], b))
        else:
            out.append((src, (a, b)))
    return out


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


def _relayout(t: Target, tensors, rules: FamilyRules, config: dict, q: int):
    """Target t's (specs, layouts) on q ranks at tp q (ep 1): to name the group sizes a derived cut accepts."""
    lay = Layout(world=q, tp=q)
    hosts = expert_hosts(rules.dim(config, "experts"), lay) if t.rule.style == "expert" else None
    return _layouts_for_target(t, tensors, rules, config, lay, hosts)


def build_plan(tensors: dict, config: dict, rules: FamilyRules, layout: Layout, *,
               strict: bool = True, staging_bytes: int = DEFAULT_STAGING_BYTES, quantize: str | None = None,
               dequantize: bool = False) -> LoadPlan:
    """Plan the whole load. `tensors` maps checkpoint names to entries (file, offset, dtype, shape, nbytes).

    quantize ('fp8' | 'fp8-block'): quantize the linear weights on each rank as they land; dequantize:
    turn an FP8 checkpoint's weights into BF16 (see quant_plan.py).
    """
    ranges = _loop_ranges(rules, config)
    targets, tied = _targets(rules, config, ranges, tensors)
    # A quantized checkpoint's scales travel with their weights: targets derived from config.json.
    scheme = quant_plan.checkpoint_scheme(config)
    companions = quant_plan.companions(targets, tensors, scheme)
    claimed: dict[str, str] = {}
    for t in targets + companions:
        for s in t.sources:
            if s in claimed:
                raise RuleError(f"{rules.source}: checkpoint tensor {s!r} is claimed by both {claimed[s]!r} and {t.name!r}")
            claimed[s] = t.name
    # Sources of a tied alias that the checkpoint still carries are read by nobody: the alias is the embedding.
    tied_sources = set()
    for alias in tied:
        for rule in rules.params:
            if rule.target == alias:
                tied_sources.update(p for form in rule.forms for p in form.parts)
    dropped = {n for n in tensors if any(names.match(t, n) is not None for t in rules.drop)}
    dropped |= loop_sets.past_loops(rules.drop_past, tensors, ranges)
    ignored = sorted(dropped | (tied_sources & set(tensors)))
    missing_by_target = {t.name: [s for s in t.sources if s not in tensors] for t in targets}
    missing = sorted(s for ss in missing_by_target.values() for s in ss)
    unexpected = sorted(set(tensors) - set(claimed) - set(ignored))
    if strict and (missing or unexpected):
        msg = [f"checkpoint does not match rules {rules.source} (family {rules.name})"]
        if missing:
            msg.append(f"missing {len(missing)} tensor(s): {names.describe(missing)}")
        if unexpected:
            msg.append(f"unexpected {len(unexpected)} tensor(s): {names.describe(unexpected)}")
        msg.append("fix: use the rules file for this architecture (--config PATH), or pass --no-strict to load what matches")
        raise PlanError("; ".join(msg))
    targets = [t for t in targets if not missing_by_target[t.name]]
    by_name = {t.name: t for t in targets}
    companions = [c for c in companions if c.weight in by_name]

    hosts = None
    if any(t.rule.style == "expert" for t in targets):
        hosts = expert_hosts(rules.dim(config, "experts"), layout)

    specs: list[dict[str, ParamSpec]] = [dict() for _ in range(layout.world)]
    deliveries: dict[str, list[Delivery]] = {}
    planned = {t.name: _layouts_for_target(t, tensors, rules, config, layout, hosts) for t in targets}
    # Every claimed tensor against the full shape and dtype the rules imply (the cuts above check only the
    # sizes they use), before any byte is read.
    expected_shapes.check_shapes(targets, tensors, rules, config)
    expected_shapes.check_dtypes(targets, companions, tensors, quantized=scheme is not None)
    for c in companions:  # cut from the weight's own layout, so weight and scale shards always match
        t = by_name[c.weight]
        group = layout.expert_group_size if t.rule.style == "expert" else layout.tp
        planned[c.name] = quant_plan.companion_layouts(c, t, *planned[c.weight], tensors, scheme, group,
                                                       lambda q, t=t: _relayout(t, tensors, rules, config, q))
    for name, (t_specs, lays) in planned.items():
        for r, (spec, lay) in enumerate(zip(t_specs, lays)):
            specs[r][name] = spec
            for piece in lay.pieces:
                deliveries.setdefault(piece.source, []).append(Delivery(r, name, piece))
    for alias, to in tied.items():
        for r in range(layout.world):
            if to in specs[r]:
                base = specs[r][to]
                specs[r][alias] = ParamSpec(alias, base.style, base.dtype, base.global_shape, base.local_shape,
                                            base.padding, alias_of=to)
    final, post, quantization = quant_plan.finalize(specs, planned, by_name, companions, tensors, scheme,
                                                    quantize=quantize, dequantize=dequantize)

    sources = []
    for name in sorted(deliveries, key=lambda n: (tensors[n].file, tensors[n].offset)):
        e = tensors[name]
        ds = tuple(deliveries[name])
        rows, cols = view2d(e.shape)
        full = {d.rank for d in ds if d.piece.rows == (0, rows) and d.piece.cols == (0, cols)}
        broadcast = len(ds) == layout.world and full == set(range(layout.world))
        sources.append(Source(name, e.file, e.offset, e.dtype, tuple(e.shape), ds, broadcast))
    runs = _reader_spans(sources, layout)
    buckets = interleaved({r: buckets_for(r, runs[r], layout.world, staging_bytes) for r in layout.readers},
                          layout.readers)
    notes = []
    if ignored:
        notes.append(f"ignored by rule: {names.describe(ignored)}")
    if quantization:
        notes.append(f"quantization: {quantization}")
    return LoadPlan(family=rules.name, layout=layout, specs=tuple(final), sources={s.name: s for s in sources},
                    buckets=buckets, missing=tuple(missing), unexpected=tuple(unexpected),
                    ignored=tuple(ignored), checkpoint_bytes=sum(s.nbytes for s in sources), notes=tuple(notes),
                    staging=tuple(specs) if any(post) else (), post=tuple(post), quantization=quantization)
