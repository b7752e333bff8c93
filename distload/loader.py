"""One load, phase by phase (DESIGN §2): topology, discover, rules, plan, transfer, postprocess,
reconcile, hand off. Every phase ends with an agreement step, so a failure on any rank reaches every
rank and all of them exit together.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from . import host_memory
from . import topology as topo_mod
from .checkpoint import RangeReader, choose_strategy, discover
from .checkpoint.early_fetch import start_early_fetch
from .dtypes import torch_dtype
from .errors import CheckpointError, PlanError
from .gc_freeze import with_earlier_objects_frozen
from .integrity import checksum_verdict, finite_verdict, hash_while_reading, listing_problems, nonfinite
from .owner_reads import OwnerReads
from .plan import DEFAULT_STAGING_BYTES, LoadPlan, ParamSpec, build_plan
from .postprocess import PostProcess
from .reconcile import Verdict, reconcile
from .report import PhaseClock, Progress, build_report, rank_record, summary_line, write_report
from .rules import rules_for
from .transfer import (NodePulls, Transfer, agree, agree_on_planning, all_gather_objects, outcome, shared_from_rank0,
                       zero_padding)

log = logging.getLogger("distload")


@dataclass
class LoadResult:
    """What one rank holds after a load: params by serving name, their specs, and the job's report."""
    params: dict[str, torch.Tensor]
    specs: dict[str, ParamSpec]
    report: dict
    plan: LoadPlan = field(repr=False)
    verdict: Verdict | None = None
    config: dict = field(default_factory=dict, repr=False)
    rank: int = 0
    version: int = 0          # advanced by distload.refit once every rank acknowledged an update


def _phase(name: str, fn):
    """Run one phase on this rank and agree on the outcome with every other rank."""
    result, error = None, None
    try:
        result = fn()
    except Exception as exc:  # every rank must reach the agreement step, whatever happened
        error = exc
    agree(name, error)
    return result


def _read_index(path: str, hf_config: str | None = None, rules_path: str | None = None):
    """The checkpoint's index (every tensor's file, dtype, shape, byte range) and config, read on rank 0 only:
    the other ranks get it as metadata (run_load: the discover phase) and never open the headers."""
    from .dcp import discover_dcp, is_dcp

    if is_dcp(path):  # torch.distributed.checkpoint directory; config.json from --hf-config
        index = discover_dcp(path, hf_config, rules_path)
    else:
        index = discover(path)
        if hf_config:
            from .checkpoint.discover import _read_config

            index = replace(index, config=_read_config(hf_config))
    if not index.config:  # every plan needs it (architectures, head counts): say so, not "unknown family"
        raise CheckpointError(f"{index.root}: config.json is missing or empty; distload plans from the "
                              "model's config (architectures, head counts, sizes): put the model's "
                              "config.json next to the weights, or pass --hf-config DIR")
    return index


def allocate(specs: dict[str, ParamSpec], device, huge: bool | None = None) -> dict[str, torch.Tensor]:
    """Preallocated, contiguous params; a tied alias is the same tensor object as its target.
    huge: huge-page host memory (host_memory.empty; default: DISTLOAD_HUGEPAGES=1)."""
    params = {}
    for name, spec in specs.items():
        if not spec.alias_of:
            params[name] = host_memory.empty(spec.local_shape, torch_dtype(spec.dtype), device, huge=huge)
    for name, spec in specs.items():
        if spec.alias_of:
            params[name] = params[spec.alias_of]
    return params


