"""Per-channel FP8 and INT8 W8A8 checkpoints (issue 37), planned in this process: every rank's shards at tp 1, 2, 4
(Qwen3-MoE also at ep 2) exactly as vLLM's loaders cut them, and their --dequantize steps.

The checkpoints are made from a tiny Llama and a tiny Qwen3-MoE by tests/support/channel_checkpoints.py's own
quantizer (plain torch). The expectations come from neither the planner nor the kernels: the layout oracle
(tests/support/layout_oracle.py) slices the checkpoint's codes, each scale [out, 1] follows its weight's rows
(vLLM's ChannelQuantScaleParameter: a row-parallel layer's whole), and a rank's staged params are built from the
plan's deliveries alone, each element exactly once.
"""

from __future__ import annotations

import shutil

import pytest
import torch

import channel_checkpoints as cc
from distload.checkpoint import discover
from distload.errors import PlanError
from distload.plan import build_plan
from distload.quant import OPS, checkpoint_format, for_load
from distload.rules import rules_for
from distload.topology import Layout
from hf_models import checkpoint_tensors, read_config
from layout_oracle import serving_shards
from plan_checks import staged_from_deliveries

KINDS = ("fp8", "int8")
LAYOUTS = {"llama": [(1, 1), (2, 1), (4, 1)], "qwen3_moe": [(1, 1), (2, 1), (2, 2), (4, 2)]}   # (tp, ep)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from hf_models import save_checkpoint

    root = tmp_path_factory.mktemp("channel")
    out = {}
    for family in LAYOUTS:
        out[family, "bf16"] = bf16 = save_checkpoint(family, root / family, dtype=torch.bfloat16)
        out.update({(family, kind): cc.channel_checkpoint(bf16, root / f"{family}-{kind}", kind) for kind in KINDS})
    return out


def _plan(path, tp: int, ep: int = 1, **options):
    index = discover(str(path))
    return build_plan(index.tensors, index.config, rules_for(index.config), Layout(world=tp, tp=tp, ep=ep),
                      quantization=for_load(index.config, **options))


def _codes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


@pytest.mark.parametrize("family,kind", [(f, k) for f in LAYOUTS for k in KINDS])
def test_every_rank_holds_vllms_cut(checkpoints, family, kind):
    path = checkpoints[family, kind]
    ckpt, config = checkpoint_tensors(path), read_config(path)
    for tp, ep in LAYOUTS[family]:
        plan = _plan(path, tp, ep)
        assert not any(plan.post) and not plan.missing and not plan.unexpected, (tp, ep)   # final as cut
        for rank in range(tp):
            got, want = staged_from_deliveries(plan, rank, ckpt), cc.expected_shards(ckpt, config, rank, tp, ep)
            assert set(got) == set(want), (tp, ep, rank, sorted(set(got) ^ set(want))[:6])
            for name, w in want.items():
                assert torch.equal(_codes(got[name]), w), (tp, ep, rank, name)


@pytest.mark.parametrize("family,kind", [(f, k) for f in LAYOUTS for k in KINDS])
def test_dequantize_steps_equal_the_oracles_cut_of_the_dequantized_checkpoint(checkpoints, family, kind):
    path = checkpoints[family, kind]
    ckpt, config = checkpoint_tensors(path), read_config(path)
    reference = cc.dequantized(ckpt)
    for tp, ep in LAYOUTS[family]:
        plan = _plan(path, tp, ep, dequantize=True)
        assert plan.quantization.endswith("-> BF16 (--dequantize)")
        for rank in range(tp):
            staged, oracle = staged_from_deliveries(plan, rank, ckpt), serving_shards(reference, config, rank, tp, ep)
            assert not any(n.endswith("weight_scale") for n in plan.specs[rank])
            assert len(plan.post[rank]) == 4 * config["num_hidden_layers"]   # qkv, o, gate_up / w13, down / w2
            for step in plan.post[rank]:
                finals = [plan.specs[rank][n] for n in step.outputs]
                (w,) = OPS[step.op](step, finals, *(staged[n] for n in step.inputs))
                assert torch.equal(w, oracle[step.outputs[0]].to(torch.bfloat16)), (tp, ep, rank, step.outputs)


