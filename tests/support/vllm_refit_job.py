"""A trainer job that refits a running vLLM instance through weight_transfer_config={"backend": "distload"}, as an
RL loop would: under torchrun, every rank holds an FSDP2 (fully_shard) Llama, and rank 0 drives the instance with
vLLM's four-phase protocol: either an `LLM` it runs itself (tp 2 on CPU, load_format="distload"; --tokens), or
vLLM's OpenAI server at URL (--server) through vLLM's own HTTP client and the server's RL endpoints.

    torchrun --nproc-per-node 2 tests/support/vllm_refit_job.py OLD_CKPT NEW_CKPT_DIR ADDRESS --tokens OUT.json
    torchrun --nproc-per-node 2 tests/support/vllm_refit_job.py OLD_CKPT NEW_CKPT_DIR ADDRESS --server URL

Rank 0 saves the trainer's new weights (every param moved by a seeded step: trained_model) as a checkpoint in
NEW_CKPT_DIR, and with --tokens writes the instance's greedy tokens, and every worker's state digests
(vllm_probe.StateProbe: its state dict after vLLM's post-processing), before and after the refit to OUT.json.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

PROMPT = [1, 17, 42, 99, 7, 3, 150, 64]   # tests/support/vllm_serve.py's
STEPS = 16


def start_instance(ckpt: str):
    """The instance, made before this rank joins torch.distributed: vLLM forks its engine and workers, which must
    not inherit the trainer's group (vLLM would take an initialized default group for its own)."""
    from vllm import LLM

    return LLM(ckpt, tensor_parallel_size=2, dtype="bfloat16", enforce_eager=True, max_model_len=128,
               distributed_executor_backend="mp", skip_tokenizer_init=True, load_format="distload",
               weight_transfer_config={"backend": "distload"}, worker_extension_cls="vllm_probe.StateProbe")


def states(llm) -> list[dict]:
    """Every worker's digests of its model's state dict (after vLLM's post-processing)."""
    return [r["processed"] for r in llm.collective_rpc("distload_probe_state")]


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


def release_server(url: str, client) -> None:
    """What an RL loop does after a refit of a server: drop the prefix cache (its KV blocks were computed with the
    old weights and would be reused for a prompt that shares them) and release the workers' end of the link."""
    import requests

    requests.post(f"{url}/reset_prefix_cache", timeout=300).raise_for_status()
    client.shutdown_weight_transfer_engine()


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("old")
    parser.add_argument("new")
    parser.add_argument("address")
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--tokens", help="run an LLM on rank 0; write its greedy tokens before and after here")
    mode.add_argument("--server", help="refit vLLM's OpenAI server at this URL (http://HOST:PORT)")
    return parser.parse_args()


def main() -> None:
    args = arguments()
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    rank = int(os.environ["RANK"])
    llm = start_instance(args.old) if rank == 0 and args.tokens else None
    result = {"before": greedy(llm), "state_before": states(llm)} if llm is not None else {}
    dist.init_process_group("gloo")
    model = trained_model(args.old)
    if rank == 0:
        model.save_pretrained(args.new)
    fully_shard(model)

    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient, ModuleSource, WeightTransferTrainerFactory

    from distload.engines.vllm_refit_trainer import DistloadTrainerInitInfo, LLMClient

    client = None
    if rank == 0:
        client = LLMClient(llm) if llm is not None else HTTPVLLMWeightSyncClient(args.server, timeout=600)
    engine = WeightTransferTrainerFactory.trainer_init(
        DistloadTrainerInitInfo(address=args.address, config=args.old, rank=rank, world=2),
        client=client, source=ModuleSource(model))
    engine.send_weights()
    if llm is not None:
        result["after"] = greedy(llm)
        result["state_after"] = states(llm)
        Path(args.tokens).write_text(json.dumps(result))
    engine.shutdown()
    if rank == 0 and args.server:
        release_server(args.server, client)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
