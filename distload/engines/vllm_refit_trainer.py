"""vLLM's weight-transfer backend "distload", the trainer side: every rank of the trainer job joins the refit link
(distload.join_refit, role "trainer") and sends only what it holds; rank 0 also drives the vLLM instance through
vLLM's four-phase protocol (its VLLMWeightSyncClient: an HTTP server's, Ray actors', or LLMClient below for an `LLM`
in this process). The worker side is vllm_weight_transfer.py.

    from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory
    from distload.engines.vllm_refit_trainer import DistloadTrainerInitInfo, LLMClient
    engine = WeightTransferTrainerFactory.trainer_init(
        DistloadTrainerInitInfo(address="tcp://HOST:PORT", config=CKPT_DIR, rank=rank),
        client=LLMClient(llm) if rank == 0 else None, source=ModuleSource(model))
    engine.send_weights()     # every trainer rank, each step
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

import torch
from vllm.distributed.weight_transfer.base import TrainerInitInfo, TrainerWeightTransferEngine, WeightSource

from ..errors import DistloadError
from .vllm import WEIGHT_TRANSFER, register_weight_transfer
from .vllm_weight_transfer import DistloadWeightTransferInitInfo, DistloadWeightTransferUpdateInfo


@dataclass
class DistloadTrainerInitInfo(TrainerInitInfo):
    """address: tcp://HOST:PORT where the instance's first worker hosts the link's store (HOST: that worker's
    machine); config: the model's Hugging Face config (a checkpoint dir or its dict); world: the trainer job's
    size (default torch.distributed's, else WORLD_SIZE); rank (TrainerInitInfo's): this rank in the trainer job."""

    backend: ClassVar[str] = WEIGHT_TRANSFER

    address: str
    config: Any
    world: int | None = None
    timeout: float = 60.0


class LLMClient:
    """vLLM's VLLMWeightSyncClient for an `LLM` in this process (vllm.entrypoints.rl.offline's methods)."""

    def __init__(self, llm) -> None:
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info: dict) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version)


def tensors_of(source: WeightSource):
    """What this rank sends: a ModuleSource's module as it is (its DTensors go shard by shard, never gathered),
    else the source's own pairs for the names it holds (full tensors: the trainer ranks split sending them)."""
    module = getattr(source, "_module", None)   # vLLM's ModuleSource keeps its module there
    if isinstance(module, torch.nn.Module):
        return module
    held = source.held_names()
    return {name: tensor for name, tensor in source
            if tensor is not None and (held is None or name in held)}


class DistloadTrainerWeightTransferEngine(TrainerWeightTransferEngine[DistloadTrainerInitInfo]):
    """One trainer rank's end of the link; rank 0 (the sender, in vLLM's words) also drives the instance."""

    init_info_cls = DistloadTrainerInitInfo

    def __init__(self, *, client, source: WeightSource, is_sender: bool, link) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.link = link
        self.version = 0

    @classmethod
    def trainer_init(cls, init_info: DistloadTrainerInitInfo, *, client, source: WeightSource | None = None):
        """Join the link on every trainer rank; rank 0 meanwhile asks the instance's workers to join it."""
        from ..refit import join_refit

        if source is None:
            raise DistloadError("weight-transfer backend 'distload' sends from a WeightSource: pass source="
                                "ModuleSource(model) (or your own WeightSource) to trainer_init")
        worker_info = asdict(DistloadWeightTransferInitInfo(address=init_info.address, timeout=init_info.timeout))

        def join():
            return join_refit(init_info.address, role="trainer", config=init_info.config,
                                       rank=init_info.rank, world=init_info.world, timeout=init_info.timeout)

        link = driving(client, "init_weight_transfer_engine", worker_info, join) if init_info.is_sender else join()
        return cls(client=client, source=source, is_sender=init_info.is_sender, link=link)

    def send_weights(self) -> None:
        """One refit step on every trainer rank: rank 0 runs the instance's start / update / finish around it."""
        self.version += 1
        tensors = tensors_of(self.source)
        if not self.is_sender:
            self.link.send(tensors, version=self.version)
            return
        self.client.start_weight_update()
        update = asdict(DistloadWeightTransferUpdateInfo(version=self.version))
        driving(self.client, "update_weights", update, lambda: self.link.send(tensors, version=self.version))
        self.client.finish_weight_update(str(self.version))

    def shutdown(self) -> None:
        if self.link is not None:
            self.link.close()
            self.link = None


def driving(client, method: str, payload: dict, collective):
    """Run `collective` (this rank's side of a link collective) while the instance's workers run theirs, which the
    client's `method` starts and returns from only when they are done: the call on a side thread, both awaited.
    If the collective fails the call is not waited for: the link's timeout ends the workers' side too."""
    pool = ThreadPoolExecutor(max_workers=1)
    try:
        call = pool.submit(getattr(client, method), payload)
        result = collective()
        call.result()
        return result
    finally:
        pool.shutdown(wait=False)


register_weight_transfer()   # a trainer process need not have run vLLM's plugins
