"""Load time on a cluster, predicted from the plan and a description of the cluster: headers only, no processes.

A load moves bytes through three kinds of resource: storage (one file system the job shares, or a disk per
node), each node's NIC (full duplex: what it sends and what it receives), and each node's links among its own
ranks. distload's transfer is a pipeline (readers read ahead of the wire, buckets stream), so its time is that
of its busiest resource, plus one bucket to fill the pipe: the bottleneck is named. every-rank-reads (vLLM's
default loader) sends nothing; each node's ranks read what they keep, through the kernel's read-ahead, which on
a node's strided reads (its rows of every column-parallel tensor) reads on into the rows it skips: a page
fault of a file map reads the window around it, and by the end of a run of pages the next window is asked
for, so a node reads its byte ranges widened by one window before and two after (on the emulated cluster this
matches every-rank-reads' measured bytes within 1-2% at 8 MiB and 1-3% at 128 KiB, BENCHMARKS.md). What no
resource explains (start-up, planning, rendezvous) is left out: on a real cluster it is fixed, and
BENCHMARKS.md measures it.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import DistloadError
from .types import LoadPlan

PAGE = 4096


@dataclass(frozen=True)
class ClusterSpec:
    """nodes x gpus_per_node ranks; rates in GB/s (1e9 bytes), each the payload a resource carries."""
    nodes: int
    gpus_per_node: int
    storage: str = "shared"          # "shared": one file system, storage_gbps for the whole job; "per-node": each
    storage_gbps: float = 2.0        # node reads its own copy at storage_gbps
    nic_gbps: float = 50.0           # each node's NIC, each way (400 Gb/s = 50 GB/s)
    intra_gbps: float = 200.0        # among one node's ranks (NVLink; shared memory on a host)
    read_ahead_kib: int = 8192       # the file system's read-ahead window (what every-rank-reads' faults fetch)
    broadcast: str = "tree"          # across nodes: "tree" (NCCL: each node receives a broadcast once), "star" (gloo:
    #                                  the root sends each rank its own copy)

    def __post_init__(self):
        if self.storage not in ("shared", "per-node"):
            raise DistloadError(f"cluster storage={self.storage!r}: shared or per-node")
        if self.broadcast not in ("tree", "star"):
            raise DistloadError(f"cluster broadcast={self.broadcast!r}: tree or star")
        rates = {"storage-gbps": self.storage_gbps, "nic-gbps": self.nic_gbps, "intra-gbps": self.intra_gbps}
        bad = [k for k, v in rates.items() if not v > 0] + (["nodes"] if self.nodes < 1 else [])
        if bad or self.gpus_per_node < 1 or self.read_ahead_kib < 0:
            raise DistloadError(f"cluster description: {', '.join(bad) or 'gpus per node / read-ahead'} must be "
                                f"positive (got {self})")


KEYS = {"storage": str, "storage-gbps": float, "nic-gbps": float, "nic-gbit": float, "intra-gbps": float,
        "read-ahead-kib": int, "broadcast": str}


def parse_cluster(text: str, nodes: int, gpus_per_node: int) -> ClusterSpec:
    """'storage=shared,storage-gbps=20,nic-gbit=400' (keys: KEYS; nic-gbit is the NIC in Gb/s, as sold)."""
    fields = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, eq, value = part.partition("=")
        if not eq or key not in KEYS:
            raise DistloadError(f"--cluster {part!r}: expected KEY=VALUE with KEY one of {', '.join(KEYS)}")
        try:
            fields[key] = KEYS[key](value)
        except ValueError:
            raise DistloadError(f"--cluster {key}={value!r}: not a {KEYS[key].__name__}") from None
    if "nic-gbit" in fields:
        fields["nic-gbps"] = fields.pop("nic-gbit") / 8
    return ClusterSpec(nodes, gpus_per_node, **{k.replace("-", "_"): v for k, v in fields.items()})


@dataclass(frozen=True)
class Traffic:
    """Per node: bytes read from storage, sent and received over its NIC, copied among its own ranks."""
    storage: tuple[int, ...]
    sent: tuple[int, ...]
    received: tuple[int, ...]
    intra: tuple[int, ...]


@dataclass(frozen=True)
class Prediction:
    loader: str
    seconds: float
    resource: str                    # the one that sets the time: "storage", "nic" or "intra"
    bottleneck: str                  # the same, in words, with its bytes and rate
    parts: dict                      # seconds per resource ("storage", "nic", "intra", "fill")
    traffic: Traffic

    def as_dict(self) -> dict:
        t = self.traffic
        return {"loader": self.loader, "seconds": self.seconds, "resource": self.resource,
                "bottleneck": self.bottleneck, "parts": self.parts,
                "storage_bytes": sum(t.storage), "node_storage_bytes_max": max(t.storage),
                "nic_bytes_max": max(max(t.sent), max(t.received))}


def nodes_of(plan: LoadPlan) -> int:
    layout = plan.layout
    return 1 if layout.one_node else layout.world // layout.local_world


class _Counter:
    def __init__(self, n: int):
        self.storage, self.sent, self.received, self.intra = ([0] * n for _ in range(4))

    def frozen(self) -> Traffic:
        return Traffic(*(tuple(x) for x in (self.storage, self.sent, self.received, self.intra)))


def distload_traffic(plan: LoadPlan, broadcast: str = "tree") -> Traffic:
    """What the whole job's plan moves, per node: each bucket read on its reader's node, point-to-point bytes to
    each group's leader, fan-outs from a leader to its group's replicas, broadcasts to every rank."""
    layout, n = plan.layout, nodes_of(plan)
    node, lw = layout.node, layout.local_world if n > 1 else layout.world
    c = _Counter(n)
    for b in plan.buckets:
        home = node(b.reader)
        c.storage[home] += b.read_bytes
        if b.broadcast:
            _broadcast(c, home, b.read_bytes, [(k, lw) for k in range(n)], b.reader, lw, broadcast)
            continue
        for g, nbytes in b.groups:
            if not nbytes:
                continue
            leader = g.nearest(b.reader)
            if node(leader) != home:
                c.sent[home] += nbytes
                c.received[node(leader)] += nbytes
            elif leader != b.reader:
                c.intra[home] += nbytes
            if g.count > 1:
                members = [(k, g.on_node(k, lw if n > 1 else 0)) for k in _group_nodes(g, lw, n)]
                _broadcast(c, node(leader), nbytes, members, leader, lw, broadcast)
    return c.frozen()


def _group_nodes(g, lw: int, n: int) -> range:
    return range(g.first // lw, min(n, g.last // lw + 1)) if n > 1 else range(1)


def _broadcast(c: _Counter, home: int, nbytes: int, members: list, root: int, lw: int, how: str) -> None:
    """`nbytes` from `root` (on node `home`) to every member: members = [(node, ranks of the group on it)]."""
    for k, count in members:
        if not count:
            continue
        if k == home:
            c.intra[k] += nbytes * (count - 1)
            continue
        crossing = count if how == "star" else 1   # tree: once per node, then among the node's ranks
        c.sent[home] += nbytes * crossing
        c.received[k] += nbytes * crossing
        c.intra[k] += nbytes * (count - crossing)


def every_rank_reads_traffic(plan: LoadPlan, read_ahead_kib: int) -> Traffic:
    """Each node's storage bytes when each rank reads its own pieces (one page cache per node): per file, the
    byte ranges its ranks keep, each widened by the read-ahead window around it (see the module docstring)."""
    layout, n = plan.layout, nodes_of(plan)
    lw = layout.local_world if n > 1 else layout.world
    window = read_ahead_kib * 1024
    ranges: list[dict[str, list]] = [{} for _ in range(n)]
    scattered = [0] * n
    nodes_memo: dict = {}
    ends: dict[str, int] = {}   # where each file's data ends: read-ahead stops there
    for src in plan.sources.values():
        ends[src.file] = max(ends.get(src.file, 0), src.offset + src.nbytes)
        rb = src.row_bytes
        for r0, r1, width, g in src.takers:
            lo, hi = src.offset + r0 * rb, src.offset + r1 * rb
            if g not in nodes_memo:
                nodes_memo[g] = sorted({m // lw for m in g.members()}) if n > 1 else [0]
            for k in nodes_memo[g]:
                if width < rb and rb > width + 3 * window + PAGE:
                    scattered[k] += (r1 - r0) * (width + 3 * window + PAGE)   # a piece of each row, and windows
                else:
                    ranges[k].setdefault(src.file, []).append((lo, hi))
    storage = [scattered[k] + sum(_widened(spans, window, ends[f]) for f, spans in ranges[k].items()) for k in range(n)]
    zero = (0,) * n
    return Traffic(tuple(storage), zero, zero, zero)


def _widened(spans: list, window: int, file_end: int) -> int:
    """Bytes in the union of `spans`, each widened by a window before and two after (inside the file)."""
    total, end = 0, -1
    for lo, hi in sorted(spans):
        lo, hi = max(0, lo - window), min(file_end, hi + 2 * window)
        if lo > end:
            total += hi - lo
        elif hi > end:
            total += hi - end
        end = max(end, hi)
    return total


def _timed(loader: str, t: Traffic, spec: ClusterSpec, bucket: int = 0, per_reader: float = 1.0) -> Prediction:
    """The time of the busiest resource, plus the pipeline's fill: one bucket (`bucket` bytes) through the
    resource that is not the bottleneck and cannot overlap with it. Link-bound, the first bucket is read while
    the links wait (`per_reader`: a reader's storage bytes/s); storage-bound, the last buckets (a reader's own
    rows: plan.buckets.transfer_order) go only to its node's ranks while storage is done."""
    gb = 1e9
    if spec.storage == "shared":
        storage_s = sum(t.storage) / (spec.storage_gbps * gb)
        storage_what = f"storage ({sum(t.storage) / gb:.2f} GB through {spec.storage_gbps:g} GB/s shared)"
    else:
        busiest = max(range(len(t.storage)), key=t.storage.__getitem__)
        storage_s = t.storage[busiest] / (spec.storage_gbps * gb)
        storage_what = f"storage of node {busiest} ({t.storage[busiest] / gb:.2f} GB at {spec.storage_gbps:g} GB/s)"
    per_node = [max(s, r) for s, r in zip(t.sent, t.received)]
    busiest = max(range(len(per_node)), key=per_node.__getitem__)
    nic_s = per_node[busiest] / (spec.nic_gbps * gb)
    way = "sends" if t.sent[busiest] >= t.received[busiest] else "receives"
    nic_what = f"NIC of node {busiest} ({way} {per_node[busiest] / gb:.2f} GB at {spec.nic_gbps:g} GB/s)"
    intra_s = max(t.intra) / (spec.intra_gbps * gb)
    parts = {"storage": storage_s, "nic": nic_s, "intra": intra_s}
    what = {"storage": storage_what, "nic": nic_what, "intra": "copies among a node's ranks"}
    slowest = max(what, key=parts.__getitem__)
    parts["fill"] = bucket / (spec.intra_gbps * gb) if slowest == "storage" else bucket / per_reader
    return Prediction(loader, parts[slowest] + parts["fill"], slowest, what[slowest], parts, t)


