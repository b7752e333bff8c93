"""THE load pipeline (DESIGN §2), the same for every source (sources.py): topology, discover, plan, route,
transfer, postprocess, reconcile, hand off. Every phase ends with an agreement step (transfer/agreement.py),
so a failure on any rank reaches every rank and all of them exit together.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .transfer import host_memory
from . import topology
from .checkpoint import choose_strategy
from .checkpoint.dcp import is_dcp
from .checkpoint.s3 import is_object_url
from .deadline import within
from .transfer.delivery import transfer_phase
from .dtypes import torch_dtype
from .errors import PlanError
from .gc_freeze import with_earlier_objects_frozen
from .serving.export import check_save_for_layout, check_save_for_model, export, resolve_save_for, serves_line
from .checkpoint.integrity import finite_verdict, nonfinite
from .rules.names import describe
from .options import LoadOptions
from .plan import LoadPlan, ParamSpec
from .postprocess import PostProcess
from .reconcile import Verdict, reconcile
from .report import PhaseClock, build_report, rank_record, saved_line, summary_line, write_report
from .sharded.manifest import is_sharded_save
from .sharded.reload import ShardedSource
from .sharded.save import save_sharded
from .sources import Source
from .sources.checkpoint import CheckpointSource
from .sources.dcp import DcpSource
from .sources.object_store import ObjectStoreSource
from .transfer import outcome, shared_from_rank0
from .transfer.agreement import plan_digest, run_phase, verdict_everywhere
from .transfer.pull import why_not_usable
from .transfer.route import Route, choose_route, reading_ranks
from .validate import validate_load_options

log = logging.getLogger("distload")


@dataclass
class LoadResult:
    """What one rank holds after a load: params by serving name, their specs, and the job's report."""
    params: dict[str, torch.Tensor]
    specs: dict[str, ParamSpec]
    report: dict
    plan: LoadPlan = field(repr=False)   # this rank's: its block's part of the job when plan.planned_for is set
    verdict: Verdict | None = None
    config: dict = field(default_factory=dict, repr=False)
    rank: int = 0
    version: int = 0          # advanced by distload.refit once every rank acknowledged an update
    options: LoadOptions | None = field(default=None, repr=False)   # what it was loaded with (a refit's quantize)


def allocate(specs: dict[str, ParamSpec], device, huge: bool = False) -> dict[str, torch.Tensor]:
    """Preallocated, contiguous params; a tied alias is the same tensor object as its target.
    huge: huge-page host memory (host_memory.empty; Tuning.hugepages, DISTLOAD_HUGEPAGES=1)."""
    params = {}
    for name, spec in specs.items():
        if not spec.alias_of:
            params[name] = host_memory.empty(spec.local_shape, torch_dtype(spec.dtype), device, huge=huge)
    for name, spec in specs.items():
        if spec.alias_of:
            params[name] = params[spec.alias_of]
    return params


def check_into(into: dict[str, torch.Tensor], specs: dict[str, ParamSpec]) -> dict[str, torch.Tensor]:
    """Use the caller's tensors as destinations; their names, shapes must match the plan exactly."""
    missing = sorted(set(specs) - set(into))
    if missing:
        raise PlanError(f"the module has no param for {describe(missing)}; build it with the serving layout's names")
    problems = []
    for name, spec in specs.items():
        t = into[name]
        if tuple(t.shape) != tuple(spec.local_shape):
            problems.append(f"{name}: module shape {list(t.shape)}, this rank's shard {list(spec.local_shape)}")
        elif not t.is_contiguous():
            problems.append(f"{name}: module tensor is not contiguous")
        elif spec.alias_of and t is not into.get(spec.alias_of):
            problems.append(f"{name}: config.json ties it to {spec.alias_of}, but the module holds a separate tensor; "
                            f"tie them in the module (the checkpoint stores one)")
    if problems:
        raise PlanError("module params do not match the plan: " + "; ".join(problems[:10]))
    return dict(into)


