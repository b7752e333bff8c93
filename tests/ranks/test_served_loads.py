"""Real loads of the families of issue 38 on gloo ranks (distload.load, the whole pipeline: the transfer, then the
post-load steps of the rules' permutes and transforms on each rank): every rank's params equal served_layouts.py's
slicing of vLLM 0.32's layout, bit for bit, every checkpoint byte read once; tp 2 and 4, ep 2 for the MoE families."""

from __future__ import annotations

import pytest

from checks import differences, tensor_bytes
from hf_models import SERVED_FAMILIES, save_checkpoint
from spawn import run_ranks

MOE = ("llama4", "olmoe", "phimoe", "granitemoe", "granitemoeshared", "ernie4_5_moe", "jamba")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("served_loads")
    return {fam: str(save_checkpoint(fam, root / fam)) for fam in SERVED_FAMILIES}


def _load_all(checkpoints: dict, ep: int) -> list[str]:
    import torch.distributed as dist

    import distload
    from hf_models import checkpoint_tensors, read_config
    from served_layouts import shards

    rank, world = dist.get_rank(), dist.get_world_size()
    problems = []
    for fam, path in sorted(checkpoints.items()):
        if ep > 1 and fam not in MOE:
            continue
        result = distload.load(path, tp=world, ep=ep, progress=False)
        want = shards(checkpoint_tensors(path), read_config(path), rank, world, ep)
        problems += differences(result.params, want, f"{fam} tp{world} ep{ep} rank{rank}")
        if result.report["storage_bytes_read"] != tensor_bytes(path):
            problems.append(f"{fam}: read {result.report['storage_bytes_read']} bytes of {tensor_bytes(path)}")
    return problems


@pytest.mark.parametrize("world,ep", [(2, 1), (4, 1), (4, 2)])
def test_real_loads_hold_vllms_layout_on_every_rank(checkpoints, world, ep):
    problems = [p for r in run_ranks(world, _load_all, checkpoints, ep, timeout=900) for p in r]
    assert not problems, "\n".join(problems)