def predict(plan: LoadPlan, spec: ClusterSpec) -> dict[str, Prediction]:
    """distload's and every-rank-reads' load time for the whole job's `plan` on the cluster `spec`."""
    n, lw = nodes_of(plan), plan.layout.local_world or plan.layout.world
    if (n, lw if n > 1 else plan.layout.world) != (spec.nodes, spec.gpus_per_node):
        raise DistloadError(f"cluster of {spec.nodes} x {spec.gpus_per_node} GPUs, but the plan is for {n} node(s) x "
                            f"{lw} ranks: pass --world {spec.nodes * spec.gpus_per_node} --local-world "
                            f"{spec.gpus_per_node}")
    if plan.planned_for is not None:
        raise DistloadError("predict needs the whole job's plan, not one rank's part (build_plan without rank)")
    ours = distload_traffic(plan, spec.broadcast)
    readers = max(1, len(plan.layout.readers))
    per_reader = spec.storage_gbps * 1e9 / (readers if spec.storage == "shared" else
                                            max(len(plan.layout.readers_on(k)) for k in range(n)))
    bucket = max((b.read_bytes for b in plan.buckets), default=0)
    return {"distload": _timed("distload", ours, spec, bucket, per_reader),
            "every-rank-reads": _timed("every-rank-reads", every_rank_reads_traffic(plan, spec.read_ahead_kib), spec)}


