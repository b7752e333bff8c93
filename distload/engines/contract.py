"""The plugin contract, engine-neutral: what any serving engine's plugin does to fill its model with distload.

An engine hands over its model's params by its own names (a naming profile maps them to distload's, serving/names.py)
and its instance's shape (rank, world, tp, pp, ep, expert placement, from the engine's own groups); the contract
plans this rank's params from that shape, refuses a param either side lacks (or of another shape or dtype) before
any weight byte is read, and fills every param in place by name, never through the engine's weight loaders (they
expect whole tensors). The engine's own post-processing (vLLM's process_weights_after_loading) then runs as usual.
One module per engine on top (vllm.py) says how to read its model, groups and config.
"""

from __future__ import annotations

import os
from contextlib import contextmanager

import torch

from ..dtypes import torch_dtype
from ..errors import PlanError
from ..inspect_cmd import inspect_load
from ..loader import run_load
from ..options import LoadOptions
from ..rules.names import describe
from ..serving.names import NamingProfile

ENGINE_NAMES = {"vllm": "vLLM"}   # how messages spell an engine


def destinations(model: torch.nn.Module, profile: NamingProfile):
    """(distload name -> the param's tensor, [(alias tensor, distload name)]): every param of the model under
    distload's name; an alias that is a separate tensor in the model gets a copy after the load."""
    by_name = dict(model.named_parameters(remove_duplicate=False))
    data_of: dict[int, torch.Tensor] = {}  # one destination per Parameter, so tied params stay one tensor
    into, copies = {}, []
    for name, param in by_name.items():
        if profile.leaves(name):   # the engine's own loader leaves it as made, unless a checkpoint tensor fills it
            continue
        target = profile.alias_target(name, by_name)
        if target is not None:
            if by_name[target] is not param:
                copies.append((param.data, profile.distload_name(target)))
            continue
        into[profile.distload_name(name)] = data_of.setdefault(id(param), param.data)
    return into, copies


@contextmanager
def torchrun_identity(rank: int, world: int):
    """RANK / WORLD_SIZE / LOCAL_RANK for distload's topology, which reads torchrun's environment
    (an engine's workers may set only LOCAL_WORLD_SIZE, as vLLM's do); restored afterwards."""
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    saved = {k: os.environ.get(k) for k in keys}
    local_world = int(saved["LOCAL_WORLD_SIZE"] or world)
    if world % local_world:
        local_world = world
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank % local_world),
                      LOCAL_WORLD_SIZE=str(local_world))
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def fill_from_checkpoint(path: str, into: dict[str, torch.Tensor], shape: dict, options: LoadOptions,
                         engine: str) -> dict:
    """The one call into distload: plan this rank's params, refuse a param either side lacks (or of
    another shape / dtype) before any weight byte is read, then load into `into` in place. Returns the report."""
    rank = shape["rank"]
    device = next(iter(into.values())).device
    options = options.replace(tp=shape["tp"], pp=shape.get("pp", 1), ep=shape["ep"],
                              expert_placement=shape["expert_placement"], device=str(device))
    with torchrun_identity(rank, shape["world"]):
        plan = inspect_load(path, options, world=shape["world"]).plan
        if options.pp > 1:  # an engine keeps some params of the other stages unfilled (vLLM: embedding, norm, head)
            elsewhere = {n for r in range(shape["world"]) for n in plan.specs[r]} - set(plan.specs[rank])
            into = {n: t for n, t in into.items() if n not in elsewhere}
        check_destinations(into, plan.specs[rank], plan.family, options.config, engine)
        result = run_load(path, options, into=into)
    return result.report


def check_destinations(into: dict[str, torch.Tensor], specs: dict, family: str, override: str | None,
                       engine: str) -> None:
    """Every param of `engine`'s model has a planned param of its shape and dtype, and every planned param one of
    the model's (engine: the name of its naming file, configs/serving/<engine>.toml, and of its messages)."""
    rules = override or f"configs/{family}.toml"
    names = f"configs/serving/{engine}.toml"
    shown = ENGINE_NAMES.get(engine, engine)
    unplanned = sorted(set(into) - set(specs))
    if unplanned:
        raise PlanError(f"{shown}'s model has params no rule fills: {describe(unplanned)}; add them to {rules} "
                        f"(or, if {shown} renamed a param distload knows, to {names})")
    absent = sorted(set(specs) - set(into))
    if absent:
        raise PlanError(f"{rules} plans params {shown}'s model does not have: {describe(absent)}; if {shown} renamed "
                        f"them, map the new names in {names}")
    problems = []
    for name, spec in specs.items():
        tensor = into[name]
        if tuple(tensor.shape) != tuple(spec.local_shape):
            problems.append(f"{name}: {shown} {list(tensor.shape)}, distload's shard {list(spec.local_shape)}")
        elif tensor.dtype != torch_dtype(spec.dtype):
            problems.append(f"{name}: {shown} {tensor.dtype}, checkpoint {spec.dtype} (distload copies the bytes "
                            f"as stored: start {shown} with dtype={torch_dtype(spec.dtype)})")
    if problems:
        raise PlanError(f"{shown}'s params differ from distload's plan ({rules}): " + "; ".join(problems[:8]))
