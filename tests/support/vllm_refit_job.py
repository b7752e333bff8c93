"""A trainer job that refits a running vLLM instance through weight_transfer_config={"backend": "distload"}, as an
RL loop would: under torchrun, every rank holds an FSDP2 (fully_shard) Llama; rank 0 also runs the instance
(LLM, tp 2 on CPU, load_format="distload") and drives it with vLLM's four-phase protocol.

    torchrun --nproc-per-node 2 tests/support/vllm_refit_job.py OLD_CKPT NEW_CKPT_DIR ADDRESS OUT.json

Rank 0 writes the instance's greedy tokens before and after the refit to OUT.json, and saves the trainer's new
weights (every param moved by a seeded step) as a checkpoint in NEW_CKPT_DIR, for a fresh instance to compare.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

PROMPT = [1, 17, 42, 99, 7, 3, 150, 64]   # tests/support/vllm_serve.py's
STEPS = 16


def start_instance(ckpt: str):
    """The instance, made before this rank joins torch.distributed: vLLM forks its engine and workers, which must
    not inherit the trainer's group (vLLM would take an initialized default group for its own)."""
    from vllm import LLM

    return LLM(ckpt, tensor_parallel_size=2, dtype="bfloat16", enforce_eager=True, max_model_len=128,
               distributed_executor_backend="mp", skip_tokenizer_init=True, load_format="distload",
               weight_transfer_config={"backend": "distload"})


def greedy(llm) -> list[int]:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)
    return list(llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0].outputs[0].token_ids)


def trained_model(ckpt: str):
    """The checkpoint's model with every param moved by one seeded step, the same on every rank."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            step = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            param.add_((step * param.float().std().clamp(min=1e-3) * 0.5).to(param.dtype))
    return model


def main() -> None:
    old, new, address, out = sys.argv[1:5]
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    rank = int(os.environ["RANK"])
    llm = start_instance(old) if rank == 0 else None
    result = {"before": greedy(llm)} if rank == 0 else {}
    dist.init_process_group("gloo")
    model = trained_model(old)
    if rank == 0:
        model.save_pretrained(new)
    fully_shard(model)

    from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory

    from distload.engines.vllm_refit_trainer import DistloadTrainerInitInfo, LLMClient

    engine = WeightTransferTrainerFactory.trainer_init(
        DistloadTrainerInitInfo(address=address, config=old, rank=rank, world=2),
        client=LLMClient(llm) if rank == 0 else None, source=ModuleSource(model))
    engine.send_weights()
    if rank == 0:
        result["after"] = greedy(llm)
        Path(out).write_text(json.dumps(result))
    engine.shutdown()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
