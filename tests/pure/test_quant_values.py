"""Quantization companions checked by meaning (issue 41): what a format requires of a companion's value or
shape beyond its table row, refused naming the tensor, the value found and what the format needs. Planning on
header entries only (tests/support/quant_headers.py); the g_idx range on the tensor as it lands."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import quant_headers as qh
from distload.errors import CheckpointError, PlanError
from distload.plan import build_plan
from distload.quant import for_load
from distload.quant.gptq import GptqStep, check_g_idx
from distload.rules import rules_for
from distload.topology import Layout

L0 = "model.layers.0."


def _plan(tensors, config, tp=2, **options):
    return build_plan(tensors, config, rules_for(config), Layout(world=tp, tp=tp),
                      quantization=for_load(config, **options))


def _with(tensors, name, **changes):
    return {**tensors, name: replace(tensors[name], **changes)}


def _without(tensors, name):
    return {n: e for n, e in tensors.items() if n != name}


@pytest.mark.parametrize("fmt", ["gptq-act", "nvfp4", "bnb", "fp8"])
def test_the_headers_plan_as_they_are(fmt):
    plan = _plan(qh.headers(fmt), qh.config(fmt), tp=1 if fmt == "bnb" else 2)
    assert not plan.missing and not plan.unexpected


@pytest.mark.parametrize("dequantize", [False, True])
def test_act_order_g_idx_is_checked_as_it_lands_served_packed_or_dequantized(dequantize):
    plan = _plan(qh.headers("gptq-act"), qh.config("gptq-act"), dequantize=dequantize)
    op = "dequantize_gptq" if dequantize else "check_gptq_g_idx"
    steps = {s.outputs[0]: s for s in plan.post[1] if s.op == op}
    step = steps[L0 + ("mlp.down_proj.weight" if dequantize else "mlp.down_proj.g_idx")]
    assert (step.g_idx_sources, step.groups, step.in_features, step.group) == ((L0 + "mlp.down_proj.g_idx",), 8, 128, 16)
    fused = steps[L0 + ("mlp.gate_up_proj.weight" if dequantize else "mlp.gate_up_proj.g_idx")]
    # each part's g_idx is read and checked; the first part's is the param's, the up's is staged for the check only
    assert fused.g_idx_sources == (L0 + "mlp.gate_proj.g_idx", L0 + "mlp.up_proj.g_idx") and fused.groups == 4
    assert L0 + "mlp.gate_up_proj.g_idx.part1" in fused.inputs
    assert L0 + "mlp.gate_up_proj.g_idx.part1" in plan.staging[1]
    assert not any(".part" in n for n in plan.specs[1])


def test_a_fused_parts_g_idx_is_checked_by_its_own_name_and_must_equal_the_first():
    step = GptqStep("check_gptq_g_idx", ("g", "g1"), ("g",), group=16, groups=4, in_features=64,
                    g_idx_sources=(L0 + "mlp.gate_proj.g_idx", L0 + "mlp.up_proj.g_idx"))
    good = torch.arange(64, dtype=torch.int32) // 16
    assert torch.equal(check_g_idx(step, good, good.clone()), good)
    bad = good.clone()
    bad[9] = 4
    with pytest.raises(CheckpointError, match=r"^model\.layers\.0\.mlp\.up_proj\.g_idx: g_idx holds 4, .* run 0\.\.3"):
        check_g_idx(step, good, bad)
    other = good.flip(0)
    with pytest.raises(CheckpointError, match=r"up_proj\.g_idx: g_idx differs from .*gate_proj\.g_idx's \(input 0: 3 vs 0\)"):
        check_g_idx(step, good, other)


def test_act_order_g_idx_out_of_its_groups_is_refused_naming_tensor_value_and_range():
    step = GptqStep("check_gptq_g_idx", ("g",), ("g",), group=16, g_idx_sources=(L0 + "mlp.down_proj.g_idx",),
                    groups=8, in_features=128)
    check_g_idx(step, torch.arange(128, dtype=torch.int32) // 16)
    for value in (-1, 8, 1000):
        g_idx = torch.arange(128, dtype=torch.int32) // 16
        g_idx[5] = value
        with pytest.raises(CheckpointError) as info:
            check_g_idx(step, g_idx)
        message = str(info.value)
        assert message.startswith(L0 + "mlp.down_proj.g_idx: g_idx holds " + str(value))
        assert "run 0..7 (128 inputs / group_size 16 = 8 groups)" in message


@pytest.mark.parametrize("suffix,shape", [("weight_scale_2", (4,)), ("weight_scale_2", (2, 1)),
                                          ("input_scale", (2,))])
def test_nvfp4_per_part_scale_that_is_not_one_number_is_refused_while_planning(suffix, shape):
    name = L0 + "mlp.up_proj." + suffix
    tensors = _with(qh.headers("nvfp4"), name, shape=shape, nbytes=4 * shape[0])
    with pytest.raises(PlanError, match=rf"^{name}: shape \[{', '.join(map(str, shape))}\], but nvfp4 stores one "
                                        rf"number per part there \(shape \[\] or \[1\]\)"):
        _plan(tensors, qh.config("nvfp4"))
    _plan(_with(qh.headers("nvfp4"), name, shape=(1,)), qh.config("nvfp4"))   # [1] is one number


def test_nvfp4_global_scale_dtype_is_named():
    name = L0 + "mlp.down_proj.weight_scale_2"
    with pytest.raises(PlanError, match=rf"^{name}: stored as BF16, but nvfp4 stores it as F32"):
        _plan(_with(qh.headers("nvfp4"), name, dtype="BF16", nbytes=2), qh.config("nvfp4"))


def test_nvfp4_fused_parts_dequantize_each_with_its_own_global_scale():
    plan = _plan(qh.headers("nvfp4"), qh.config("nvfp4"), dequantize=True)
    step = next(s for s in plan.post[0] if s.outputs == (L0 + "mlp.gate_up_proj.weight",))
    assert step.runs == ((64, 0), (64, 1))   # rank 0's gate rows with part 0's scale, its up rows with part 1's


@pytest.mark.parametrize("part", ["mlp.up_proj.", "mlp.down_proj."])
def test_bnb_missing_absmax_is_named(part):
    name = L0 + part + "weight.absmax"
    with pytest.raises(PlanError, match=rf"the checkpoint lacks '{name}', which every packed bnb linear has"):
        _plan(_without(qh.headers("bnb"), name), qh.config("bnb"), tp=1)


def test_gptq_group_size_that_does_not_divide_the_input_names_both_numbers():
    with pytest.raises(PlanError, match=r"the input size 64 of .* is not a multiple of group_size 48"):
        _plan(qh.headers("gptq-act"), qh.config("gptq-act", group_size=48))


@pytest.mark.parametrize("part,fused", [("self_attn.k_proj", "self_attn.qkv_proj"), ("mlp.down_proj", "")])
def test_fp8_per_tensor_one_bf16_weight_names_that_tensor(part, fused):
    name = L0 + part + ".weight"
    tensors = _with(qh.headers("fp8"), name, dtype="BF16", nbytes=qh.headers("fp8")[name].nbytes * 2)
    with pytest.raises(PlanError) as info:
        _plan(tensors, qh.config("fp8"))
    message = str(info.value)
    assert message.startswith(f"'{name}'" + (f" (part of {L0 + fused}.weight)" if fused else "") + ": stored as BF16")
    assert "needs F8_E4M3 weights" in message
