"""distload.rules: family TOML files -> frozen rules, strict validation, family choice (DESIGN §4.1)."""

from __future__ import annotations

import re

from pathlib import Path

import pytest

from distload.errors import DistloadError, RuleError
from distload.rules import STYLES, FamilyRules, eval_dim, parse_rules, rules_for, shipped_families
from checks import MINIMAL, write

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


# ----------------------------------------------------------------------------------------------------
# Shipped families


def test_every_shipped_family_file_parses():
    files = sorted(p for p in CONFIGS.glob("*.toml") if not p.name.startswith("_"))
    assert files, "no shipped family files"
    for path in files:
        rules = parse_rules(path)
        assert rules.name == path.stem
        assert rules.architectures
        assert rules.params
        for rule in rules.params:
            assert rule.style in STYLES
            assert rule.parts


def test_shipped_families_are_the_non_underscore_files():
    got = sorted(f.name for f in shipped_families())
    assert got == sorted(p.stem for p in CONFIGS.glob("*.toml") if not p.name.startswith("_"))
    assert "_decoder" not in got


def test_underscore_base_is_not_a_family():
    with pytest.raises(RuleError, match="needs 'name' and 'architectures'"):
        parse_rules(CONFIGS / "_decoder.toml")


def test_extends_merges_tables_and_keeps_identity():
    llama, qwen2 = parse_rules(CONFIGS / "llama.toml"), parse_rules(CONFIGS / "qwen2.toml")
    assert qwen2.name == "qwen2" and qwen2.architectures == ("Qwen2ForCausalLM",)
    llama_targets = {r.target: r for r in llama.params}
    qwen2_targets = {r.target: r for r in qwen2.params}
    assert set(llama_targets) < set(qwen2_targets)
    assert set(qwen2_targets) - set(llama_targets) == {"model.layers.{layer}.self_attn.qkv_proj.bias"}
    assert all(qwen2_targets[t] == llama_targets[t] for t in llama_targets)
    assert qwen2.dims == llama.dims and qwen2.loops == llama.loops and qwen2.ties == llama.ties
    # _decoder's drop list and tie come through two levels of extends.
    assert "model.layers.{layer}.self_attn.rotary_emb.inv_freq" in qwen2.drop
    assert [(t.target, t.to, t.when) for t in qwen2.ties] == \
        [("lm_head.weight", "model.embed_tokens.weight", "tie_word_embeddings")]


def test_extends_replaces_a_param_entry():
    phi3 = {r.target: r for r in parse_rules(CONFIGS / "phi3.toml").params}
    qkv = phi3["model.layers.{layer}.self_attn.qkv_proj.weight"]
    assert qkv.style == "qkv" and qkv.parts == ("model.layers.{layer}.self_attn.qkv_proj.weight",)
    gate_up = phi3["model.layers.{layer}.mlp.gate_up_proj.weight"]
    assert gate_up.style == "merged" and gate_up.split == ("intermediate", "intermediate")


def test_rules_are_frozen():
    rules = parse_rules(CONFIGS / "llama.toml")
    with pytest.raises(AttributeError):
        rules.name = "x"
    with pytest.raises(AttributeError):
        rules.params[0].style = "row"


# ----------------------------------------------------------------------------------------------------
# Validation


def test_minimal_file_parses(tmp_path):
    rules = parse_rules(write(tmp_path, MINIMAL))
    assert isinstance(rules, FamilyRules)
    (rule,) = rules.params
    assert (rule.target, rule.style, rule.parts, rule.pad_to, rule.stacked) == \
        ("model.layers.{layer}.w", "column", ("model.layers.{layer}.w",), 64, False)
    assert rules.source == str(tmp_path / "toy.toml")


def test_unknown_top_level_key(tmp_path):
    path = write(tmp_path, 'colour = "blue"\n' + MINIMAL)
    with pytest.raises(RuleError, match=r"unknown keys \['colour'\]") as exc:
        parse_rules(path)
    assert str(path) in str(exc.value)


def test_unknown_param_key(tmp_path):
    path = write(tmp_path, MINIMAL + 'dim = 0\n')
    with pytest.raises(RuleError, match=r"params\.'model\.layers\.\{layer\}\.w' has unknown keys \['dim'\]"):
        parse_rules(path)


def test_unknown_style_lists_the_styles(tmp_path):
    path = write(tmp_path, MINIMAL.replace('style = "column"', 'style = "colwise"'))
    with pytest.raises(RuleError, match="style 'colwise'") as exc:
        parse_rules(path)
    for style in STYLES:
        assert style in str(exc.value)


