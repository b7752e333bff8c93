"""DeepSeek-V3 (configs/deepseek_v3.toml, issue 20): MLA attention and the DeepSeek MoE block against
layout_oracle.py at tp x ep, the block-FP8 form (weight_scale_inv 128x128) loaded on real ranks, the refusals
(a tp that splits a head or a block), and the MTP layer read not at all. The tp-only layouts and real loads of
the tiny float model are in test_families.py (LAYOUT_FAMILIES deepseek_v3, deepseek_v3_no_q_lora)."""

from __future__ import annotations

import pytest
import torch

import distload
from distload.checkpoint import discover
from distload.errors import PlanError
from distload.plan import build_plan
from distload.quant import for_load
from distload.rules import rules_for
from distload.topology import Layout
from checks import differences, tensor_bytes
from fp8_checkpoints import quantized_checkpoint
from hf_models import checkpoint_tensors, read_config, save_checkpoint, with_mtp_layer
from spawn import run_ranks
from moe_checks import expected_hosts, expected_shards, materialise
from fp8_checkpoints import BLOCK_DIMS

BLOCK = (128, 128)
# Dims where DeepSeek's 128x128 blocks line up at tp 2 (as at real shapes): q_b_proj 4 heads x 192 rows,
# kv_b_proj 4 x 256, experts 256 rows; q_a 256 + kv_a 192 rows (a partial last block, as DeepSeek's 576).


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("deepseek")
    bf16 = save_checkpoint("deepseek_v3", root / "bf16", dtype=torch.bfloat16, max_shard_size="2MB", **BLOCK_DIMS)
    return {"f32": str(save_checkpoint("deepseek_v3", root / "f32")), "bf16": str(bf16),
            "fp8": str(quantized_checkpoint(bf16, root / "fp8", "block", block=BLOCK))}


def plan_for(path: str, world: int, ep: int = 1, **kw):
    index = discover(path)
    return build_plan(dict(index.tensors), dict(index.config), rules_for(index.config),
                      Layout(world=world, tp=world, ep=ep), quantization=for_load(index.config, **kw))


@pytest.mark.parametrize("world,ep", [(1, 1), (2, 2), (4, 2), (4, 4)])
def test_experts_and_mla_follow_the_oracle_at_tp_x_ep(ckpts, world, ep):
    hf, config = checkpoint_tensors(ckpts["f32"]), read_config(ckpts["f32"])
    plan = plan_for(ckpts["f32"], world, ep)
    assert plan.family == "deepseek_v3" and plan.missing == () and plan.unexpected == ()
    hosts = expected_hosts(8, world, ep)
    for rank in range(world):
        problems = differences(materialise(plan, rank, hf), expected_shards(hf, config, rank, world, ep, hosts[rank]),
                               f"world {world} ep {ep} rank {rank}")
        assert not problems, "\n".join(problems)
    fused = plan.specs[0]["model.layers.0.self_attn.fused_qkv_a_proj.weight"]
    assert fused.style == "replicate" and fused.local_shape == (32 + 24, 64)   # q_a + kv_a, on every rank


def test_a_tp_that_splits_a_head_is_refused_by_name(ckpts):
    with pytest.raises(PlanError, match=r"self_attn\.\w+_proj.weight \(rule \w+\): 4 heads \(rule groups\), tp=8: "
                                        r"tp must divide 4 so that each rank holds whole heads \(try tp 1, 2, 4\)"):
        plan_for(ckpts["f32"], 8)


def test_the_mtp_layer_is_read_not_at_all(ckpts, tmp_path):
    path, extra = with_mtp_layer(ckpts["f32"], tmp_path / "mtp")
    plan = plan_for(path, 2)
    assert plan.unexpected == () and set(extra) <= set(plan.ignored) and not set(extra) & set(plan.sources)


