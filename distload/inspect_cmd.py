"""`distload inspect`: the plan without a process group — what a rank will hold and move, and the job's totals.

It plans exactly as one rank of the job would (`--rank`: its block's part of the plan, build_plan's rank mode),
timing that planning and its peak memory; the job's totals and the per-rank table come from the whole job's
plan, made after (untimed). The per-rank table is printed for small worlds (or on request): a line per rank
costs a pass over the buckets each.
"""

from __future__ import annotations

import resource
import time
from dataclasses import dataclass
from pathlib import Path

from .rules import mtp
from .errors import DistloadError
from .loader import decide_route, source_for
from .options import LoadOptions
from .plan import LoadPlan
from .plan.predict import describe_prediction, nodes_of, parse_cluster, predict
from .plan.wire import BROADCAST, FANOUT, SEND, p2p_receivers, wire_ops
from .topology import layout_for
from .transfer.route import Route

PER_RANK_TABLE_UPTO = 16   # worlds up to this many ranks get the per-rank table by default


@dataclass(frozen=True)
class Inspection:
    plan: LoadPlan                  # the whole job's
    route: Route
    plan_seconds: float = 0.0       # CPU seconds of the rank's planning (what it spends in the load)
    plan_peak_bytes: int = 0        # growth of this process's peak RSS while the rank planned
    mtp: dict | None = None         # the report's `mtp`: the checkpoint's MTP layers, loaded or skipped
    rank_plan: LoadPlan | None = None   # what the rank plans in the load (None: the whole plan)
    rank: int = 0


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def inspect_load(path: str, options: LoadOptions, world: int | None = None,
                 local_world: int | None = None, rank: int = 0) -> Inspection:
    """The plan and route of a load of `path` by `options` on `world` ranks (default tp), `local_world` per
    node (default all on one node), by the same source and route decision as the load; `rank`'s planning
    as the load does it (timed), then the whole job's plan."""
    world = (options.tp or 1) * options.pp if world is None else world
    local_world = world if local_world is None else local_world
    layout = layout_for(world, local_world, options)   # refuses what a load would refuse (topology.check_world)
    _check_rank(rank, world)
    source = source_for(path, options)
    found = source.discover()
    rss0, cpu0 = _rss_bytes(), time.process_time()
    mine = source.plan(found, layout, rank=rank)
    seconds = time.process_time() - cpu0
    peak = max(0, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss0)
    plan = source.plan(found, layout) if mine.planned_for is not None else mine
    route, _ = decide_route(source, found, plan, options.device or "cpu", rank, options)
    return Inspection(plan, route, seconds, peak, source.report_extra(found, plan).get("mtp"),
                      rank_plan=mine, rank=rank)


def _check_rank(rank: int, world: int) -> None:
    if not 0 <= rank < world:
        raise DistloadError(f"--rank {rank}: the world has ranks 0..{world - 1}")


def rank_traffic(plan: LoadPlan, rank: int) -> dict:
    """What `rank` posts during the bucketed transfer (shared memory off): its ops by kind, and its bytes. Bytes
    count once per rank they reach, on both sides: a broadcast's root sends its bytes to each of the other ranks
    (as a fan-out's leader does to its group), so the job's bytes sent equal its bytes received."""
    counts = {"sends": 0, "receives": 0, "broadcasts": 0, "fanouts": 0}
    sent = received = read = 0
    world = plan.layout.world
    for b in plan.buckets:
        read += b.read_bytes if b.reader == rank else 0
        for op in wire_ops(plan, b, rank, False):
            if op.kind == BROADCAST:
                counts["broadcasts"] += 1
                if rank == b.reader:
                    sent += op.nbytes * (world - 1)
                else:
                    received += op.nbytes
            elif op.kind == FANOUT:
                counts["fanouts"] += 1
                sent += op.nbytes * (op.group.count - 1) if op.peer == rank else 0
                received += op.nbytes if op.peer != rank else 0
            elif op.kind == SEND:
                counts["sends"] += 1
                sent += op.nbytes
            else:
                counts["receives"] += 1
                received += op.nbytes
    return {**counts, "messages": sum(counts.values()), "bytes_read": read, "bytes_sent": sent,
            "bytes_received": received}


