"""distload.plan.expected_shapes: every claimed checkpoint tensor against the full shape and dtype the rules and
config.json imply, checked while planning (before any byte is read).

The cases that loaded silently before (a transposed down_proj, a norm of the wrong size or dtype, an integer
o_proj, a config.json wider than its tensors) are made by editing the header entries of a real tiny checkpoint;
each must be refused by name, with the expected and the found shape or dtype and the config keys used.
"""

from __future__ import annotations

import math
import re
from dataclasses import replace

import pytest

from distload.checkpoint import discover
from distload.dtypes import itemsize
from distload.errors import PlanError, RuleError
from distload.plan.expected_shapes import check_shapes, expected_sources, shape_exprs
from distload.plan import build_plan
from distload.rules import parse_rules, rules_for, shipped_families
from distload.topology import Layout
from hf_models import DENSE
from checks import toy_rules

LAYOUT = Layout(world=2, tp=2)


@pytest.fixture(scope="module")
def llama(dense_checkpoints):
    index = discover(dense_checkpoints["llama"])
    return dict(index.tensors), dict(index.config)


def reshaped(entries: dict, name: str, shape=None, dtype=None) -> dict:
    e = entries[name]
    shape = tuple(e.shape if shape is None else shape)
    dtype = dtype or e.dtype
    return {**entries, name: replace(e, shape=shape, dtype=dtype, nbytes=math.prod(shape) * itemsize(dtype))}


def refusal(entries, config) -> str:
    with pytest.raises(PlanError) as exc:
        build_plan(entries, config, rules_for(config), LAYOUT)
    return str(exc.value)


def test_transposed_down_proj_is_refused_naming_both_shapes(llama):
    entries, config = llama
    name = "model.layers.1.mlp.down_proj.weight"
    msg = refusal(reshaped(entries, name, (128, 64)), config)
    assert msg.startswith(f"{name} has 128 rows but config.json says hidden = 64")
    assert "expects [64, 128] = [hidden, intermediate]" in msg and "found [128, 64]" in msg
    assert "hidden_size=64, intermediate_size=128" in msg and "looks transposed" in msg


@pytest.mark.parametrize("shape", [(300,), (0,), (64, 1)])
def test_a_norm_of_the_wrong_shape_is_refused(llama, shape):
    entries, config = llama
    msg = refusal(reshaped(entries, "model.norm.weight", shape), config)
    assert msg.startswith("model.norm.weight has ")
    assert "expects [64] = [hidden]" in msg and f"found {list(shape)}" in msg and "hidden_size=64" in msg


@pytest.mark.parametrize("name,dtype", [("model.norm.weight", "BOOL"), ("model.layers.0.self_attn.o_proj.weight", "I16"),
                                        ("model.layers.0.mlp.down_proj.weight", "U8")])
def test_integer_or_bool_where_a_float_is_expected_is_refused(llama, name, dtype):
    entries, config = llama
    msg = refusal(reshaped(entries, name, dtype=dtype), config)
    assert msg.startswith(f"{name}: stored as {dtype}") and "floating point" in msg


def test_fp8_without_a_quantization_config_is_refused(llama):
    entries, config = llama
    msg = refusal(reshaped(entries, "model.layers.0.self_attn.o_proj.weight", dtype="F8_E4M3"), config)
    assert "declares no quantization_config" in msg