@with_earlier_objects_frozen  # a full collection over torch's objects took 100 ms of the first plan (gc_freeze.py)
def run_load(path: str, *, tp: int | None = None, ep: int = 1, readers="per-node", config: str | None = None,
             strict: bool = True, device: str | None = None, backend: str | None = None, timeout_s: float = 600.0,
             staging_mib: int | None = None, read_strategy: str | None = None, expert_placement: str = "linear",
             expert_map=None, save_sharded: str | None = None, report: str | None = None,
             into: dict[str, torch.Tensor] | None = None, progress: bool = True, reshard: bool = False,
             hf_config: str | None = None, checksums: bool = True, quantize: str | None = None,
             dequantize: bool = False, verify_checksums: bool = False, check_finite: bool = False) -> LoadResult:
    from .handoff import is_sharded_save, load_sharded

    if is_sharded_save(path):  # a --save-sharded directory: rank-local reload, or --reshard (handoff.py)
        # --verify-checksums there is the manifest's sha256 of every param's bytes (checked while reading).
        result = load_sharded(str(path), tp=tp, ep=ep, reshard=reshard, config=config, strict=strict, device=device,
                              backend=backend, timeout_s=timeout_s, staging_mib=staging_mib, read_strategy=read_strategy,
                              expert_placement=expert_placement, expert_map=expert_map,
                              checksums=checksums or verify_checksums, save_sharded=save_sharded, report=report,
                              into=into, progress=progress)
        if check_finite:
            _check_finite(result.params, result.specs)
        return result
    clock = PhaseClock()
    topo = topo_mod.from_environment(tp=tp, ep=ep, readers=readers, device=device, backend=backend,
                                     timeout_s=timeout_s, expert_placement=expert_placement, expert_map=expert_map)
    rank = topo.rank
    # Rank 0 reads the headers before the rendezvous, where it would otherwise wait for ranks still starting
    # up (tens to hundreds of ms under torchrun), and on one node asks storage for the checkpoint's start
    # right away (checkpoint/early_fetch.py; not around the page cache). What it read, or the error, reaches
    # every rank in the discover phase, as before.
    early = None

    def read_headers():
        nonlocal early
        index = _read_index(str(path), hf_config, config)
        if topo.layout.one_node and read_strategy != "odirect":
            early = start_early_fetch(index, topo.layout.local_world or topo.layout.world)
        return index

    headers = outcome(read_headers) if rank == 0 else None
    topo_mod.init_process_group(topo)
    clock.lap("topology")

    index = _phase("discover", lambda: shared_from_rank0(headers))
    clock.lap("discover")

    staging = int(staging_mib * (1 << 20)) if staging_mib else DEFAULT_STAGING_BYTES  # a fraction: small tests

    def make_plan():
        rules = rules_for(index.config, config)
        return build_plan(index.tensors, index.config, rules, topo.layout, strict=strict, staging_bytes=staging,
                          quantize=quantize, dequantize=dequantize)

    plan, error = None, None
    try:
        plan = make_plan()
    except Exception as exc:  # every rank must reach the agreement step, whatever happened
        error = exc
    agree_on_planning(error, plan)  # one collective: nobody failed, and every rank holds the same plan
    specs = plan.specs[rank]
    for note in plan.notes:
        log.info(note)
    clock.lap("plan")

    if verify_checksums:  # the checksums list is there and names every file; hashed as read (integrity.py)
        _verdict_everywhere("verify-checksums",
                            lambda: listing_problems(index.root, index.files, topo.layout.readers, rank),
                            lambda found: checksum_verdict(found, index.root))
        clock.lap("verify-checksums")

    post = None

    def make_params():
        nonlocal post
        if any(plan.post):  # post-load steps (postprocess.py) run as their inputs land, and allocate them
            post = PostProcess(plan, rank, topo.device)
            return post.allocate(None if into is None else _check_into(into, specs))
        if into is None:
            return allocate(specs, topo.device)
        return _check_into(into, specs)

    params = _phase("allocate", make_params)
    clock.lap("allocate")

    def open_reader():
        if read_strategy:
            strategy = read_strategy
            log.info("read strategy %s: forced by --read-strategy", strategy)
        else:
            layout = topo.layout
            # Owner reads and node pulls: every rank of the node reads; the bucketed transfer: its readers.
            reading = layout.local_world if owners or pulls else len(layout.readers_on(layout.node(topo.rank)))
            strategy, _ = choose_strategy(index.root, index.total_bytes, topo.device, layout.local_world,
                                          reading)  # logs its reason
        from .dcp import DcpIndex, DcpReader

        exact = topo.layout.reads_by_node
        reader = DcpReader(index, strategy, exact=exact) if isinstance(index, DcpIndex) else \
            RangeReader(index.root, strategy=strategy, exact=exact)
        if not verify_checksums:
            return reader
        reader, hashing[0] = hash_while_reading(reader, index.root, index.files, topo.layout.readers, rank)
        return reader

    hashing, checksum_found = [None], []  # --verify-checksums: this rank's HashingReader, what it found

    def finish_checksums(_reader):  # before the reader closes: the hashes read what the transfer skipped
        if hashing[0] is not None:
            checksum_found.extend(hashing[0].finish())

    # Direct copies bypass read_into, so --verify-checksums takes the bucketed transfer, where readers hash.
    owners, pulls = (False, False) if verify_checksums else _copy_path(plan, index, topo.device)
    reader, transfer = transfer_phase(plan, topo, params, open_reader, progress,
                                      on_bucket_done=post and post.on_bucket_done, owner_reads=owners, node_pulls=pulls,
                                      after_transfer=finish_checksums)
    clock.lap("transfer")
    if verify_checksums:
        _verdict_everywhere("verify-checksums", lambda: checksum_found, lambda found: checksum_verdict(found, index.root))
        clock.lap("verify-checksums")

    written = transfer.stats.written
    if post is not None:  # steps not run during the transfer; the written record carried to the final params
        written = _phase("postprocess", lambda: post.finish(transfer.stats.written))
        clock.lap("postprocess")

    record = rank_record(rank, transfer.stats, reader, topo.device)
    # Joined here, long after it finished (it only asks); after a failed phase its daemon thread ends alone.
    record["early_fetch_bytes"] = early.close() if early is not None else 0
    if verify_checksums:
        record["checksum_files_verified"] = hashing[0].files_verified() if hashing[0] else 0
    if post is not None:
        record.update(post.report())
    verdict = _phase("reconcile", lambda: reconcile(plan, rank, params, written, strict=strict, report_record=record))
    clock.lap("reconcile")
    if check_finite:
        _check_finite(params, specs)
        clock.lap("check-finite")
    per_rank = verdict.rank_reports
    result_report = build_report(plan, per_rank, clock.as_dict(), verdict, source=str(index.root),
                                 extra={"quantization": plan.quantization})
    result = LoadResult(params=params, specs=specs, report=result_report, plan=plan, verdict=verdict,
                        config=index.config, rank=rank)

    def save():
        from .handoff import save_sharded as save_to

        save_to(save_sharded, rank, params, specs, plan, index.config, str(index.root))
    return hand_off(result, clock, save if save_sharded else None, save_sharded, report)


