"""One load, phase by phase (DESIGN §2): topology, discover, rules, plan, transfer, postprocess,
reconcile, hand off. Every phase ends with an agreement step, so a failure on any rank reaches every
rank and all of them exit together.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import topology as topo_mod
from .checkpoint import RangeReader, choose_strategy, discover
from .dtypes import torch_dtype
from .errors import DistloadError, PlanError
from .plan import DEFAULT_STAGING_BYTES, LoadPlan, ParamSpec, build_plan
from .reconcile import Verdict, reconcile
from .report import PhaseClock, Progress, build_report, rank_record, summary_line, write_report
from .rules import rules_for
from .transfer import Transfer, agree, all_gather_objects, broadcast_object, zero_padding

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


def _phase(name: str, fn):
    """Run one phase on this rank and agree on the outcome with every other rank."""
    result, error = None, None
    try:
        result = fn()
    except Exception as exc:  # every rank must reach the agreement step, whatever happened
        error = exc
    agree(name, error)
    return result


def _discover_on_rank0(path: str, rank: int, config_override: dict | None):
    """Headers are parsed once, on rank 0, and shared as metadata: no other rank opens them."""
    payload = None
    if rank == 0:
        try:
            index = discover(path)
            payload = ("ok", index)
        except Exception as exc:
            payload = ("error", exc)
    kind, value = broadcast_object(payload, src=0)
    if kind == "error":
        raise value
    return value


def allocate(specs: dict[str, ParamSpec], device) -> dict[str, torch.Tensor]:
    """Preallocated, contiguous params; a tied alias is the same tensor object as its target."""
    params = {}
    for name, spec in specs.items():
        if not spec.alias_of:
            params[name] = torch.empty(spec.local_shape, dtype=torch_dtype(spec.dtype), device=device)
    for name, spec in specs.items():
        if spec.alias_of:
            params[name] = params[spec.alias_of]
    return params


def run_load(path: str, *, tp: int | None = None, ep: int = 1, readers="per-node", config: str | None = None,
             strict: bool = True, device: str | None = None, backend: str | None = None, timeout_s: float = 600.0,
             staging_mib: int | None = None, read_strategy: str | None = None, expert_placement: str = "linear",
             expert_map=None, save_sharded: str | None = None, report: str | None = None,
             into: dict[str, torch.Tensor] | None = None, progress: bool = True) -> LoadResult:
    clock = PhaseClock()
    topo = topo_mod.from_environment(tp=tp, ep=ep, readers=readers, device=device, backend=backend,
                                     timeout_s=timeout_s, expert_placement=expert_placement, expert_map=expert_map)
    topo_mod.init_process_group(topo)
    rank = topo.rank
    clock.lap("topology")

    index = _phase("discover", lambda: _discover_on_rank0(str(path), rank, None))
    clock.lap("discover")

    staging = (staging_mib << 20) if staging_mib else DEFAULT_STAGING_BYTES

    def make_plan():
        rules = rules_for(index.config, config)
        return build_plan(index.tensors, index.config, rules, topo.layout, strict=strict, staging_bytes=staging)

    plan = _phase("planning", make_plan)
    specs = plan.specs[rank]
    for note in plan.notes:
        log.info(note)
    clock.lap("plan")

    def make_params():
        if into is None:
            return allocate(specs, topo.device)
        return _check_into(into, specs)

    params = _phase("allocate", make_params)
    clock.lap("allocate")

    reader, transfer = None, None

    def move():
        nonlocal reader, transfer
        if topo.is_reader:
            if read_strategy:
                strategy = read_strategy
                log.info("read strategy %s: forced by --read-strategy", strategy)
            else:
                strategy, _ = choose_strategy(index.root, index.total_bytes)  # logs its reason
            reader = RangeReader(index.root, strategy=strategy)
        bar = Progress(plan.checkpoint_bytes, enabled=progress and rank == 0)
        transfer = Transfer(plan, rank, params, reader=reader, device=topo.device,
                            progress=bar if rank == 0 else None)
        transfer.run()
        zero_padding(params, specs, transfer.stats)
        if transfer.error is not None:
            raise transfer.error

    try:
        _phase("transfer", move)
    finally:
        if reader is not None:
            reader.close()
    clock.lap("transfer")

    verdict = _phase("reconcile", lambda: reconcile(plan, rank, params, transfer.stats.written, strict=strict))
    clock.lap("reconcile")

    per_rank = all_gather_objects(rank_record(rank, transfer.stats, reader, topo.device))
    result_report = build_report(plan, per_rank, clock.as_dict(), verdict, source=str(index.root))
    result = LoadResult(params=params, specs=specs, report=result_report, plan=plan, verdict=verdict,
                        config=index.config, rank=rank)
    if save_sharded:
        from .handoff import save_sharded as save

        save(save_sharded, rank, params, specs, plan, index.config, str(index.root))
        clock.lap("save")
        result_report["seconds"] = clock.as_dict()
        result_report["saved_to"] = str(Path(save_sharded).absolute())
    if rank == 0:
        if report:
            write_report(result_report, report)
        print(summary_line(result_report), flush=True)
    return result


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