def test_a_width_other_than_the_weights_needs_the_rule_to_allow_it(llama, tmp_path):
    entries, config = llama
    bf16 = {n: replace(e, dtype="BF16", nbytes=e.nbytes // 2) for n, e in entries.items()}
    wide_norm = reshaped(bf16, "model.norm.weight", dtype="F32")
    msg = refusal(wide_norm, config)
    assert msg.startswith("model.norm.weight: stored as F32, but the checkpoint's weights are BF16")
    assert 'dtype = "any-float"' in msg
    # The same checkpoint plans under a family that allows the norm any float width.
    family = tmp_path / "llama_f32_norm.toml"
    family.write_text('name = "llama_f32_norm"\narchitectures = ["LlamaForCausalLM"]\nextends = "llama"\n'
                      '[params."model.norm.weight"]\nstyle = "replicate"\nshape = ["hidden"]\ndtype = "any-float"\n')
    plan = build_plan(wide_norm, config, parse_rules(family), LAYOUT)
    assert plan.specs[0]["model.norm.weight"].dtype == "F32"


def test_a_config_wider_than_its_tensors_is_refused(llama):
    entries, config = llama
    msg = refusal(entries, {**config, "hidden_size": 128})
    assert msg.startswith("model.embed_tokens.weight has 64 in dim 1 but config.json says hidden = 128")
    assert "vocab_size=250, hidden_size=128" in msg


def test_a_doubled_head_count_names_the_tensor_the_dim_and_both_numbers(llama):
    entries, config = llama
    name = "model.layers.0.self_attn.o_proj.weight"
    msg = refusal(reshaped(entries, name, (64, 128)), config)
    assert msg.startswith(f"{name} has 128 in dim 1 but config.json says heads * head_dim = 64")


def test_every_shipped_param_declares_or_derives_its_shape():
    for family in shipped_families():
        for rule in family.params:
            assert shape_exprs(rule, rule.target, family), f"{family.source}: {rule.target} has no shape"


@pytest.mark.parametrize("family", DENSE)
def test_every_tensor_of_each_shipped_dense_checkpoint_is_checked(dense_checkpoints, family):
    index = discover(dense_checkpoints[family])
    plan = build_plan(dict(index.tensors), dict(index.config), rules_for(index.config), LAYOUT)
    assert set(plan.sources) | set(plan.ignored) == set(index.tensors)


def test_shape_entries_are_expressions_of_dims(tmp_path):
    with pytest.raises(RuleError, match=re.escape("shape entry 'hidden_size' names ['hidden_size'], not in [dims]")):
        toy_rules(tmp_path, '[dims]\nhidden = "hidden_size"\n[params."w"]\nstyle = "replicate"\nshape = ["hidden_size"]\n')
    with pytest.raises(RuleError, match="dtype 'int'"):
        toy_rules(tmp_path, '[dims]\nhidden = "hidden_size"\n[params."w"]\nstyle = "replicate"\ndtype = "int"\n')


def test_expected_shapes_of_split_and_expert_forms(tmp_path):
    """Pure: the expected shape of each source of merged (split and equal), qkv and stacked expert forms."""
    from distload.plan import Target

    rules = toy_rules(tmp_path, '''
    [dims]
    hidden = "hidden_size"
    inter = "intermediate_size"
    experts = "num_experts"
    [loops]
    expert = "experts"
    [params."gate_up"]
    style = "merged"
    parts = ["gate", "up"]
    shape = ["2 * inter", "hidden"]
    [params."w13"]
    style = "expert"
    inner = "merged"
    stacked = true
    parts = ["stacked"]
    split = ["inter", "inter"]
    shape = ["2 * inter", "hidden"]
    ''')
    config = dict(hidden_size=8, intermediate_size=12, num_experts=3)
    merged, expert = rules.params
    got = [(x.source, x.shape) for x in expected_sources(Target("gate_up", merged, ("gate", "up")), rules, config)]
    assert got == [("gate", (12, 8)), ("up", (12, 8))]
    (stacked,) = expected_sources(Target("w13", expert, ("stacked",)), rules, config)
    assert stacked.shape == (3, 24, 8) and stacked.keys == ("num_experts", "intermediate_size", "hidden_size")
    entries = {"gate": replace(_entry("gate", (12, 8))), "up": _entry("up", (8, 12))}
    with pytest.raises(PlanError, match=re.escape("up has 8 rows but config.json says (2 * inter) / 2 = 12")):
        check_shapes([Target("gate_up", merged, ("gate", "up"))], entries, rules, config)


def _entry(name, shape):
    from distload.checkpoint import TensorEntry
    return TensorEntry(name, "f.safetensors", "F32", tuple(shape), 0, 4 * math.prod(shape))
