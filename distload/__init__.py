"""distload: a torchrun-launched, collective-aware checkpoint loader.

Reader ranks read each tensor of a checkpoint from storage once and send every rank only the shards it
keeps, in the serving layout of vLLM / SGLang; every rank then agrees that each param was loaded exactly
once. The whole public API:

    result = distload.load(path, tp=4)            # inside a torchrun job: this rank's params + report
    distload.load_into(module, path, tp=4)        # fill a (meta-device or preallocated) module in place
    distload.inspect(path, tp=4)                  # no processes: what each rank will get
    distload.refit(result, state_dict, src=0)     # live weight update from one rank, each rank its shards
"""

from __future__ import annotations

import torch

# torch.distributed.nn.functional binds `group=group.WORLD` as default arguments when first imported:
# imported after a process group exists (transformers' model construction does, in `verify`), it holds
# the group forever, destroy_process_group cannot free it, and gloo's worker threads outlive the
# interpreter - a worker finishing its last op during interpreter shutdown aborts the process
# ("terminate called without an active exception", SIGABRT after a successful run). Imported with
# distload, before distload or its caller creates a group, its defaults are None.
import torch.distributed.nn.functional  # noqa: F401

from .errors import CheckpointError, DistloadError, PlanError, RankFailure, RuleError
from .loader import LoadResult, run_load
from .refit import Refit, RefitFailed, refit

__all__ = ["load", "load_into", "inspect", "refit", "LoadResult", "Refit", "RefitFailed", "DistloadError",
           "CheckpointError", "RuleError", "PlanError", "RankFailure"]
__version__ = "0.1.0"


def load(path, tp: int | None = None, ep: int = 1, quantize: str | None = None, dequantize: bool = False,
         **options) -> LoadResult:
    """Load `path` onto this rank (call it on every rank of the job). Options as `distload load --help`:
    readers, config, strict, device, backend, timeout_s, staging_mib, read_strategy, expert_placement,
    expert_map, save_sharded, report, progress, reshard, checksums, hf_config,
    verify_checksums (sha256 of each weight file against CKPT/checksums), check_finite (NaN/Inf scan).

    `path` may also be a --save-sharded directory (each rank reads its own file; another topology needs
    reshard=True) or a torch.distributed.checkpoint directory (hf_config=DIR with the model's config.json).

    quantize="fp8" | "fp8-block": quantize a BF16/FP16 checkpoint's linear weights on each rank as they
    land (params `X.weight` fp8 + `X.weight_scale` / `X.weight_scale_inv`); dequantize=True: an FP8
    checkpoint's weights as BF16. FP8 checkpoints (config.json quantization_config) load as FP8 by default.
    """
    return run_load(str(path), tp=tp, ep=ep, quantize=quantize, dequantize=dequantize, **options)


def load_into(module: torch.nn.Module, path, tp: int | None = None, ep: int = 1, device=None, **options) -> LoadResult:
    """Fill `module`'s params in place by the same plan; a module on the meta device is materialised first.

    The module's param names must be the serving names (`...qkv_proj.weight`, ...) and their shapes this
    rank's shard shapes; tied params may share one tensor.
    """
    if device is None:
        device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
    if any(p.is_meta for p in module.parameters()):
        _materialise_keeping_ties(module, device)
    # One destination tensor per Parameter object, so tied params stay one tensor (`.data` makes a new
    # tensor object on every access; writing through it needs no autograd bookkeeping).
    data_of: dict[int, torch.Tensor] = {}
    params = {name: data_of.setdefault(id(p), p.data) for name, p in module.named_parameters(remove_duplicate=False)}
    return run_load(str(path), tp=tp, ep=ep, device=str(device), into=params, **options)


def _materialise_keeping_ties(module: torch.nn.Module, device) -> None:
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


def inspect(path, tp: int | None = None, ep: int = 1, world: int | None = None, **options):
    """Plan a load without processes: per rank, params and bytes (see distload.inspect_cmd)."""
    from .inspect_cmd import inspect_plan

    return inspect_plan(str(path), tp=tp, ep=ep, world=world, **options)
