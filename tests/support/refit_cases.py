"""Refit cases run as two real torchrun jobs, a trainer job and a serving job, every case in sequence in one
launch (torchrun costs ~5 s to start). Run by tests/jobs/test_refit_link.py:

    torchrun --nproc-per-node 4 tests/support/refit_cases.py --role trainer|serving --cases CASES.json --out DIR

CASES.json: a list of {"name", "old", "new" (checkpoint dirs), "trainer": fsdp | fsdp_tp | ddp | dtensor_rows,
"trainers": ranks taking part, "serving": load options (tp, pp, ep, quantize), "port", "dtype", and optionally
"staged" (false: in place) and "garbage_padding" (the loaded padding rows set to NaN before the refit)}. The trainer
holds the new checkpoint's weights sharded as asked and sends them twice (the second step replays the plan)
and writes DIR/NAME.trainer.R.json (reports, and per serving rank the experts it sent bytes of); each serving
rank loads the old checkpoint, receives, then compares its params with a fresh distload.load of the new
checkpoint and writes DIR/NAME.serving.R.json (reports, the differing params, and with quantize its shard's
bytes as the update carries them: a fresh load without quantize in the same layout).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import distload  # noqa: E402
from distload.refit.holdings import describe, named_tensors  # noqa: E402

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
        if not model.config.tie_word_embeddings:   # vocab 250 / tp 2 / dp 2: FSDP2's uneven _StridedShard 63 + 62
            parallelize_module(model, mesh["tp"], {"model.embed_tokens": RowwiseParallel(), "lm_head": col})
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
    held = describe(named_tensors(tensors))
    experts = {s: experts_in(msgs, held) for s, msgs in link.side.messages.items()}
    link.close()
    Path(case["_out"], f"{case['name']}.trainer.{rank}.json").write_text(json.dumps(
        {"reports": reports, "experts_sent": experts}))


def experts_in(messages: list, held: dict) -> list[int]:
    """The global expert ids whose bytes these messages (this trainer rank's routes to one serving rank) carry:
    from a per-expert name, or from the global rows (held boxes) of a stacked [E, ...] expert tensor."""
    ids = set()
    for move in (m for msg in messages for m in msg):
        per_expert = re.search(r"\.experts\.(\d+)\.", move.source)
        if per_expert:
            ids.add(int(per_expert.group(1)))
        elif ".experts." in move.source:
            h = held[move.source]
            rows_per_expert = math.prod(h.shape[1:-1])
            for r0, r1, c0, c1, lr, lc in h.boxes:
                if lr <= move.rows[0] < lr + r1 - r0 and lc <= move.cols[0] < lc + c1 - c0:
                    first, last = r0 + move.rows[0] - lr, r0 + move.rows[1] - 1 - lr
                    ids.update(range(first // rows_per_expert, last // rows_per_expert + 1))
    return sorted(ids)


def run_serving(case: dict, rank: int) -> None:
    options = case["serving"]
    result = distload.load(case["old"], **options)
    if case.get("garbage_padding"):   # as an engine's receive buffers: padding rows must come out zero anyway
        from distload.transfer.buffers import typed2d

        for name, spec in result.specs.items():
            for r0, r1, c0, c1 in spec.padding if not spec.alias_of else ():
                typed2d(result.params[name])[r0:r1, c0:c1].fill_(float("nan"))
    link = distload.join_refit(f"tcp://127.0.0.1:{case['port']}", role="serving", target=result,
                               staged=case.get("staged", True), timeout=60)
    reports = [link.receive().report for _ in range(2)]
    link.close()
    fresh = distload.load(case["new"], **options)
    differ = sorted(n for n, t in fresh.params.items()
                    if n not in result.params or not torch.equal(result.params[n], t))
    update_shard = None
    if options.get("quantize"):
        plain = distload.load(case["new"], **{k: v for k, v in options.items() if k != "quantize"})
        update_shard = sum(t.nbytes for t in {id(t): t for t in plain.params.values()}.values())
    Path(case["_out"], f"{case['name']}.serving.{rank}.json").write_text(json.dumps(
        {"reports": reports, "differ": differ, "params": len(fresh.params), "version": result.version,
         "update_shard_bytes": update_shard}))


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