def test_missing_style(tmp_path):
    path = write(tmp_path, MINIMAL.replace('style = "column"', 'parts = ["model.layers.{layer}.w"]'))
    with pytest.raises(RuleError, match="style None"):
        parse_rules(path)


def test_extends_a_missing_family(tmp_path):
    path = write(tmp_path, 'extends = "no_such_family"\n' + MINIMAL)
    with pytest.raises(RuleError, match="extends 'no_such_family'.*does not exist"):
        parse_rules(path)


def test_extends_cycle(tmp_path):
    write(tmp_path, 'name = "a"\narchitectures = ["A"]\nextends = "b"\n', "a.toml")
    write(tmp_path, 'name = "b"\narchitectures = ["B"]\nextends = "a"\n', "b.toml")
    with pytest.raises(RuleError, match="cycle"):
        parse_rules(tmp_path / "a.toml")


def test_extends_a_sibling_file(tmp_path):
    write(tmp_path, MINIMAL, "base.toml")
    path = write(tmp_path, """\
        name = "child"
        architectures = ["ChildForCausalLM"]
        extends = "base"
        [params."model.layers.{layer}.b"]
        style = "replicate"
        """, "child.toml")
    rules = parse_rules(path)
    assert rules.name == "child" and rules.architectures == ("ChildForCausalLM",)
    assert {r.target for r in rules.params} == {"model.layers.{layer}.w", "model.layers.{layer}.b"}


def test_expert_needs_inner(tmp_path):
    path = write(tmp_path, MINIMAL.replace('style = "column"', 'style = "expert"'))
    with pytest.raises(RuleError, match="needs inner"):
        parse_rules(path)


def test_inner_only_for_expert(tmp_path):
    path = write(tmp_path, MINIMAL + 'inner = "column"\n')
    with pytest.raises(RuleError, match="'inner' only applies to style expert"):
        parse_rules(path)


def test_expert_parts_need_expert_variable(tmp_path):
    path = write(tmp_path, MINIMAL.replace('style = "column"', 'style = "expert"\ninner = "column"'))
    with pytest.raises(RuleError, match=r"\{expert\}"):
        parse_rules(path)


def test_template_variable_must_be_a_loop(tmp_path):
    path = write(tmp_path, MINIMAL + 'parts = ["model.layers.{layer}.experts.{expert}.w"]\n')
    with pytest.raises(RuleError, match=r"uses \{expert\}, which \[loops\] does not define"):
        parse_rules(path)


def test_split_names_a_dim(tmp_path):
    path = write(tmp_path, MINIMAL + 'split = ["inter", "inter"]\n')
    with pytest.raises(RuleError, match="split names dim 'inter', not in \\[dims\\]"):
        parse_rules(path)


def test_top_level_key_after_a_table_is_explained(tmp_path):
    path = write(tmp_path, """\
        name = "toy"
        architectures = ["Toy"]
        [dims]
        layers = "num_hidden_layers"
        pad = 64
        """)
    with pytest.raises(RuleError, match="values must be strings"):
        parse_rules(path)


def test_tie_needs_exactly_three_keys(tmp_path):
    path = write(tmp_path, MINIMAL + '[[tie]]\ntarget = "a"\nto = "b"\n')
    with pytest.raises(RuleError, match="target, to, when"):
        parse_rules(path)


def test_invalid_toml(tmp_path):
    path = write(tmp_path, "name = \n")
    with pytest.raises(RuleError, match="not valid TOML"):
        parse_rules(path)


def test_rule_error_is_a_distload_error():
    assert issubclass(RuleError, DistloadError)


def test_parts_must_be_a_list_not_a_string(tmp_path):
    path = write(tmp_path, MINIMAL + 'parts = "model.layers.{layer}.w"\n')
    with pytest.raises(RuleError, match="parts"):
        parse_rules(path)


def test_pad_to_must_be_positive(tmp_path):
    path = write(tmp_path, MINIMAL.replace('style = "column"', 'style = "vocab"\npad_to = 0'))
    with pytest.raises(RuleError, match="pad_to"):
        parse_rules(path)


# ----------------------------------------------------------------------------------------------------
# [dims] expressions


