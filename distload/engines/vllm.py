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

from pathlib import Path

import torch
import vllm
from torch import nn
from vllm.config import ModelConfig, get_current_vllm_config
from vllm.config.load import LoadConfig
from vllm.distributed import parallel_state
from vllm.model_executor.model_loader import register_model_loader
from vllm.model_executor.model_loader.base_loader import BaseModelLoader

from ..checkpoint.s3 import is_object_url
from ..errors import DistloadError, OptionError
from ..loader import source_for
from ..options import LoadOptions, as_config_keys, declared
from ..serving.names import NamingProfile, profile_for
from .contract import destinations, fill_from_checkpoint, say_failures_last, surfaced

LOAD_FORMAT = "distload"
WEIGHT_TRANSFER = "distload"   # weight_transfer_config={"backend": ...}: vllm_weight_transfer.py, vllm_refit_trainer.py
# model_loader_extra_config keys: the LoadOptions declared settable by an engine (vLLM's groups give the rest).
OPTIONS = tuple(f.name for f in declared(engine=True))


def register() -> None:
    """The vllm.general_plugins entry point: make load_format="distload" known to this process, for object storage
    too (allow_object_storage), and, in the instance's top process, print the workers' distload errors last as it
    exits (contract.say_failures_last); and weight_transfer_config={"backend": "distload"} in both of vLLM's
    weight-transfer factories (vllm_weight_transfer.py)."""
    register_model_loader(LOAD_FORMAT)(DistloadModelLoader)
    register_weight_transfer()
    allow_object_storage()
    say_failures_last()


def register_weight_transfer() -> None:
    """Make backend "distload" known to both of vLLM's weight-transfer factories (lazily: the engine modules are
    imported when an instance or a trainer asks for them). Idempotent: vLLM runs its plugins in every process it
    starts, and a trainer process may import the trainer module too."""
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory, WeightTransferTrainerFactory

    for factory, module, cls in (
            (WeightTransferEngineFactory, "distload.engines.vllm_weight_transfer", "DistloadWeightTransferEngine"),
            (WeightTransferTrainerFactory, "distload.engines.vllm_refit_trainer", "DistloadTrainerWeightTransferEngine")):
        try:
            factory.register_engine(WEIGHT_TRANSFER, module, cls)
        except ValueError:   # registered before in this process
            pass


def allow_object_storage() -> None:
    """Let vLLM hand an s3:// model to load_format="distload". vLLM pulls such a model's config and tokenizer into
    a local folder (ModelConfig.model) and keeps the URL as model_config.model_weights, then refuses every load
    format but its own object-storage loaders (VllmConfig.try_verify_and_update_config); distload fetches the
    weights itself, so for its load format the URL is kept out of that one check. Idempotent."""
    from vllm.config import VllmConfig

    verify = VllmConfig.try_verify_and_update_config
    if verify in _OURS:
        return

    def verify_letting_distload_fetch(self):
        weights = self.model_config.model_weights if self.model_config is not None else ""
        if self.load_config.load_format != LOAD_FORMAT or not is_object_url(weights):
            return verify(self)
        self.model_config.model_weights = ""
        try:
            return verify(self)
        finally:
            self.model_config.model_weights = weights

    _OURS.add(verify_letting_distload_fetch)
    VllmConfig.try_verify_and_update_config = verify_letting_distload_fetch


_OURS: set = set()   # the verify wrapper once made (register runs again in every process vLLM starts)


def vllm_profile() -> NamingProfile:
    """The naming profile of the installed vLLM (RuleError naming the version when none fits)."""
    return profile_for("vllm", vllm.__version__)


class DistloadModelLoader(BaseModelLoader):
    """Fills a vLLM model from a Hugging Face checkpoint (a local directory, or s3://) with distload."""

    def __init__(self, load_config: LoadConfig):
        super().__init__(load_config)
        with surfaced(worker_rank()):
            self.options = options_of(dict(load_config.model_loader_extra_config or {}))

    def download_model(self, model_config: ModelConfig) -> None:
        with surfaced(worker_rank()):
            checkpoint_of(model_config)

    def load_weights(self, model: nn.Module, model_config: ModelConfig) -> None:
        with surfaced(worker_rank()):
            self.fill(model, model_config)

    def fill(self, model: nn.Module, model_config: ModelConfig) -> None:
        profile = vllm_profile()  # an unknown vLLM is refused before anything is planned or read
        options = self.options
        hf_config = model_config.hf_config
        if profile.is_draft(getattr(hf_config, "architectures", None)):   # the MTP layers as speculative draft
            profile, options = profile.as_draft(hf_config.num_hidden_layers), options.replace(mtp="only")
        path = checkpoint_of(model_config)
        head_bias_as_vllm_makes_it(model, path, options)
        into, copies = destinations(model, profile)
        fill_from_checkpoint(path, into, instance_shape(), options, "vllm")
        for alias, target in copies:
            alias.copy_(into[target])


def options_of(extra: dict) -> LoadOptions:
    """The load's options from model_loader_extra_config, a bad key or value refused in the key as written.
    Progress: log lines from rank 0 (vLLM's workers write to no terminal)."""
    unknown = sorted(set(extra) - set(OPTIONS))
    if unknown:
        raise OptionError(f"model_loader_extra_config {', '.join(map(repr, unknown))}: not distload options a vLLM "
                          f"instance sets; choose from {', '.join(OPTIONS)}")
    try:
        return LoadOptions.from_kwargs(progress="log", **extra)
    except OptionError as exc:
        raise OptionError(f"model_loader_extra_config {as_config_keys(str(exc))}") from None


def worker_rank() -> int:
    """This worker's rank in its instance (0 before vLLM's groups exist)."""
    return parallel_state.get_world_group().rank if parallel_state.model_parallel_is_initialized() else 0


def head_bias_as_vllm_makes_it(model: nn.Module, path: str, options: LoadOptions) -> None:
    """vLLM's Transformers backend makes lm_head.bias only when its own loader meets the tensor (transformers/
    causal.py): make it here too when the checkpoint has one (Phi-2), so that the plan and the model agree."""
    head = getattr(model, "lm_head", None)
    if getattr(head, "bias", True) is None and hasattr(head, "_register_bias") and \
            "lm_head.bias" in source_for(path, options).discover().tensors:
        with torch.device(head.weight.device):
            head._register_bias()


def checkpoint_of(model_config: ModelConfig) -> str:
    """What distload loads: the s3:// URL of an object-storage model (vLLM pulled its config and tokenizer into
    model_config.model and keeps the URL as model_weights), else the local checkpoint directory."""
    weights = model_config.model_weights
    if is_object_url(weights) or is_object_url(model_config.model):
        return weights if is_object_url(weights) else model_config.model
    path = Path(model_config.model)
    if not path.is_dir():
        raise DistloadError(f"load_format='distload' reads a local checkpoint directory or an s3:// URL; "
                            f"{model_config.model!r} is neither: download it first (huggingface-cli download "
                            f"{model_config.model} --local-dir DIR) and pass DIR")
    return str(path)


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
