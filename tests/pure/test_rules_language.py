"""The rules language's constructs (distload.rules: family, dims, sets): arithmetic in dims, extends of a
shipped family, remove, sets from config.json (lists, first_k_dense, strides), drop_past, transposed, and the
README's worked example."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from distload.errors import RuleError
from distload.rules import eval_dim, parse_rules, shipped_families
from checks import MINIMAL, write


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
    from distload.rules.sets import past_loops

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
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
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


def test_groups_names_a_dim_on_a_cut_style_and_when_can_negate(tmp_path):
    from distload.rules import flag_holds

    base = MINIMAL.replace('layers = "num_hidden_layers"', 'layers = "num_hidden_layers"\nheads = "num_attention_heads"')
    rules = parse_rules(write(tmp_path, base.replace('style = "column"', 'style = "column"\ngroups = "heads"')))
    assert rules.params[0].groups == "heads"
    with pytest.raises(RuleError, match="groups names a \\[dims\\] entry"):
        parse_rules(write(tmp_path, base.replace('style = "column"', 'style = "column"\ngroups = "nope"')))
    with pytest.raises(RuleError, match="groups names a \\[dims\\] entry"):
        parse_rules(write(tmp_path, base.replace('style = "column"', 'style = "replicate"\ngroups = "heads"')))
    assert flag_holds("!q_lora_rank", {}) and flag_holds("!q_lora_rank", {"q_lora_rank": None})
    assert not flag_holds("!q_lora_rank", {"q_lora_rank": 1536}) and flag_holds("q_lora_rank", {"q_lora_rank": 1536})
    with pytest.raises(RuleError, match="when must name a config.json flag"):
        parse_rules(write(tmp_path, base.replace('style = "column"', 'style = "column"\nwhen = "!"')))
