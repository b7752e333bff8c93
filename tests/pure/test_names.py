"""distload.names: templates ({layer}, {expert}) and the collapsed name lists of error messages (DESIGN §4.5)."""

from __future__ import annotations

import pytest

from distload.rules import names


def test_variables_in_order_of_appearance():
    assert names.variables("model.layers.{layer}.experts.{expert}.w1") == ("layer", "expert")
    assert names.variables("lm_head.weight") == ()


def test_expand_fills_every_variable():
    assert names.expand("model.layers.{layer}.mlp.down_proj.weight", layer=3) == "model.layers.3.mlp.down_proj.weight"
    assert names.expand("a.{layer}.e.{expert}", layer=0, expert=17) == "a.0.e.17"
    assert names.expand("plain.name") == "plain.name"
    assert names.expand("a.{layer}", layer=1, expert=9) == "a.1"  # extra values are harmless


def test_expand_names_the_missing_variable():
    with pytest.raises(KeyError, match=r"\{expert\}"):
        names.expand("a.{layer}.e.{expert}", layer=0)


@pytest.mark.parametrize("template,name,expected", [
    ("model.layers.{layer}.mlp.down_proj.weight", "model.layers.12.mlp.down_proj.weight", {"layer": 12}),
    ("model.layers.{layer}.mlp.down_proj.weight", "model.layers.0.mlp.down_proj.weight", {"layer": 0}),
    ("a.{layer}.e.{expert}.w", "a.3.e.41.w", {"layer": 3, "expert": 41}),
    ("lm_head.weight", "lm_head.weight", {}),
])
def test_match_returns_the_values(template, name, expected):
    assert names.match(template, name) == expected


@pytest.mark.parametrize("template,name", [
    ("model.layers.{layer}.mlp.down_proj.weight", "model.layers.01.mlp.down_proj.weight"),   # leading zero
    ("model.layers.{layer}.mlp.down_proj.weight", "model.layers.x.mlp.down_proj.weight"),    # not a number
    ("model.layers.{layer}.mlp.down_proj.weight", "model.layers.-1.mlp.down_proj.weight"),
    ("model.layers.{layer}.mlp.down_proj.weight", "model.layers.1.mlp.down_proj.weight.extra"),  # full match only
    ("model.layers.{layer}.mlp.down_proj.weight", "xmodel.layers.1.mlp.down_proj.weight"),
    ("model.layers.{layer}.mlp", "model_layers_1_mlp"),                                       # dots are literal
    ("lm_head.weight", "lm_head.bias"),
])
def test_match_rejects(template, name):
    assert names.match(template, name) is None


def test_expand_and_match_round_trip():
    template = "model.layers.{layer}.mlp.experts.{expert}.down_proj.weight"
    for layer in (0, 1, 9, 10, 123):
        for expert in (0, 7, 64):
            assert names.match(template, names.expand(template, layer=layer, expert=expert)) == \
                {"layer": layer, "expert": expert}


def test_collapse_folds_a_contiguous_run():
    got = names.collapse([f"model.layers.{i}.mlp.down_proj.weight" for i in range(32)])
    assert got == ["model.layers.{0..31}.mlp.down_proj.weight"]


def test_collapse_keeps_gaps_and_singletons():
    got = names.collapse([f"model.layers.{i}.mlp.up_proj.weight" for i in (0, 1, 2, 5, 7, 8)]
                         + ["lm_head.weight", "model.layers.4.self_attn.q_proj.weight"])
    assert got == ["lm_head.weight",
                   "model.layers.4.self_attn.q_proj.weight",
                   "model.layers.{0..2,5,7..8}.mlp.up_proj.weight"]


def test_collapse_is_sorted_and_order_independent():
    members = [f"model.layers.{i}.mlp.gate_proj.weight" for i in (3, 1, 2)] + ["b", "a"]
    assert names.collapse(members) == names.collapse(list(reversed(members))) == \
        ["a", "b", "model.layers.{1..3}.mlp.gate_proj.weight"]


def test_collapse_full_product_of_two_positions():
    members = [f"model.layers.{i}.mlp.experts.{e}.w1.weight" for i in range(2) for e in range(8)]
    assert names.collapse(members) == ["model.layers.{0..1}.mlp.experts.{0..7}.w1.weight"]


def test_collapse_constant_position_stays_a_number():
    members = [f"model.layers.3.mlp.experts.{e}.w1.weight" for e in (0, 1, 2)]
    assert names.collapse(members) == ["model.layers.3.mlp.experts.{0..2}.w1.weight"]


def test_collapse_leaves_numbers_inside_words_alone():
    assert names.collapse(["model.h2o.weight", "model.layer10x.weight"]) == ["model.h2o.weight", "model.layer10x.weight"]


def test_collapse_duplicates_fold_to_one():
    assert names.collapse(["a.0.b", "a.0.b"]) == ["a.0.b"]


def test_collapse_empty():
    assert names.collapse([]) == []


def test_collapse_never_claims_names_that_are_not_there():
    members = ["model.layers.0.mlp.experts.3.w1.weight", "model.layers.1.mlp.experts.5.w1.weight"]
    folded = names.collapse(members)
    # Whatever the folding, expanding the collapsed templates must give back exactly the input names.
    assert sorted(_expand_collapsed(folded)) == sorted(members)


def _expand_collapsed(folded: list[str]) -> list[str]:
    """Inverse of collapse for the '{a..b,c}' syntax, written plainly for the test."""
    import itertools
    import re

    out = []
    for name in folded:
        sets = []
        for m in re.finditer(r"\{([0-9.,]+)\}", name):
            numbers = []
            for run in m.group(1).split(","):
                a, _, b = run.partition("..")
                numbers += list(range(int(a), int(b or a) + 1))
            sets.append(numbers)
        template = re.sub(r"\{[0-9.,]+\}", "{}", name)
        out += [template.format(*combo) for combo in itertools.product(*sets)]
    return out


def test_expand_collapsed_helper_inverts_the_simple_cases():
    members = [f"model.layers.{i}.mlp.experts.{e}.w1.weight" for i in (0, 1, 3) for e in range(4)] + ["x.2.y"]
    assert sorted(_expand_collapsed(names.collapse(members))) == sorted(members)


def test_describe_quotes_collapses_and_sorts():
    text = names.describe(["lm_head.weight"] + [f"model.layers.{i}.mlp.down_proj.weight" for i in range(4)])
    assert text == "'lm_head.weight', 'model.layers.{0..3}.mlp.down_proj.weight'"


def test_describe_cuts_long_lists_with_a_count():
    text = names.describe([f"t{i:02d}" for i in range(20)], limit=3)
    assert text == "'t00', 't01', 't02', ... (17 more)"
    assert names.describe([f"t{i:02d}" for i in range(3)], limit=3) == "'t00', 't01', 't02'"