@pytest.mark.parametrize("expr,config,expected", [
    ("hidden_size", {"hidden_size": 64}, 64),
    ("head_dim|hidden_size/num_attention_heads", {"head_dim": 32, "hidden_size": 64, "num_attention_heads": 4}, 32),
    ("head_dim|hidden_size/num_attention_heads", {"hidden_size": 64, "num_attention_heads": 4}, 16),
    ("head_dim|hidden_size/num_attention_heads", {"head_dim": None, "hidden_size": 64, "num_attention_heads": 4}, 16),
    ("num_key_value_heads|num_attention_heads", {"num_attention_heads": 8}, 8),
    ("a/b/c", {"a": 64, "b": 4, "c": 2}, 8),
    ("missing|8", {}, 8),
    ("a / 2 | 7", {"a": 10}, 5),
    ("flag|3", {}, 3),                       # absent: the next alternative
    ("n.kv|3", {"n": {"kv": 2}}, 2),         # a nested key (MPT's attn_config.kv_n_heads)
    ("n.kv|3", {"n": None}, 3),
    ("f ? a : 1", {"f": True, "a": 5}, 5),   # a choice by a flag, the other branch never evaluated
    ("f ? missing : 1", {"f": False}, 1),
    ("f ? a : g ? 2 : 3", {"a": 5}, 3),      # absent flags are false; right to left
    ("(f ? 2 : 3) * a", {"f": 1, "a": 5}, 10),
])
def test_eval_dim(expr, config, expected):
    assert eval_dim(expr, config, "where") == expected


def test_eval_dim_division_must_be_whole():
    with pytest.raises(RuleError, match=r"'head_dim\|hidden_size/num_attention_heads': 64/3 is not a whole number"):
        eval_dim("head_dim|hidden_size/num_attention_heads", {"hidden_size": 64, "num_attention_heads": 3}, "w")


def test_eval_dim_division_by_zero():
    with pytest.raises(RuleError):
        eval_dim("a/b", {"a": 4, "b": 0}, "w")


def test_eval_dim_none_present_names_the_expression_and_the_absent_keys():
    with pytest.raises(RuleError, match=r"toy \[dims\] head_dim: 'head_dim\|hidden_size/x': config.json has no "
                                        r"head_dim / x \(one per alternative\)"):
        eval_dim("head_dim|hidden_size/x", {"hidden_size": 4}, "toy [dims] head_dim")


@pytest.mark.parametrize("expr,config,needle", [
    ("flag|3", {"flag": True}, "flag is true, a flag, not a size; choose a size by it with `flag ? a : b`"),
    ("x|4", {"x": 2.5}, "x = 2.5 is not an integer"),
    ("num_key_value_heads|num_attention_heads", {"num_key_value_heads": "2", "num_attention_heads": 4},
     "num_key_value_heads = '2' is not an integer: config.json has num_key_value_heads as a str, where a size is a "
     'JSON number; write it as "num_key_value_heads": 2 in config.json'),
    ("a/b|7", {"a": 5, "b": 2}, "'a/b|7': 5/2 is not a whole number"),
    ("a/b|7", {"a": 5, "b": 0}, "'a/b|7': 5/0 is not a whole number"),
    ("f ? 1 : 2", {"f": "yes"}, "f = 'yes' is not a flag"),
    ("f ? 1 2", {"f": True}, "needs its ':'"),
])
def test_a_dim_expression_error_never_falls_back_to_the_next_alternative(expr, config, needle):
    with pytest.raises(RuleError, match=re.escape(needle)):
        eval_dim(expr, config, "w")


def test_dim_undefined_in_rules(tmp_path):
    rules = parse_rules(write(tmp_path, MINIMAL))
    assert rules.dim({"num_hidden_layers": 3}, "layers") == 3
    with pytest.raises(RuleError, match="dim 'heads', which \\[dims\\] does not define"):
        rules.dim({}, "heads")


# ----------------------------------------------------------------------------------------------------
# Choosing a family


@pytest.mark.parametrize("arch,family", [
    ("LlamaForCausalLM", "llama"),
    ("MistralForCausalLM", "llama"),
    ("Qwen2ForCausalLM", "qwen2"),
    ("Qwen3ForCausalLM", "qwen3"),
    ("Phi3ForCausalLM", "phi3"),
])
def test_rules_for_picks_by_architecture(arch, family):
    assert rules_for({"architectures": [arch]}).name == family


def test_rules_for_tries_each_listed_architecture():
    assert rules_for({"architectures": ["SomethingElse", "Qwen3ForCausalLM"]}).name == "qwen3"


@pytest.mark.parametrize("config", [{"architectures": ["RwkvForCausalLM"]}, {}])
def test_rules_for_unknown_architecture_lists_known(config):
    with pytest.raises(RuleError, match="no shipped rules file lists it") as exc:
        rules_for(config)
    message = str(exc.value)
    for family in shipped_families():
        for arch in family.architectures:
            assert arch in message
    assert "--config" in message


def test_rules_for_override(tmp_path):
    path = write(tmp_path, MINIMAL)
    assert rules_for({"architectures": ["LlamaForCausalLM"]}, override=str(path)).name == "toy"
    with pytest.raises(RuleError, match="no such file"):
        rules_for({}, override=str(tmp_path / "nope.toml"))