def test_the_router_bias_is_delivered_in_float32_whatever_is_stored(ckpts):
    index = discover(ckpts["bf16"])
    assert index.tensors["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == "BF16"
    specs = plan_for(ckpts["bf16"], 2).specs[1]
    assert specs["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == "F32"
    assert specs["model.layers.1.mlp.gate.weight"].dtype == "BF16"


def test_block_fp8_at_a_tp_that_cuts_a_block_is_refused_before_any_read(ckpts):
    with pytest.raises(PlanError, match=r"block FP8 \[128, 128\].*=4 cuts .* inside a \[128, 128\] block.*\(try .*1, 2\)"):
        plan_for(ckpts["fp8"], 4)
    fused = plan_for(ckpts["fp8"], 2).specs[1]["model.layers.0.self_attn.fused_qkv_a_proj.weight_scale_inv"]
    assert fused.local_shape == (2 + 2, 2)   # the parts' scales concatenated: q_a 2 block rows, kv_a 2 (192 rows)


def _dequantized(params: dict) -> dict:
    """Every fp8 weight with its weight_scale_inv, dequantized with the reference kernel; the rest as it is."""
    from distload.kernels import dequantize_fp8_block_reference

    out = {}
    for name, t in params.items():
        if name.endswith("weight_scale_inv"):
            continue
        scale = params.get(name.replace("weight", "weight_scale_inv")) if name.endswith("weight") else None
        if scale is None:
            out[name] = t.float()
        elif t.dim() == 3:  # experts: one matrix each
            out[name] = torch.stack([dequantize_fp8_block_reference(t[e], scale[e], BLOCK, torch.float32)
                                     for e in range(t.shape[0])])
        else:
            out[name] = dequantize_fp8_block_reference(t, scale, BLOCK, torch.float32)
    return out


def _load_fp8(ckpts: dict) -> list[str]:
    import torch.distributed as dist

    from layout_oracle import serving_shards

    rank, world = dist.get_rank(), dist.get_world_size()
    result = distload.load(ckpts["fp8"], tp=world, progress=False)
    hf, config = checkpoint_tensors(ckpts["fp8"]), read_config(ckpts["fp8"])
    problems = []
    if result.report["storage_bytes_read"] != tensor_bytes(ckpts["fp8"]):
        problems.append(f"read {result.report['storage_bytes_read']} bytes of {tensor_bytes(ckpts['fp8'])}")
    bias = result.params["model.layers.1.mlp.gate.e_score_correction_bias"]
    if bias.dtype != torch.float32 or not torch.equal(bias, hf["model.layers.1.mlp.gate.e_score_correction_bias"].float()):
        problems.append(f"e_score_correction_bias: {bias.dtype}, vLLM keeps it in float32")
    # Weights and scales exact: dequantizing each rank's shard gives the oracle's shard of the dequantized model.
    got = _dequantized(result.params)
    problems += differences(got, serving_shards(_dequantized(hf), config, rank, world), f"fp8 rank {rank}")
    # ... and within FP8's error of the bf16 original.
    original = serving_shards(checkpoint_tensors(ckpts["bf16"]), config, rank, world)
    for name, want in original.items():
        err = (got[name] - want.float()).abs().max().item()
        if err > 0.07 * want.float().abs().max().item():
            problems.append(f"{name}: dequantized differs from bf16 by {err}")
    return problems


def test_block_fp8_loads_exact_weights_and_scales_at_tp_2(ckpts):
    problems = [p for r in run_ranks(2, _load_fp8, ckpts) for p in r]
    assert not problems, "\n".join(problems)


def _load_ep(ckpts: dict) -> list[str]:
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    result = distload.load(ckpts["f32"], tp=world, ep=2, progress=False)
    hf, config = checkpoint_tensors(ckpts["f32"]), read_config(ckpts["f32"])
    want = expected_shards(hf, config, rank, world, 2, expected_hosts(8, world, 2)[rank])
    return differences(result.params, want, f"tp {world} ep 2 rank {rank}")


def test_real_load_at_tp_4_ep_2_is_exact_on_every_rank(ckpts):
    problems = [p for r in run_ranks(4, _load_ep, ckpts) for p in r]
    assert not problems, "\n".join(problems)