def describe_prediction(predicted: dict[str, Prediction], spec: ClusterSpec, checkpoint_bytes: int) -> list[str]:
    """Lines for `distload inspect --cluster`: the cluster, then each loader's time, bottleneck and bytes."""
    lines = [f"predicted on {spec.nodes} node(s) x {spec.gpus_per_node} GPUs, {spec.storage} storage at "
             f"{spec.storage_gbps:g} GB/s{' per node' if spec.storage == 'per-node' else ''}, NICs {spec.nic_gbps:g} "
             f"GB/s each way, {spec.intra_gbps:g} GB/s within a node, read-ahead {spec.read_ahead_kib} KiB "
             f"(bytes and rates only: start-up and planning not included):"]
    for p in predicted.values():
        t = p.traffic
        lines.append(f"  {p.loader}: {p.seconds:.2f} s, bound by {p.bottleneck}; storage reads "
                     f"{sum(t.storage) / max(1, checkpoint_bytes):.2f}x the checkpoint, busiest NIC "
                     f"{max(max(t.sent), max(t.received)) / 1e9:.2f} GB")
    d, e = predicted.get("distload"), predicted.get("every-rank-reads")
    if d and e and e.seconds:
        lines.append(f"  distload / every-rank-reads: {d.seconds / e.seconds:.2f}x")
    return lines
