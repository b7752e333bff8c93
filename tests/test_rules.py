"""distload.rules: family TOML files -> frozen rules, strict validation, family choice (DESIGN §4.1)."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

from distload.errors import DistloadError, RuleError
from distload.rules import STYLES, FamilyRules, eval_dim, parse_rules, rules_for, shipped_families

CONFIGS = Path(__file__).resolve().parent.parent / "configs"

MINIMAL = """\
name = "toy"
architectures = ["ToyForCausalLM"]
[dims]
layers = "num_hidden_layers"
[loops]
layer = "layers"
[params."model.layers.{layer}.w"]
style = "column"
"""


def write(tmp_path: Path, text: str, name: str = "toy.toml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


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
    ("flag|3", {"flag": True}, 3),          # a bool is not a size
    ("x|4", {"x": 2.5}, 4),                  # nor a float
])
def test_eval_dim(expr, config, expected):
    assert eval_dim(expr, config, "where") == expected


def test_eval_dim_division_must_be_whole():
    with pytest.raises(RuleError, match=r"'hidden_size/num_attention_heads' = 64/3 is not a whole number"):
        eval_dim("head_dim|hidden_size/num_attention_heads", {"hidden_size": 64, "num_attention_heads": 3}, "w")


def test_eval_dim_division_by_zero():
    with pytest.raises(RuleError):
        eval_dim("a/b", {"a": 4, "b": 0}, "w")


def test_eval_dim_none_present_names_the_expression():
    with pytest.raises(RuleError, match=r"toy \[dims\] head_dim: config.json has none of 'head_dim\|hidden_size/x'"):
        eval_dim("head_dim|hidden_size/x", {"hidden_size": 4}, "toy [dims] head_dim")


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


@pytest.mark.parametrize("config", [{"architectures": ["GPTNeoXForCausalLM"]}, {}])
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


# ----------------------------------------------------------------------------------------------------
# Language constructs: arithmetic, extends of a shipped family, remove, sets from a config list, drop_past


def test_eval_dim_arithmetic_with_precedence_and_parentheses():
    config = dict(num_attention_heads=4, head_dim=16, hidden_size=64, n=3)
    assert eval_dim("num_attention_heads * head_dim", config, "w") == 64
    assert eval_dim("(num_attention_heads + 2 * n) * head_dim", config, "w") == 160
    assert eval_dim("missing * 2|hidden_size - n + 1", config, "w") == 62
    with pytest.raises(RuleError, match="unexpected '%'"):
        eval_dim("hidden_size % 2", config, "w")
    with pytest.raises(RuleError, match="ends too early"):
        eval_dim("(hidden_size * 2", config, "w")
    with pytest.raises(RuleError, match="unexpected '\\)'"):
        eval_dim("hidden_size * 2)", config, "w")


def test_a_user_file_extends_a_shipped_family_and_removes_an_inherited_param(tmp_path):
    path = write(tmp_path, """\
        name = "mine"
        architectures = ["MineForCausalLM"]
        extends = "llama"
        remove = ["model.layers.{layer}.input_layernorm.weight"]
        [params."model.layers.{layer}.post_feedforward_layernorm.weight"]
        style = "replicate"
        shape = ["hidden"]
        """)
    rules = parse_rules(path)
    targets = {r.target for r in rules.params}
    assert "model.layers.{layer}.mlp.down_proj.weight" in targets                 # from the shipped llama
    assert "model.layers.{layer}.input_layernorm.weight" not in targets
    assert "model.layers.{layer}.post_feedforward_layernorm.weight" in targets


@pytest.mark.parametrize("body,needle", [
    ('extends = "llama"\nremove = ["model.nope.weight"]\n', "remove names 'model.nope.weight', which 'llama' does not define"),
    ('remove = ["model.norm.weight"]\n', "this file extends none"),
    ('extends = "../llama"\n', "extends must name a family"),
    ('extends = "llama"\nremove = ["model.norm.weight"]\n[params."model.norm.weight"]\nstyle = "replicate"\n',
     "both removed and defined"),
    ('extends = "llama"\ndrop_past = ["model.layers"]\n', "drop_past entry 'model.layers' must be a name template"),
])
def test_remove_and_extends_errors(tmp_path, body, needle):
    path = write(tmp_path, 'name = "mine"\narchitectures = ["X"]\n' + body)
    with pytest.raises(RuleError, match=re.escape(needle)):
        parse_rules(path)


def test_a_set_from_a_config_list(tmp_path):
    path = write(tmp_path, MINIMAL + """\
        [sets.full]
        loop = "layer"
        list = "layer_types"
        equals = "full_attention"
        """)
    rules = parse_rules(path)
    config = dict(num_hidden_layers=4, layer_types=["linear_attention", "full_attention"] * 2)
    assert rules.members(config, "full", range(4)) == {1, 3}
    with pytest.raises(RuleError, match="layer_types should be a list with one entry per layer"):
        rules.members(dict(layer_types=["full_attention"]), "full", range(4))
    with pytest.raises(RuleError, match="'list' and 'equals' go together"):
        parse_rules(write(tmp_path, MINIMAL + '[sets.full]\nloop = "layer"\nlist = "layer_types"\n'))


def test_drop_past_takes_only_the_tensors_after_the_loop():
    from distload.loop_sets import past_loops

    names = ["model.layers.1.mlp.w", "model.layers.2.mlp.w", "model.layers.2", "model.layers.10.eh_proj.weight",
             "model.layers2.x", "model.norm.weight"]
    assert past_loops(["model.layers.{layer}"], names, {"layer": range(2)}) == {
        "model.layers.2.mlp.w", "model.layers.2", "model.layers.10.eh_proj.weight"}


def test_unknown_top_and_param_keys_are_errors(tmp_path):
    with pytest.raises(RuleError, match="unknown keys \\['transpose'\\]"):
        parse_rules(write(tmp_path, MINIMAL + 'transpose = true\n'))
    with pytest.raises(RuleError, match="unknown keys \\['transposd'\\]"):
        parse_rules(write(tmp_path, MINIMAL.replace('style = "column"', 'style = "column"\ntransposd = true')))


def test_transposed_is_a_form_key_for_cut_styles(tmp_path):
    rules = parse_rules(write(tmp_path, MINIMAL.replace('style = "column"', 'style = "column"\ntransposed = true')))
    assert any(p.transposed for p in rules.params)
    with pytest.raises(RuleError, match="transposed = true takes a cut style"):
        parse_rules(write(tmp_path, MINIMAL.replace('style = "column"', 'style = "replicate"\ntransposed = true')))
    with pytest.raises(RuleError, match="transposed = true takes a cut style"):
        parse_rules(write(tmp_path, MINIMAL.replace('style = "column"', 'style = "column"\ntransposed = 1')))


def test_the_readme_worked_example_parses(tmp_path):
    """README "Writing a family": the example file is a valid family that extends llama."""
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    block = readme[readme.index('    name = "mymodel"'):]
    block = block[:block.index("\n\nThen ask distload")]
    rules = parse_rules(write(tmp_path, "\n".join(line[4:] for line in block.splitlines()), "mymodel.toml"))
    down = next(p for p in rules.params if p.target.endswith("down_proj.weight"))
    assert down.transposed and down.shape == ("hidden", "intermediate")
    assert not any(p.target.endswith("post_attention_layernorm.weight") for p in rules.params)


def test_deepseek_moe_layers_follow_first_k_dense_and_moe_layer_freq():
    deepseek = next(f for f in shipped_families() if f.name == "deepseek_v3")
    assert deepseek.members(dict(first_k_dense_replace=1, moe_layer_freq=2), "moe_layers", range(6)) == {2, 4}
    assert deepseek.members(dict(first_k_dense_replace=3), "moe_layers", range(6)) == {3, 4, 5}
    with pytest.raises(RuleError, match="stride=0"):
        deepseek.members(dict(first_k_dense_replace=1, moe_layer_freq=0), "moe_layers", range(6))