def job_totals(plan: LoadPlan) -> dict:
    """The job's messages and bytes, from the buckets alone (no pass over ranks): point-to-point messages
    (one per leader and bucket, shared memory off), broadcasts, fan-outs, and bytes crossing nodes."""
    layout = plan.layout
    node, lw = layout.node, layout.local_world if not layout.one_node else 0
    p2p = broadcasts = fanouts = crossing = 0
    for b in plan.buckets:
        if b.broadcast:
            broadcasts += 1 if layout.world > 1 else 0
            crossing += b.read_bytes * (layout.world - (lw or layout.world)) if lw else 0
            continue
        p2p += len(p2p_receivers(b))
        for g, n in b.groups:
            leader = g.nearest(b.reader)
            if lw and node(leader) != node(b.reader):
                crossing += n
            if g.count > 1 and n:
                fanouts += 1
                crossing += n * (g.count - g.on_node(node(leader), lw)) if lw else 0
    return {"buckets": len(plan.buckets), "p2p_messages": p2p, "broadcasts": broadcasts, "fanouts": fanouts,
            "bytes_read": plan.checkpoint_bytes, "bytes_crossing_nodes": crossing}


def describe_plan(plan: LoadPlan, route: Route, rank: int = 0, per_rank: bool | None = None,
                  inspection: Inspection | None = None) -> str:
    """The route with its reason, the job's totals, what `rank` plans, moves and holds; then (small worlds,
    or per_rank) a table: per rank, params held, bytes kept, read, received, experts hosted (global ids,
    the same in every MoE layer) and the bytes of expert params among those kept."""
    layout = plan.layout
    _check_rank(rank, layout.world)
    totals = job_totals(plan)
    lines = [f"family {plan.family}: world {layout.world}, tp {layout.tp}, "
             + (f"pp {layout.pp}, " if layout.pp > 1 else "") + f"ep {layout.ep}, "
             + (f"readers {list(layout.readers)}" if len(layout.readers) <= 16 else f"{len(layout.readers)} readers"),
             f"checkpoint tensors {len(plan.sources)}, bytes {plan.checkpoint_bytes:,}, buckets {len(plan.buckets)}"]
    if plan.ignored:
        lines.append(f"ignored by rule: {len(plan.ignored)} tensor(s)")
    if inspection is not None and inspection.mtp and mtp.describe(inspection.mtp):
        lines.append(mtp.describe(inspection.mtp))
    if plan.quantization:
        lines.append(f"quantization: {plan.quantization}; 'keeps bytes' are the params after post-load steps")
    lines += stage_lines(plan)
    lines.append(route.describe())
    if not layout.one_node:
        crossing = totals["bytes_crossing_nodes"]
        how = "each node's reader reads the rows its own ranks keep; " if layout.reads_by_node else ""
        lines.append(f"{layout.world // layout.local_world} nodes: {how}{crossing:,} bytes cross between nodes "
                     f"({crossing / max(1, plan.checkpoint_bytes):.0%} of the checkpoint)")
    lines.append(f"job: {totals['p2p_messages']:,} point-to-point messages, {totals['broadcasts']:,} broadcasts, "
                 f"{totals['fanouts']:,} fan-outs to replicas, {totals['bytes_read']:,} bytes read from storage")
    own = inspection.rank_plan if inspection is not None and inspection.rank == rank else None
    mine = rank_traffic(own or plan, rank)   # the rank's plan gives the same (tests/test_rank_plans.py)
    cost = (f"its planning {inspection.plan_seconds:.2f} CPU s, peak +{inspection.plan_peak_bytes / 2**20:.0f} MiB"
            + (f" ({len(own.sources):,} sources, {len(own.buckets):,} buckets of its block's part); "
               if own is not None and own.planned_for is not None else "; ")
            if own is not None else "")
    lines.append(f"rank {rank} of {layout.world} as planned (no process started): {cost}{mine['messages']:,} messages "
                 f"({mine['sends']:,} sends, {mine['receives']:,} receives, {mine['broadcasts']:,} broadcasts, "
                 f"{mine['fanouts']:,} fan-outs); it would read {mine['bytes_read']:,} B, send "
                 f"{mine['bytes_sent']:,} B, receive {mine['bytes_received']:,} B (bytes counted once per rank they "
                 f"reach), keep {_kept(plan, rank):,} B")
    if per_rank if per_rank is not None else layout.world <= PER_RANK_TABLE_UPTO:
        lines += _per_rank_table(plan, route)
    return "\n".join(lines)


