"""The plugin contract, engine-neutral: what any serving engine's plugin does to fill its model with distload.

An engine hands over its model's params by its own names (a naming profile maps them to distload's, serving/names.py)
and its instance's shape (rank, world, tp, pp, ep, expert placement, from the engine's own groups); the contract
plans this rank's params from that shape, refuses a param either side lacks (or of another shape or dtype) before
any weight byte is read, and fills every param in place by name, never through the engine's weight loaders (they
expect whole tensors). The engine's own post-processing (vLLM's process_weights_after_loading) then runs as usual.
One module per engine on top (vllm.py) says how to read its model, groups and config.

A distload failure inside an engine is said last: the engine's workers log it amid a few hundred lines of the
engine's own tracebacks, so each worker also records its line (`surfaced`), and the engine's top process, which
armed the record when the plugin registered there (`say_failures_last`), prints those lines again as it exits.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import sys
import tempfile
from contextlib import contextmanager

import torch

from ..dtypes import torch_dtype
from ..errors import DistloadError, PlanError
from ..topology import torchrun_identity
from ..inspect_cmd import inspect_load
from ..loader import run_load
from ..options import LoadOptions
from ..rules.names import describe
from ..serving.names import NamingProfile

ENGINE_NAMES = {"vllm": "vLLM"}   # how messages spell an engine
FAILURES = "DISTLOAD_ENGINE_FAILURES"   # the file an engine's processes append distload's error lines to
SAID_LAST = 3                           # lines at most (one per distinct message)


def say_failures_last() -> None:
    """In an engine's top process (no multiprocessing parent: the server, or the user's `LLM(...)` script): make the
    file its workers record distload's errors in (inherited through the environment), and print them at exit."""
    if multiprocessing.parent_process() is not None:
        return   # an engine core or a worker: it records into its top process's file
    fd, path = tempfile.mkstemp(prefix="distload-engine-failures-")
    os.close(fd)
    os.environ[FAILURES] = path
    atexit.register(say_failures, path)


def say_failures(path: str) -> None:
    """The recorded errors, one line per distinct message naming the ranks that raised it."""
    try:
        with open(path, encoding="utf-8") as f:
            records = [line.rstrip("\n").split("\t", 1) for line in f if "\t" in line]
        os.unlink(path)
    except OSError:
        return
    ranks: dict[str, list[str]] = {}
    for rank, message in records:
        if rank not in ranks.setdefault(message, []):
            ranks[message].append(rank)
    lines = [f"distload: error on rank{'s' if len(r) > 1 else ''} {', '.join(sorted(r, key=int))}: {message}\n"
             for message, r in list(ranks.items())[:SAID_LAST]]
    if lines:
        sys.stderr.write("".join(lines))
        sys.stderr.flush()


@contextmanager
def surfaced(rank: int):
    """A DistloadError raised inside goes on as it is, and its line is recorded for the engine's top process."""
    try:
        yield
    except DistloadError as exc:
        path = os.environ.get(FAILURES)
        if path:
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            with open(path, "a", encoding="utf-8") as f:   # one short append: atomic among the workers
                f.write(f"{rank}\t{first}\n")
        raise


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
        # A tied param the engine holds once (vLLM's Gemma 2, Cohere: no lm_head) is its target's tensor.
        into = {**{n: into[s.alias_of] for n, s in plan.specs[rank].items() if s.alias_of in into}, **into}
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