def test_specs_are_vllms_params(checkpoints):
    """What vLLM's compressed-tensors schemes allocate per rank: weight fp8 / int8 [rows, in], weight_scale float32
    [rows, 1]; a row-parallel layer's scale whole and replicated; experts [local experts, rows, 1]."""
    a = "model.layers.0."
    hidden = read_config(checkpoints["llama", "fp8"])["hidden_size"]
    for kind, dtype in (("fp8", "F8_E4M3"), ("int8", "I8")):
        specs = _plan(checkpoints["llama", kind], 2).specs[1]
        qkv, o = specs[a + "self_attn.qkv_proj.weight_scale"], specs[a + "self_attn.o_proj.weight_scale"]
        rows = specs[a + "self_attn.qkv_proj.weight"].local_shape[0]
        assert (qkv.dtype, qkv.local_shape, qkv.style) == ("F32", (rows, 1), "qkv")
        assert (o.local_shape, o.global_shape, o.style) == ((hidden, 1), (hidden, 1), "replicate")
        assert specs[a + "mlp.gate_up_proj.weight"].dtype == dtype
        assert specs["lm_head.weight"].dtype == "BF16" and "lm_head.weight_scale" not in specs
    moe = _plan(checkpoints["qwen3_moe", "fp8"], 4, ep=2).specs[3]
    w13, w2 = moe[a + "mlp.experts.w13_weight"], moe[a + "mlp.experts.w2_weight"]
    assert moe[a + "mlp.experts.w13_weight_scale"].local_shape == w13.local_shape[:2] + (1,)
    assert moe[a + "mlp.experts.w2_weight_scale"].local_shape == w2.local_shape[:2] + (1,)
    assert moe[a + "mlp.experts.w2_weight_scale"].experts == w2.experts


def test_online_fp8_channel_adds_a_scale_per_row_of_each_rank_shard(checkpoints):
    plain = discover(str(checkpoints["llama", "bf16"]))
    plan = build_plan(plain.tensors, plain.config, rules_for(plain.config), Layout(world=2, tp=2),
                      quantization=for_load(plain.config, "fp8-channel"))
    a = "model.layers.0."
    specs = plan.specs[0]
    for param in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
        w, s = specs[a + param + ".weight"], specs[a + param + ".weight_scale"]
        assert (w.dtype, s.dtype, s.local_shape) == ("F8_E4M3", "F32", (w.local_shape[0], 1)), param
    assert {s.op for s in plan.post[0]} == {"quantize_channel"} and specs["lm_head.weight"].dtype == "BF16"


@pytest.mark.parametrize("quantize", ["fp8", "fp8-block", "fp8-channel"])
def test_online_quantization_under_pp_puts_each_scale_on_its_weights_stage(checkpoints, quantize):
    """tp 2 x pp 2: a scale that online quantization adds is held (and made) only by its weight's stage, as the
    weight is; listed for every stage, the other stage's ranks waited for scales they never make."""
    from pipeline_cases import on_stage

    plain = discover(str(checkpoints["llama", "bf16"]))
    layout = Layout(world=4, tp=2, pp=2)
    plan = build_plan(plain.tensors, plain.config, rules_for(plain.config), layout,
                      quantization=for_load(plain.config, quantize))
    layers = plain.config["num_hidden_layers"]
    ranges = [(0, layers // 2), (layers // 2, layers)]
    for rank in range(4):
        stage = layout.pp_rank(rank)
        specs = plan.specs[rank]
        scales = [n for n in specs if "_scale" in n]
        assert scales, (rank, quantize)
        for name in specs:
            assert on_stage(name, stage, 2, ranges[stage], tied=False), (rank, name)
        made = {out for step in plan.post[rank] for out in step.outputs}
        assert set(scales) <= made, (rank, sorted(set(scales) - made)[:4])


def _ct(kind: str, part: str = "weights", key: str = "", value=None) -> dict:
    """config.json of a channel checkpoint of `kind`, its group's `part` (weights, input_activations) changed."""
    qc = cc.quantization_config(kind)
    if key:
        qc["config_groups"]["group_0"][part][key] = value
    return {"quantization_config": qc}


def test_what_is_not_loaded_is_refused_by_name():
    assert checkpoint_format(_ct("fp8")).name == "fp8-channel"
    assert checkpoint_format(_ct("int8")).name == "int8-channel"
    assert checkpoint_format(_ct("int8", "input_activations", "symmetric", False)).name == "int8-channel"  # dynamic
    for kind, change, words in (
            ("fp8", ("input_activations", "dynamic", False), "static input_activations"),
            ("int8", ("input_activations", "dynamic", False), "input_zero_point"),
            ("fp8", ("weights", "symmetric", False), "weight_zero_point"),
            ("int8", ("weights", "strategy", "tensor"), "strategy 'tensor'"),
            ("int8", ("weights", "num_bits", 4), r"4-bit int strategy 'channel'.*int8-channel \(compressed-tensors")):
        with pytest.raises(PlanError, match=words):
            checkpoint_format(_ct(kind, *change))


def test_a_scale_not_of_its_weights_rows_is_refused(checkpoints, tmp_path):
    from safetensors.torch import load_file, save_file

    path = tmp_path / "bad"
    shutil.copytree(checkpoints["llama", "int8"], path)
    name = "model.layers.1.self_attn.k_proj.weight_scale"
    for f in path.glob("*.safetensors"):
        t = load_file(f)
        if name in t:
            rows = t[name].shape[0]
            t[name] = t[name][:-1].contiguous()
            save_file(t, str(f), metadata={"format": "pt"})
    with pytest.raises(PlanError, match=rf"{name}: shape \[{rows - 1}, 1\].*needs \[{rows}, 1\]"):
        _plan(path, 2)
