"""distload: a torchrun-launched, collective-aware checkpoint loader.

Reader ranks read each tensor of a checkpoint from storage once and send every rank only the shards it
keeps, in the serving layout of vLLM / SGLang; every rank then agrees that each param was loaded exactly
once. The whole public API:

    result = distload.load(path, tp=4)            # inside a torchrun job: this rank's params + report
    distload.load_into(module, path, tp=4)        # fill a (meta-device or preallocated) module in place
    distload.inspect(path, tp=4)                  # no processes: what each rank will get
    distload.refit(result, state_dict, src=0)     # live weight update from one rank, each rank its shards
    link = distload.join_refit("tcp://HOST:PORT", role="trainer" | "serving", ...)   # a trainer job -> a serving job

The package face imports lazily: `import distload.names` or `import distload.plan` loads neither
torch.distributed nor the transfer engine; the loader comes with the first call that needs it.
"""

from __future__ import annotations

import importlib

from .errors import CheckpointError, DistloadError, PlanError, RankFailure, RuleError

__all__ = ["load", "load_into", "inspect", "refit", "join_refit", "LoadResult", "LoadOptions", "Refit", "RefitFailed",
           "DistloadError", "CheckpointError", "RuleError", "PlanError", "RankFailure"]
__version__ = "0.1.0"

_LAZY = {"LoadResult": "loader", "run_load": "loader", "LoadOptions": "options", "Refit": "refit",
         "RefitFailed": "refit"}


def __getattr__(name: str):
    if name in ("refit", "join_refit"):  # a callable package (distload/refit/) and its join
        module = importlib.import_module(".refit", __name__)
        return module if name == "refit" else module.join_refit
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'distload' has no attribute {name!r}")


def load(path, **options):
    """Load `path` onto this rank (call it on every rank of the job). The options are LoadOptions' fields
    (options.py: each declared once, with its help line; `distload load --help` shows the same ones as flags),
    e.g. load(path, tp=2, pp=2, readers="per-node", quantize="fp8"); a misspelt one is refused by name.

    `path` may also be a --save-sharded directory (each rank reads its own file; another topology needs
    reshard=True) or a torch.distributed.checkpoint directory (hf_config=DIR with the model's config.json).

    quantize="fp8" | "fp8-block": quantize a BF16/FP16 checkpoint's linear weights on each rank as they
    land (params `X.weight` fp8 + `X.weight_scale` / `X.weight_scale_inv`); dequantize=True: a quantized
    checkpoint's weights as BF16. Quantized checkpoints (config.json quantization_config) load as they are.
    verify_checksums: sha256 of each weight file against CKPT/checksums; check_finite: a NaN/Inf scan.
    save_for="vllm" (with save_sharded=OUT, world = tp): OUT also holds what vLLM's load_format="sharded_state"
    reads as it is (serving/vllm_save.py).
    """
    return _run(path, options)


def load_into(module, path, **options):
    """Fill `module`'s params in place by the same plan; a module on the meta device is materialised first.

    The module's param names must be the serving names (`...qkv_proj.weight`, ...) and their shapes this
    rank's shard shapes; tied params may share one tensor. Options as `load`.
    """
    import torch

    from .options import check_option_names

    check_option_names(options)  # before the module is touched
    device = options.get("device")
    if device is None:
        device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
    options["device"] = device = str(device)
    if any(p.is_meta for p in module.parameters()):
        _materialise_keeping_ties(module, device)
    # One destination tensor per Parameter object, so tied params stay one tensor (`.data` makes a new
    # tensor object on every access; writing through it needs no autograd bookkeeping).
    data_of: dict[int, object] = {}
    params = {name: data_of.setdefault(id(p), p.data) for name, p in module.named_parameters(remove_duplicate=False)}
    return _run(path, options, into=params)


def _run(path, options: dict, into=None):
    from .loader import run_load
    from .options import LoadOptions

    return run_load(str(path), LoadOptions.from_kwargs(**options), into=into)


def _materialise_keeping_ties(module, device) -> None:
    """module.to_empty(), then re-tie params that were one Parameter (to_empty unties them)."""
    first_name: dict[int, str] = {}
    ties = []
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in first_name:
            ties.append((name, first_name[id(p)]))
        else:
            first_name[id(p)] = name
    module.to_empty(device=device)
    for alias, target in ties:
        owner, _, leaf = alias.rpartition(".")
        setattr(module.get_submodule(owner), leaf, module.get_parameter(target))


def inspect(path, *, world: int | None = None, local_world: int | None = None, **options):
    """Plan a load without processes: the LoadPlan (per rank, params and bytes; see distload.inspect_cmd) on
    `world` ranks (default tp x pp), `local_world` per node (default: one node). The options are the planning
    ones of `load` (what `distload inspect --help` lists); a load-only one (report, save_sharded, ...) or a
    misspelt one is refused by name."""
    from .inspect_cmd import inspect_load
    from .options import PLAN, LoadOptions, check_option_names

    check_option_names(options, scope=PLAN)
    return inspect_load(str(path), LoadOptions.from_kwargs(**options), world=world, local_world=local_world).plan


def _signature(*leading: str, scope: str | None = None, extra: dict | None = None):
    """A function's signature from the one declaration: `leading` positional parameters, then the `extra`
    keywords, then every declared option of `scope` as a keyword with its default (what help() and IDEs show)."""
    from inspect import Parameter, Signature

    from .options import declared

    first = [Parameter(name, Parameter.POSITIONAL_OR_KEYWORD) for name in leading]
    more = [Parameter(name, Parameter.KEYWORD_ONLY, default=v) for name, v in (extra or {}).items()]
    keywords = [Parameter(f.name, Parameter.KEYWORD_ONLY, default=f.default) for f in declared(scope)]
    return Signature(first + more + keywords)


load.__signature__ = _signature("path")
load_into.__signature__ = _signature("module", "path")
inspect.__signature__ = _signature("path", scope="plan", extra={"world": None, "local_world": None})