def destinations(plan: LoadPlan, rank: int, device, into: dict | None, huge: bool = False):
    """(params, post): what the transfer writes into (the caller's tensors when `into` is given) and the
    post-load steps (postprocess.py; None without any), which run as their inputs land and allocate them."""
    specs = plan.specs[rank]
    checked = None if into is None else check_into(into, specs)
    if any(plan.post):
        post = PostProcess(plan, rank, device, huge)
        return post.allocate(checked), post
    return (allocate(specs, device, huge) if checked is None else checked), None


def source_for(path: str, options: LoadOptions) -> Source:
    """The source of a load at `path`: a checkpoint in object storage (s3://), a distload save (a manifest, or
    the remains of one), a DCP directory, or a Hugging Face / legacy checkpoint."""
    if is_object_url(path):
        return ObjectStoreSource(path, options)
    if is_sharded_save(path):
        return ShardedSource(path, options)
    if is_dcp(path):
        return DcpSource(path, options)
    return CheckpointSource(path, options)


@with_earlier_objects_frozen  # a full collection over torch's objects took 100 ms of the first plan (gc_freeze.py)
def run_load(path: str, options: LoadOptions, *, into: dict[str, torch.Tensor] | None = None) -> LoadResult:
    """Load `path` onto this rank by `options` (every rank of the job calls it); `into`: the caller's tensors."""
    validate_load_options(str(path), options)  # the save not inside the checkpoint: before any rendezvous
    # --for ENGINE: its version (named, or the installed engine's) and a naming profile for it, before any read
    options = options.replace(save_for=resolve_save_for(options.save_for))
    clock = PhaseClock()
    source = source_for(str(path), options)
    topo = topology.from_environment(options)
    rank, early = topo.rank, None

    def discover():
        nonlocal early
        found = source.discover()
        early = source.early_fetch(found, topo.layout)
        return found

    # Rank 0 reads the headers before the rendezvous, where it would otherwise wait for ranks still
    # starting up; what it read, or the error, reaches every rank in the discover phase.
    headers = None
    if rank == 0:
        headers = outcome(discover)
        clock.lap("discover")
    topology.init_process_group(topo)
    clock.lap("topology", waited=True)   # the rendezvous: waiting for the job's other ranks to start
    found = run_phase("discover", lambda: shared_from_rank0(headers), clock=clock)
    origin = source.origin(found)
    check_save_for_model(options.save_for, origin.config)   # the engine serves this model's save: before any read
    clock.lap("discover")

    def plan_within_timeout():
        # Each rank plans its block's part (build_plan's rank mode), sharded saves too: their manifest lists the
        # original tensors from plan.received and each rank's params from the records rank 0 gathers.
        with within(options.timeout_s, "planning"):
            return source.plan(found, topo.layout, rank=rank)

    plan = run_phase("planning", plan_within_timeout, digest=plan_digest, clock=clock)
    specs = plan.specs[rank]
    for note in plan.notes:
        log.info(note)
    check_save_for_layout(options.save_for, plan.layout.world, plan.layout.tp)  # before a byte moves
    clock.lap("plan")
    record = source.before_transfer(found, plan, rank, clock)

    params, post = run_phase("allocate", lambda: destinations(plan, rank, topo.device, into,
                                                              options.tuning.hugepages), clock=clock)
    clock.lap("allocate")

    route, strategy = decide_route(source, found, plan, topo.device, rank, options)
    reader, transfer, route = transfer_phase(
        plan, rank, params, topo.device, route=route, progress=options.progress,
        open_reader=lambda: source.open_reader(found, plan, rank, strategy, plan.layout.reads_by_node),
        on_bucket_done=post and post.on_bucket_done, after_transfer=lambda r: record.update(source.after_transfer(r)),
        shm=options.tuning.shm, clock=clock)
    clock.lap("transfer")
    record.update(source.after_landing(found, plan, rank, clock))
    written = transfer.stats.written
    if post is not None:  # steps not run during the transfer; the written record carried to the final params
        written = run_phase("postprocess", lambda: post.finish(transfer.stats.written), clock=clock)
        clock.lap("postprocess")

    record.update(rank_record(rank, transfer.stats, reader, topo.device))
    # Joined here, long after it finished (it only asks); after a failed phase its daemon thread ends alone.
    record["early_fetch_bytes"] = early.close() if early is not None else 0
    if post is not None:
        record.update(post.report())
    verdict = run_phase("reconcile", lambda: reconcile(plan, rank, params, written, strict=options.strict,
                                                       report_record=record), clock=clock)
    clock.lap("reconcile")
    if options.check_finite:  # every source: each rank scans its own params for NaN/Inf
        verdict_everywhere("check-finite", lambda: nonfinite(params, specs), finite_verdict)
        clock.lap("check-finite")
    extra = {**source.report_extra(found, plan, verdict.rank_reports), "route": route.as_dict(),
             "tuning": options.tuning.as_dict()}
    report = build_report(plan, verdict.rank_reports, clock.as_dict(), verdict, source=origin.root, extra=extra,
                          waiting=clock.waiting_dict())
    result = LoadResult(params=params, specs=specs, report=report, plan=plan, verdict=verdict, config=origin.config,
                        rank=rank, options=options)
    return hand_off(result, clock, origin, options)


