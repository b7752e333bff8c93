"""`distload inspect`: the plan without a process group — what each rank will hold, and bytes moved."""

from __future__ import annotations

from .checkpoint import discover
from .plan import DEFAULT_STAGING_BYTES, LoadPlan, build_plan
from .rules import rules_for
from .topology import Layout, owner_reads, reader_ranks


def inspect_plan(path: str, tp: int | None = None, ep: int = 1, world: int | None = None, readers="per-node",
                 local_world: int | None = None, config: str | None = None, strict: bool = True,
                 staging_mib: int | None = None, expert_placement: str = "linear", expert_map=None,
                 quantize: str | None = None, dequantize: bool = False) -> LoadPlan:
    world = world or tp or 1
    index = discover(path)
    layout = Layout(world=world, tp=tp or world, ep=ep, readers=reader_ranks(world, local_world or world, readers),
                    local_world=local_world or world, expert_placement=expert_placement,
                    owner_reads=owner_reads(world, readers),
                    expert_map=tuple(tuple(x) for x in expert_map) if expert_map is not None else None)
    rules = rules_for(index.config, config)
    return build_plan(index.tensors, index.config, rules, layout, strict=strict,
                      staging_bytes=(staging_mib << 20) if staging_mib else DEFAULT_STAGING_BYTES,
                      quantize=quantize, dequantize=dequantize)


def describe_plan(plan: LoadPlan) -> str:
    """A human table: per rank, params held, bytes kept, bytes read, bytes received, experts hosted (global ids,
    the same in every MoE layer) and the bytes of expert params among those kept."""
    layout = plan.layout
    lines = [f"family {plan.family}: world {layout.world}, tp {layout.tp}, ep {layout.ep}, readers {list(layout.readers)}",
             f"checkpoint tensors {len(plan.sources)}, bytes {plan.checkpoint_bytes:,}, buckets {len(plan.buckets)}"]
    if plan.ignored:
        lines.append(f"ignored by rule: {len(plan.ignored)} tensor(s)")
    if plan.quantization:
        lines.append(f"quantization: {plan.quantization}; 'keeps bytes' are the params after post-load steps")
    owners = layout.owner_reads and not any(plan.post)
    if owners and layout.world > 1:
        lines.append("owner reads (--readers owners): each rank copies its own pieces from the files; nothing is sent")
    elif layout.world > 1 and layout.one_node and not any(plan.post):
        lines.append("one node: with params in host memory each rank copies what it 'receives' straight from the "
                     "files its reader opened (node pulls; DISTLOAD_PULL=0: through the reader's shared staging)")
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
        if owners:
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
