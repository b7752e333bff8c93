"""`distload inspect`: the plan without a process group — what each rank will hold, and bytes moved."""

from __future__ import annotations

from dataclasses import dataclass

from .loader import decide_route, source_for
from .options import LoadOptions
from .plan import LoadPlan
from .topology import layout_for
from .transfer.route import Route


@dataclass(frozen=True)
class Inspection:
    plan: LoadPlan
    route: Route


def inspect_load(path: str, options: LoadOptions, world: int | None = None,
                 local_world: int | None = None) -> Inspection:
    """The plan and route of a load of `path` by `options` on `world` ranks (default tp), `local_world` per
    node (default all on one node), by the same source and route decision as the load."""
    world = world or options.tp or 1
    layout = layout_for(world, local_world or world, options)
    source = source_for(path, options)
    found = source.discover()
    plan = source.plan(found, layout)
    route, _ = decide_route(source, found, plan, options.device or "cpu", 0, options)
    return Inspection(plan, route)


def describe_plan(plan: LoadPlan, route: Route) -> str:
    """The route with its reason, then a human table: per rank, params held, bytes kept, bytes read, bytes received, experts hosted (global ids,
    the same in every MoE layer) and the bytes of expert params among those kept."""
    layout = plan.layout
    lines = [f"family {plan.family}: world {layout.world}, tp {layout.tp}, ep {layout.ep}, readers {list(layout.readers)}",
             f"checkpoint tensors {len(plan.sources)}, bytes {plan.checkpoint_bytes:,}, buckets {len(plan.buckets)}"]
    if plan.ignored:
        lines.append(f"ignored by rule: {len(plan.ignored)} tensor(s)")
    if plan.quantization:
        lines.append(f"quantization: {plan.quantization}; 'keeps bytes' are the params after post-load steps")
    lines.append(route.describe())
    if not layout.one_node:
        crossing = sum(plan.bytes_from_other_nodes(r) for r in range(layout.world))
        how = "each node's reader reads the rows its own ranks keep; " if layout.reads_by_node else ""
        lines.append(f"{layout.world // layout.local_world} nodes: {how}{crossing:,} bytes cross between nodes "
                     f"({crossing / max(1, plan.checkpoint_bytes):.0%} of the checkpoint)")
    header = (f"{'rank':>4} {'params':>7} {'keeps bytes':>15} {'reads bytes':>15} {'receives bytes':>15} "
              f"{'expert bytes':>15}  experts")
    lines.append(header)
    for r in range(layout.world):
        specs = plan.specs[r]
        keeps = sum(s.nbytes for s in specs.values() if not s.alias_of)
        if route.kind == "owner-reads":
            reads, receives = plan.owned_bytes(r), 0
        else:
            reads = sum(b.read_bytes for b in plan.buckets if b.reader == r)
            receives = sum((b.read_bytes if b.broadcast else b.recv_bytes[r]) for b in plan.buckets if b.reader != r)
        experts = sorted({e for s in specs.values() for e in s.experts})
        expert_bytes = sum(s.nbytes for s in specs.values() if s.style == "expert")
        lines.append(f"{r:>4} {len(specs):>7} {keeps:>15,} {reads:>15,} {receives:>15,} {expert_bytes:>15,}  "
                     f"{_ranges(experts) if experts else '-'}")
    return "\n".join(lines)


def _ranges(ids: list[int]) -> str:
    out, start = [], None
    for i, e in enumerate(ids):
        if start is None:
            start = e
        if i + 1 == len(ids) or ids[i + 1] != e + 1:
            out.append(f"{start}" if start == e else f"{start}-{e}")
            start = None
    return ",".join(out)