def decide_route(source: Source, found, plan: LoadPlan, device: str, rank: int,
                 options: LoadOptions) -> tuple[Route, str]:
    """(route, read strategy) of `rank` (the load's and `distload inspect`'s): the strategy depends on how
    many ranks of the node read the files, node pulls on the strategy (not around the page cache) and on
    the OS (pull.py)."""
    blocker = source.copy_blocker(found, plan)
    route = choose_route(plan, device=device, source_blocker=blocker)
    origin, layout = source.origin(found), plan.layout
    if not origin.local:
        strategy = None   # object storage: ranged GETs, no file system to choose a strategy for
    elif options.read_strategy:
        strategy = options.read_strategy
        log.info("read strategy %s: forced by --read-strategy", strategy)
    else:
        strategy, _ = choose_strategy(origin.root, origin.total_bytes or plan.checkpoint_bytes, device,
                                      layout.local_world, reading_ranks(route.kind, layout, rank))  # logs its reason
    if route.kind == "node-pulls":
        refused = why_not_usable(options.tuning.pull, strategy)
        route = choose_route(plan, device=device, source_blocker=blocker, pulls_refused=refused)
    if route.kind == "wire" and plan.layout.owner_reads and plan.layout.world > 1:
        log.info("%s", route.reason)  # owners asked for, but not possible here: say why
    return route, strategy


def hand_off(result: LoadResult, clock: PhaseClock, origin, options: LoadOptions) -> LoadResult:
    """The last phase: the sharded save (collective) if asked, then the report file and rank 0's summary line."""
    if options.save_sharded:
        save_sharded(options.save_sharded, result.rank, result.params, result.specs, result.plan, origin.config,
                     origin.source, origin.checkpoint_tensors)
        clock.lap("save")
        if options.save_for:  # rank 0 writes vLLM's files beside the saved ones; every rank waits
            out, engine = options.save_sharded, options.save_for
            run_phase(f"save for {engine}", lambda: export(engine, out) if result.rank == 0 else None)
            clock.lap(f"save for {engine}")
        result.report["seconds"], result.report["waiting"] = clock.as_dict(), clock.waiting_dict()
        result.report["saved_to"] = str(Path(options.save_sharded).absolute())
    if result.rank == 0:
        if options.report:
            write_report(result.report, options.report)
        print(summary_line(result.report), flush=True)
        if options.save_sharded:
            serves = options.save_for and serves_line(options.save_for, result.report["saved_to"], result.report["tp"])
            print(saved_line(result.report, serves), flush=True)
    return result
