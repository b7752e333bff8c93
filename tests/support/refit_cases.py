"""Refit cases run as two real torchrun jobs, a trainer job and a serving job, every case in sequence in one
launch (torchrun costs ~5 s to start). Run by tests/jobs/test_refit_link.py:

    torchrun --nproc-per-node 4 tests/support/refit_cases.py --role trainer|serving --cases CASES.json --out DIR

CASES.json: a list of {"name", "old", "new" (checkpoint dirs), "trainer": fsdp | fsdp_tp | ddp | dtensor_rows,
"trainers": ranks taking part, "serving": load options (tp, pp, ep, quantize), "port", "dtype"}. The trainer
holds the new checkpoint's weights sharded as asked and sends them twice (the second step replays the plan);
each serving rank loads the old checkpoint, receives, then compares its params with a fresh distload.load of
the new checkpoint and writes DIR/NAME.serving.R.json (reports and the differing params).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import distload  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def trainer_tensors(case: dict, rank: int):
    """The new weights as this trainer rank holds them under the case's parallelism."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    n = case["trainers"]
    model = AutoModelForCausalLM.from_pretrained(case["new"], dtype=DTYPES[case["dtype"]])
    kind = case["trainer"]
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, process_group=case["_group"]).module
    if kind == "dtensor_rows":   # checkpoint-named tensors as Shard(0) DTensors (FSDP2's placement)
        from hf_models import checkpoint_tensors
        from torch.distributed.tensor import Shard, distribute_tensor

        mesh = init_device_mesh("cpu", (n,))
        return {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in checkpoint_tensors(case["new"]).items()}
    if kind == "fsdp_tp":
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = init_device_mesh("cpu", (n // 2, 2), mesh_dim_names=("dp", "tp"))
        col, row = ColwiseParallel(), RowwiseParallel()
        plan = {"self_attn.q_proj": col, "self_attn.k_proj": col, "self_attn.v_proj": col, "self_attn.o_proj": row,
                "mlp.gate_proj": col, "mlp.up_proj": col, "mlp.down_proj": row}
        for layer in model.model.layers:
            parallelize_module(layer, mesh["tp"], plan)
        shard_mesh = mesh["dp"]
    else:
        shard_mesh = init_device_mesh("cpu", (n,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=shard_mesh)
    fully_shard(model, mesh=shard_mesh)
    return model


def run_trainer(case: dict, rank: int) -> None:
    case["_group"] = dist.new_group(list(range(case["trainers"]))) if case["trainer"] == "ddp" else None
    if rank >= case["trainers"]:
        return
    tensors = trainer_tensors(case, rank)
    link = distload.join_refit(f"tcp://127.0.0.1:{case['port']}", role="trainer", config=case["new"],
                               rank=rank, world=case["trainers"], timeout=60)
    reports = [link.send(tensors, version=v).report for v in case.get("versions", [None, None])]
    link.close()
    Path(case["_out"], f"{case['name']}.trainer.{rank}.json").write_text(json.dumps(reports))


def run_serving(case: dict, rank: int) -> None:
    options = case["serving"]
    result = distload.load(case["old"], **options)
    link = distload.join_refit(f"tcp://127.0.0.1:{case['port']}", role="serving", target=result,
                               staged=case.get("staged", True), timeout=60)
    reports = [link.receive().report for _ in range(2)]
    link.close()
    fresh = distload.load(case["new"], **options)
    differ = sorted(n for n, t in fresh.params.items()
                    if n not in result.params or not torch.equal(result.params[n], t))
    Path(case["_out"], f"{case['name']}.serving.{rank}.json").write_text(json.dumps(
        {"reports": reports, "differ": differ, "params": len(fresh.params), "version": result.version}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--role", choices=["trainer", "serving"], required=True)
    ap.add_argument("--cases", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for case in json.loads(Path(args.cases).read_text()):
        case["_out"] = args.out
        (run_trainer if args.role == "trainer" else run_serving)(case, rank)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