def _copy_path(plan: LoadPlan, index, device: str) -> tuple[bool, bool]:
    """(owner reads, node pulls): how bytes reach params that take them as they are, when they can.

    --readers owners: every rank copies its own pieces from the files (owner_reads.py). Otherwise, when
    every rank is on one node, ranks copy their pieces from the files their reader opened
    (transfer/node_pull.py). Both copy safetensors bytes into host params as they are; anything else
    takes the bucketed transfer (for owners the log says why)."""
    why = _direct_copy_blocker(plan, index, device)
    if plan.layout.owner_reads:
        if why and plan.layout.world > 1:  # alone, the bucketed path is the same contract: nothing to say
            log.info("--readers owners: not here (%s); every rank reads its share of the buckets instead", why)
        return why is None, False
    return False, why is None and plan.layout.one_node and plan.layout.world > 1


def _direct_copy_blocker(plan: LoadPlan, index, device: str) -> str | None:
    """Why the bytes cannot be copied from the files into the params as they are (None: they can)."""
    from .checkpoint.legacy import is_legacy_file
    from .dcp import DcpIndex

    why = None
    if any(plan.post):
        why = "post-load steps (quantization) run per bucket"
    elif isinstance(index, DcpIndex):
        why = "a torch.distributed.checkpoint directory is read chunk by chunk"
    elif any(is_legacy_file(src.file) for src in plan.sources.values()):
        why = "torch.load files are unpickled whole"
    elif not device.startswith("cpu"):
        why = f"params on {device} need a host buffer between the file and the device"
    return why


def transfer_phase(plan: LoadPlan, topo, params: dict[str, torch.Tensor], open_reader, progress: bool,
                   on_bucket_done=None, after_transfer=None, owner_reads: bool = False, node_pulls: bool = False):
    """Phase 5 on this rank: a rank with buckets to read opens its reader, every rank runs the transfer
    (or, owner_reads, copies its own pieces from the files: owner_reads.py; or, node_pulls, from the
    files its reader opened: transfer/node_pull.py), padding is zeroed, and all ranks agree; returns
    (reader, transfer) for the report."""
    rank = topo.rank
    reader, transfer = None, None

    def move():
        nonlocal reader, transfer
        if owner_reads or node_pulls or any(b.reader == rank for b in plan.buckets):
            reader = open_reader()  # with node pulls, the other ranks read through descriptors they borrow
        if owner_reads:
            transfer = OwnerReads(plan, rank, params, reader)
            transfer.run()
        elif node_pulls:
            transfer = NodePulls(plan, rank, params, reader)
            if transfer.run() is None:  # a reader cannot serve pulls (logged): every rank takes the buckets
                transfer = None
        if transfer is None:
            bar = Progress(plan.checkpoint_bytes, enabled=progress and rank == 0)
            transfer = Transfer(plan, rank, params, reader=reader, device=topo.device,
                                progress=bar if rank == 0 else None, on_bucket_done=on_bucket_done)
            transfer.run()
        zero_padding(params, plan.staging_specs(rank), transfer.stats)
        if transfer.error is not None:
            raise transfer.error
        if after_transfer is not None:
            after_transfer(reader)

    try:
        _phase("transfer", move)
    finally:
        if reader is not None:
            reader.close()
    return reader, transfer


def hand_off(result: LoadResult, clock: PhaseClock, save, save_to: str | None, report_path: str | None) -> LoadResult:
    """Phase 8: the sharded save (collective) if asked, then the report file and rank 0's summary line."""
    if save is not None:
        save()
        clock.lap("save")
        result.report["seconds"] = clock.as_dict()
        result.report["saved_to"] = str(Path(save_to).absolute())
    if result.rank == 0:
        if report_path:
            write_report(result.report, report_path)
        print(summary_line(result.report), flush=True)
    return result


def _check_finite(params: dict[str, torch.Tensor], specs: dict[str, ParamSpec]) -> None:
    """--check-finite: each rank scans its own params for NaN/Inf."""
    _verdict_everywhere("check-finite", lambda: nonfinite(params, specs), finite_verdict)


def _verdict_everywhere(phase: str, scan, verdict) -> None:
    """Each rank runs `scan`; what every rank found makes one verdict, raised identically on every rank."""
    message = verdict(all_gather_objects(_phase(phase, scan)))
    if message is not None:
        raise CheckpointError(message)


def _check_into(into: dict[str, torch.Tensor], specs: dict[str, ParamSpec]) -> dict[str, torch.Tensor]:
    """Use the caller's tensors as destinations; their names, shapes must match the plan exactly."""
    missing = sorted(set(specs) - set(into))
    if missing:
        from .names import describe

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
