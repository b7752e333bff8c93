"""GPT-OSS with BF16 experts (configs/gpt_oss.toml, issue 20) against layout_oracle.py at tp x ep: experts stacked
and transposed on disk, the interleaved gate/up dim cut by rows [2s, 2e), expert biases (one vector per expert),
w2_bias on rank 0 of each expert group only, sinks by heads. The tp-only layouts and real loads are in
test_families.py (LAYOUT_FAMILIES gpt_oss). MXFP4 checkpoints are not covered here."""

from __future__ import annotations

import pytest

import distload
from distload.checkpoint import discover
from distload.plan import build_plan
from distload.rules import rules_for
from distload.topology import Layout
from checks import differences, tensor_bytes
from hf_models import checkpoint_tensors, read_config, save_checkpoint
from layout_oracle import serving_shards
from spawn import run_ranks
from plan_checks import staged_shards
from plan_checks import arange_values


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return str(save_checkpoint("gpt_oss", tmp_path_factory.mktemp("gpt_oss") / "ckpt"))


@pytest.mark.parametrize("world,ep", [(2, 2), (4, 2), (4, 4)])
def test_experts_follow_vllm_at_tp_x_ep(ckpt, world, ep):
    index = discover(ckpt)
    entries, config = dict(index.tensors), dict(index.config)
    plan = build_plan(entries, config, rules_for(config), Layout(world=world, tp=world, ep=ep))
    assert plan.family == "gpt_oss" and plan.missing == () and plan.unexpected == ()
    values = arange_values(entries)
    for rank in range(world):
        got = staged_shards(plan, rank, values)
        problems = differences(got, serving_shards(values, config, rank, world, ep_size=ep), f"ep {ep} rank {rank}")
        assert not problems, "\n".join(problems)
        bias = got["model.layers.0.mlp.experts.w2_bias"]
        assert (bias.abs().sum() > 0) == (rank % (world // ep) == 0)   # only rank 0 of an expert group adds it


def test_the_stacked_experts_are_cut_as_stored_and_turned_on_landing(ckpt):
    index = discover(ckpt)
    plan = build_plan(dict(index.tensors), dict(index.config), rules_for(index.config), Layout(world=2, tp=2))
    w13 = "model.layers.0.mlp.experts.w13_weight"
    assert plan.staging_specs(1)[w13].local_shape == (4, 64, 128) and plan.specs[1][w13].local_shape == (4, 128, 64)
    # rank 1's gate/up rows [2s, 2e) = columns 128..256 of every expert's stored [H, 2I] matrix
    src = plan.sources["model.layers.0.mlp.experts.gate_up_proj"]
    assert {d.piece.cols for d in src.deliveries if d.rank == 1} == {(128, 256)}
    bias = plan.specs[1]["model.layers.0.mlp.experts.w13_bias"]
    assert bias.local_shape == (4, 128) and bias.global_shape == (4, 256)


def _load(ckpt: str) -> list[str]:
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    result = distload.load(ckpt, tp=world, ep=2, progress=False)
    want = serving_shards(checkpoint_tensors(ckpt), read_config(ckpt), rank, world, ep_size=2)
    problems = differences(result.params, want, f"tp {world} ep 2 rank {rank}")
    if result.report["storage_bytes_read"] != tensor_bytes(ckpt):
        problems.append(f"read {result.report['storage_bytes_read']} bytes of {tensor_bytes(ckpt)}")
    return problems


def test_real_load_at_tp_4_ep_2_is_exact_on_every_rank(ckpt):
    problems = [p for r in run_ranks(4, _load, ckpt) for p in r]
    assert not problems, "\n".join(problems)
