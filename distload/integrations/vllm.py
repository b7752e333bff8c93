"""vLLM's `load_format="distload"`: each worker fills its model's params in place from one distload load.

Registered through the `vllm.general_plugins` entry point (pyproject.toml), which vLLM runs in every
process. In a worker, distload plans from the model's own `named_parameters()` (vLLM's names, padded
shard shapes), fills each param by name (never through vLLM's weight_loaders, which expect whole
tensors), and vLLM's process_weights_after_loading then runs as usual. vLLM's speculative-decoding draft of a
checkpoint's MTP layers (DeepSeekMTPModel, ...: configs/serving/vllm.toml [draft]) loads with mtp="only".

    LLM(ckpt, tensor_parallel_size=2, load_format="distload",
        model_loader_extra_config={"readers": "per-node", "report": "/tmp/load.json"})
    vllm serve ckpt --load-format distload --tensor-parallel-size 2
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path

import torch
import vllm
from torch import nn
from vllm.config import ModelConfig, get_current_vllm_config
from vllm.config.load import LoadConfig
from vllm.distributed import parallel_state
from vllm.model_executor.model_loader import register_model_loader
from vllm.model_executor.model_loader.base_loader import BaseModelLoader

from ..dtypes import torch_dtype
from ..errors import DistloadError, PlanError
from ..inspect_cmd import inspect_load
from ..loader import run_load
from ..names import describe
from ..options import LoadOptions
from .serving_names import NamingProfile, profile_for

LOAD_FORMAT = "distload"
# model_loader_extra_config keys: the LoadOptions a serving instance may set (vLLM's groups give the rest).
OPTIONS = ("readers", "staging_mib", "verify_checksums", "checksums", "report", "read_strategy", "config",
           "timeout_s", "check_finite")


def register() -> None:
    """The vllm.general_plugins entry point: make load_format="distload" known to this process."""
    register_model_loader(LOAD_FORMAT)(DistloadModelLoader)


def vllm_profile() -> NamingProfile:
    """The naming profile of the installed vLLM (RuleError naming the version when none fits)."""
    return profile_for("vllm", vllm.__version__)


class DistloadModelLoader(BaseModelLoader):
    """Fills a vLLM model from a local Hugging Face checkpoint with distload."""

    def __init__(self, load_config: LoadConfig):
        super().__init__(load_config)
        extra = dict(load_config.model_loader_extra_config or {})
        unknown = sorted(set(extra) - set(OPTIONS))
        if unknown:
            raise DistloadError(f"model_loader_extra_config {unknown}: not distload options a vLLM instance "
                                f"sets; choose from {', '.join(OPTIONS)}")
        self.options = LoadOptions.from_kwargs(progress=False, **extra)

    def download_model(self, model_config: ModelConfig) -> None:
        checkpoint_dir(model_config)

    def load_weights(self, model: nn.Module, model_config: ModelConfig) -> None:
        profile = vllm_profile()  # an unknown vLLM is refused before anything is planned or read
        options = self.options
        hf_config = model_config.hf_config
        if profile.is_draft(getattr(hf_config, "architectures", None)):   # the MTP layers as speculative draft
            profile, options = profile.as_draft(hf_config.num_hidden_layers), options.replace(mtp="only")
        into, copies = destinations(model, profile)
        fill_from_checkpoint(str(checkpoint_dir(model_config)), into, instance_shape(), options)
        for alias, target in copies:
            alias.copy_(into[target])


def checkpoint_dir(model_config: ModelConfig) -> Path:
    path = Path(model_config.model)
    if not path.is_dir():
        raise DistloadError(f"load_format='distload' reads a local checkpoint directory; {model_config.model!r} "
                            f"is not one: download it first (huggingface-cli download {model_config.model} "
                            f"--local-dir DIR) and pass DIR")
    return path


def destinations(model: nn.Module, profile: NamingProfile):
    """(distload name -> the param's tensor, [(alias tensor, distload name)]): every param of the model under
    distload's name; a vLLM alias that is a separate tensor gets a copy after the load."""
    by_name = dict(model.named_parameters(remove_duplicate=False))
    data_of: dict[int, torch.Tensor] = {}  # one destination per Parameter, so tied params stay one tensor
    into, copies = {}, []
    for name, param in by_name.items():
        target = profile.alias_target(name, by_name)
        if target is not None:
            if by_name[target] is not param:
                copies.append((param.data, profile.distload_name(target)))
            continue
        into[profile.distload_name(name)] = data_of.setdefault(id(param), param.data)
    return into, copies


def instance_shape() -> dict:
    """This worker in its vLLM instance: rank, world, tp, pp, ep and expert placement, from vLLM's groups.

    distload's collectives run on torch.distributed's default group, which is vLLM's world group: it
    must be exactly this instance's tp x pp ranks (no data parallelism). vLLM orders them as distload does
    (rank = pp_rank * tp + tp_rank) and splits the layers as distload does (VLLM_PP_LAYER_PARTITION too)."""
    parallel = get_current_vllm_config().parallel_config
    world_group, tp_group = parallel_state.get_world_group(), parallel_state.get_tp_group()
    world, tp, pp = world_group.world_size, tp_group.world_size, parallel_state.get_pp_group().world_size
    if tp * pp != world:
        raise DistloadError(f"load_format='distload' loads one replica of tp x pp ranks that is the whole "
                            f"torch.distributed world; this instance has tp {tp}, pp {pp}, world {world}: use "
                            f"load_format='safetensors' with data parallelism")
    ep = tp if parallel.enable_expert_parallel else 1  # vLLM's EP group spans a stage's TP ranks
    return dict(rank=world_group.rank, world=world, tp=tp, pp=pp, ep=ep,
                expert_placement=parallel.expert_placement_strategy)


@contextmanager
def _torchrun_identity(rank: int, world: int):
    """RANK / WORLD_SIZE / LOCAL_RANK for distload's topology, which reads torchrun's environment
    (vLLM's workers set only LOCAL_WORLD_SIZE); restored afterwards."""
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


def fill_from_checkpoint(path: str, into: dict[str, torch.Tensor], shape: dict, options: LoadOptions) -> dict:
    """The one call into distload: plan this rank's params, refuse a param either side lacks (or of
    another shape / dtype) before any weight byte is read, then load into `into` in place. Returns the report."""
    rank = shape["rank"]
    device = next(iter(into.values())).device
    options = options.replace(tp=shape["tp"], pp=shape.get("pp", 1), ep=shape["ep"],
                              expert_placement=shape["expert_placement"], device=str(device))
    with _torchrun_identity(rank, shape["world"]):
        plan = inspect_load(path, options, world=shape["world"]).plan
        if options.pp > 1:  # vLLM keeps some of the other stages' params (embedding, norm, head) unfilled
            elsewhere = {n for r in range(shape["world"]) for n in plan.specs[r]} - set(plan.specs[rank])
            into = {n: t for n, t in into.items() if n not in elsewhere}
        check_destinations(into, plan.specs[rank], plan.family, options.config)
        result = run_load(path, options, into=into)
    return result.report


def check_destinations(into: dict[str, torch.Tensor], specs: dict, family: str, override: str | None) -> None:
    """Every vLLM param has a planned param of its shape and dtype, and every planned param a vLLM param."""
    rules = override or f"configs/{family}.toml"
    names = "configs/serving/vllm.toml"
    unplanned = sorted(set(into) - set(specs))
    if unplanned:
        raise PlanError(f"vLLM's model has params no rule fills: {describe(unplanned)}; add them to {rules} "
                        f"(or, if vLLM renamed a param distload knows, to {names})")
    absent = sorted(set(specs) - set(into))
    if absent:
        raise PlanError(f"{rules} plans params vLLM's model does not have: {describe(absent)}; if vLLM renamed "
                        f"them, map the new names in {names}")
    problems = []
    for name, spec in specs.items():
        tensor = into[name]
        if tuple(tensor.shape) != tuple(spec.local_shape):
            problems.append(f"{name}: vLLM {list(tensor.shape)}, distload's shard {list(spec.local_shape)}")
        elif tensor.dtype != torch_dtype(spec.dtype):
            problems.append(f"{name}: vLLM {tensor.dtype}, checkpoint {spec.dtype} (distload copies the bytes "
                            f"as stored: start vLLM with dtype={torch_dtype(spec.dtype)})")
    if problems:
        raise PlanError(f"vLLM's params differ from distload's plan ({rules}): " + "; ".join(problems[:8]))
