"""vLLM's `weight_transfer_config={"backend": "distload"}`, the worker side: each vLLM worker joins a trainer job's
refit link (distload.join_refit, role "serving") and receives only its own tp shard of every param.

vLLM drives it with its four-phase protocol (vllm.entrypoints.rl: init_weight_transfer_engine, start_weight_update,
update_weights, finish_weight_update); the trainer side is vllm_refit_trainer.py. A step receives into buffers of
the params' loaded shapes (vLLM names, padded shards, as load_format="distload" fills them), so the served weights
stay as they were until every byte is in; then vLLM's own layerwise reload puts them in and reruns its post-load
processing (the CPU build repacks each linear weight for oneDNN and drops the param), as its nccl backend does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm.config import set_current_vllm_config
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload
from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info, initialize_online_processing
from vllm.model_executor.model_loader.reload.utils import get_layer_tensors
from vllm.model_executor.model_loader.weight_utils import default_weight_loader

from ..errors import DistloadError
from ..topology import torchrun_identity
from .contract import destinations, surfaced
from .vllm import instance_shape, vllm_profile, worker_rank

@dataclass
class DistloadWeightTransferInitInfo(WeightTransferInitInfo):
    """What the workers need to join: the link's address (the first worker hosts its TCPStore there) and the
    timeout of every step."""

    address: str
    timeout: float = 60.0


@dataclass
class DistloadWeightTransferUpdateInfo(WeightTransferUpdateInfo):
    """One refit step: the trainer's version of it (checked against the version the link agreed on)."""

    version: int | None = None


class LoadedShapes:
    """Buffers of every param's loaded shape (before vLLM's post-load processing), under vLLM's names: what a
    step receives into. The shapes are vLLM's own record of them (record_metadata_for_reloading at model init),
    since on CPU a processed linear weight is an empty param; biases, which vLLM leaves out of that record and
    never empties, as they are."""

    def __init__(self, model: torch.nn.Module, device: torch.device):
        self.buffers: dict[str, torch.Tensor] = {}
        for prefix, layer in model.named_modules():
            restore_params, _ = get_layerwise_info(layer).restore_metadata
            for name, meta in restore_params.items():
                self.buffers[f"{prefix}.{name}" if prefix else name] = torch.empty(
                    meta.shape, dtype=meta.dtype, device=device)
        for name, param in model.named_parameters():
            if name not in self.buffers:
                self.buffers[name] = torch.empty_like(param, device=device)

    def named_parameters(self, remove_duplicate: bool = False):
        """As a module's, for engines.contract.destinations (each buffer is its own tensor)."""
        return iter(self.buffers.items())


class DistloadWeightTransferEngine(WeightTransferEngine[DistloadWeightTransferInitInfo,
                                                        DistloadWeightTransferUpdateInfo]):
    """One vLLM worker's end of a distload refit link."""

    init_info_cls = DistloadWeightTransferInitInfo
    update_info_cls = DistloadWeightTransferUpdateInfo
    supports_draft_weight_update = False   # the draft's params are not in the link's plan

    def __init__(self, config, vllm_config, device, model):
        super().__init__(config, vllm_config, device, model)
        self.link = None
        self.loaded: LoadedShapes | None = None
        self.into: dict[str, torch.Tensor] = {}
        self.copies: list = []

    def init_transfer_engine(self, init_info: DistloadWeightTransferInitInfo) -> None:
        """Join the link as a serving rank of this instance's layout; blocks until the trainer ranks join."""
        from ..refit import join_refit

        with set_current_vllm_config(self.vllm_config):   # vLLM calls this one outside it; instance_shape reads it
            shape = instance_shape()
        with surfaced(shape["rank"]):
            if shape["pp"] != 1:
                raise DistloadError(f"weight_transfer_config backend 'distload' refits tp (and ep) instances; this "
                                    f"one has pipeline_parallel_size {shape['pp']}: serve it with pp 1")
            self.loaded = LoadedShapes(self.model, self.device)
            self.into, self.copies = destinations(self.loaded, vllm_profile())
            # the serving layout is planned from torchrun's variables: make them this instance's (its workers
            # have vLLM's LOCAL_WORLD_SIZE only, or those of a trainer's torchrun that started an LLM), as a load's
            with torchrun_identity(shape["rank"], shape["world"]):
                self.link = join_refit(init_info.address, role="serving",
                                       config=self.model_config.hf_config.to_dict(), target=self.into,
                                       tp=shape["tp"], ep=shape["ep"], rank=shape["rank"],
                                       world=shape["world"], staged=False, timeout=init_info.timeout)

    def start_weight_update(self) -> None:
        """Nothing yet: the served weights stay in place until update_weights has received all of a step."""

    def receive_weights(self, update_info: DistloadWeightTransferUpdateInfo) -> None:
        """One refit step into the buffers (collective with the trainer job), then into the model."""
        with surfaced(worker_rank()):
            if self.link is None or self.loaded is None:
                raise DistloadError("weight_transfer_config backend 'distload': update_weights before "
                                    "init_weight_transfer_engine; call init_weight_transfer_engine first")
            step = self.link.receive()
            if update_info.version is not None and step.version != update_info.version:
                raise DistloadError(f"the trainer announced refit version {update_info.version} and sent version "
                                    f"{step.version}; send with the version announced in update_weights")
            for alias, target in self.copies:
                alias.copy_(self.into[target])
            self.into_model()

    def into_model(self) -> None:
        """The received buffers through vLLM's layerwise reload: each layer back on its loaded shapes, filled by
        a plain copy (the buffers are already this rank's shard, fused and padded: vLLM's own weight_loaders would
        shard them again), processed once all of it is in and copied into the tensors vLLM serves from."""
        initialize_layerwise_reload(self.model)
        saved = plain_copy_loaders(self.model)
        try:
            layers = dict(self.model.named_modules())
            for name, buffer in self.loaded.buffers.items():
                prefix, _, leaf = name.rpartition(".")
                param = getattr(layers[prefix], leaf)
                param.weight_loader(param, buffer)
            finalize_layerwise_reload(self.model, self.model_config)
        finally:   # vLLM keeps the restored tensors for its own later reloads: give them their loaders back
            for tensor, loader in saved:
                tensor.weight_loader = loader

    def finish_weight_update(self) -> None:
        """Nothing left: update_weights put the step in whole (all-or-nothing needs no second phase here)."""

    def shutdown(self) -> None:
        if self.link is not None:
            self.link.close()
            self.link = None


def plain_copy_loaders(model: torch.nn.Module) -> list:
    """Every reloading layer's tensors loaded by a plain copy under vLLM's layerwise wrapper; returns (tensor,
    its loader before) to put back."""
    saved = []
    for layer in model.modules():
        if not get_layerwise_info(layer).can_load():
            continue
        for tensor in get_layer_tensors(layer).values():
            saved.append((tensor, getattr(tensor, "weight_loader", default_weight_loader)))
            tensor.weight_loader = default_weight_loader
        initialize_online_processing(layer)
    return saved