def stage_split(plan: LoadPlan) -> list[dict]:
    """Per pipeline stage: its layers [first, end), the params one copy of the stage holds (over its tp ranks),
    the bytes those ranks keep, and the checkpoint bytes the stage takes (a tied embedding counts on each stage
    that holds it)."""
    layout, out = plan.layout, []
    for s in range(layout.pp):
        ranks = [s * layout.tp + t for t in range(layout.tp)]   # the stage's first data-parallel copy
        layers = layout.stage_layers(s, sum(layout.pp_layers)) if layout.pp_layers else None
        names = {n for r in ranks for n in plan.specs[r]}
        taken = sum(src.nbytes for src in plan.sources.values()
                    if any(r in share.ranks for share in src.shares for r in ranks))
        out.append({"stage": s, "layers": [layers.start, layers.stop] if layers is not None else None,
                    "params": len(names), "keeps_bytes": sum(_kept(plan, r) for r in ranks),
                    "checkpoint_bytes": taken})
    return out


def stage_lines(plan: LoadPlan) -> list[str]:
    """The per-stage split (inspect --pp P), one line per stage."""
    if plan.layout.pp == 1:
        return []
    layout = plan.layout
    lines = [f"pipeline: {layout.pp} stages, layers per stage {','.join(map(str, layout.pp_layers))} "
             f"({layout.pp_layers_from})"]
    for st in stage_split(plan):
        a, b = st["layers"]
        lines.append(f"  stage {st['stage']}: layers {a}..{b - 1} ({b - a}), {st['params']} params, keeps "
                     f"{st['keeps_bytes']:,} B over its tp ranks, takes {st['checkpoint_bytes']:,} B of the checkpoint")
    return lines


def _kept(plan: LoadPlan, rank: int) -> int:
    return sum(s.nbytes for s in plan.specs[rank].values() if not s.alias_of)


def _per_rank_table(plan: LoadPlan, route: Route) -> list[str]:
    staged = plan.layout.pp > 1   # the stage column only where there are stages (scripts read the columns)
    stage_col = f"{'stage':>5} " if staged else ""
    lines = [f"{'rank':>4} {stage_col}{'params':>7} {'keeps bytes':>15} {'reads bytes':>15} {'receives bytes':>15} "
             f"{'expert bytes':>15}  experts"]
    for r in range(plan.layout.world):
        specs = plan.specs[r]
        if route.kind == "owner-reads":
            reads, receives = plan.owned_bytes(r), 0
        else:
            reads = sum(b.read_bytes for b in plan.buckets if b.reader == r)
            receives = sum(b.recv_bytes[r] for b in plan.buckets if b.reader != r)
        experts = sorted({e for s in specs.values() for e in s.experts})
        expert_bytes = sum(s.nbytes for s in specs.values() if s.style == "expert")
        stage = f"{plan.layout.pp_rank(r):>5} " if staged else ""
        lines.append(f"{r:>4} {stage}{len(specs):>7} {_kept(plan, r):>15,} {reads:>15,} {receives:>15,} "
                     f"{expert_bytes:>15,}  {_ranges(experts) if experts else '-'}")
    return lines


def _ranges(ids: list[int]) -> str:
    out, start = [], None
    for i, e in enumerate(ids):
        if start is None:
            start = e
        if i + 1 == len(ids) or ids[i + 1] != e + 1:
            out.append(f"{start}" if start == e else f"{start}-{e}")
            start = None
    return ",".join(out)


def prediction_lines(plan: LoadPlan, cluster: str) -> str:
    """`inspect --cluster`: distload's and every-rank-reads' predicted load times (plan/predict.py) on the
    cluster the text describes, its nodes and GPUs per node those of the plan's layout."""
    layout = plan.layout
    spec = parse_cluster(cluster, nodes_of(plan), layout.world if layout.one_node else layout.local_world)
    return "\n".join(describe_prediction(predict(plan, spec), spec, plan.checkpoint_bytes))
