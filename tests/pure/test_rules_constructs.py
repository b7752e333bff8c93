"""The constructs of issue 38 and the refusals that keep a rule from loading silently wrong, on pure plans of
synthetic headers: dims chosen by config flags and from nested tables, modular layer sets with an upper bound,
stored_shape (a reshape to the served shape), permute (rotary pairs to halves inside each q / k head), transform
(-exp), a fused merged source without split refused, and `rules check` showing the row order a head style takes."""

from __future__ import annotations

import re

import pytest
import torch

from distload.errors import PlanError, RuleError
from distload.plan import build_plan
from distload.postprocess import OPS
from distload.rules import flag_holds, parse_rules, shipped_families
from distload.rules.dims import MAX_NESTING, evaluate
from distload.rules_check import explain
from distload.topology import Layout
from distload.quant import for_load
from checks import write
from hf_metadata import one_file_entries
from plan_checks import arange_values, staged_shards

HEAD = 'name = "mine"\narchitectures = ["MineForCausalLM"]\n'
H, HEADS, KV, HD, INTER, VOCAB = 32, 4, 2, 8, 64, 64
LLAMA_CONFIG = dict(hidden_size=H, num_attention_heads=HEADS, num_key_value_heads=KV, intermediate_size=INTER,
                    vocab_size=VOCAB, num_hidden_layers=1, tie_word_embeddings=True)


def llama_entries(extra: dict | None = None) -> dict:
    p = "model.layers.0."
    shapes = {"model.embed_tokens.weight": (VOCAB, H), "model.norm.weight": (H,),
              p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
              p + "self_attn.q_proj.weight": (HEADS * HD, H), p + "self_attn.k_proj.weight": (KV * HD, H),
              p + "self_attn.v_proj.weight": (KV * HD, H), p + "self_attn.o_proj.weight": (H, HEADS * HD),
              p + "mlp.gate_proj.weight": (INTER, H), p + "mlp.up_proj.weight": (INTER, H),
              p + "mlp.down_proj.weight": (H, INTER), **(extra or {})}
    return one_file_entries(shapes)


def family(tmp_path, body: str):
    return parse_rules(write(tmp_path, HEAD + body))


# ----------------------------------------------------------------------------------------------------
# dims by config flag and nested keys; when on nested flags


def test_falcons_kv_heads_follow_its_two_flags():
    falcon = next(f for f in shipped_families() if f.name == "falcon")
    base = dict(num_attention_heads=8, hidden_size=64)
    assert falcon.dim({**base, "new_decoder_architecture": True, "num_kv_heads": 2}, "kv_heads") == 2
    assert falcon.dim({**base, "new_decoder_architecture": False, "multi_query": True}, "kv_heads") == 1
    assert falcon.dim({**base, "new_decoder_architecture": False, "multi_query": False}, "kv_heads") == 8
    assert falcon.dim({**base, "new_decoder_architecture": True, "n_head_kv": 4}, "kv_heads") == 4   # older name
    assert falcon.dim_keys({**base, "multi_query": True}, "kv_heads")[1] == ("new_decoder_architecture", "multi_query")


def test_a_flag_used_as_a_size_says_so(tmp_path):
    rules = family(tmp_path, '[dims]\nkv = "multi_query|num_key_value_heads"\n')
    with pytest.raises(RuleError, match=r"multi_query is true, a flag, not a size; choose a size by it with "
                                        r"`multi_query \? a : b`"):
        rules.dim({"multi_query": True, "num_key_value_heads": 2}, "kv")


def test_nested_config_keys_in_dims_and_flags(tmp_path):
    rules = family(tmp_path, '[dims]\nkv = "attn_config.kv_n_heads|n_heads"\n')
    mpt = {"n_heads": 8, "attn_config": {"kv_n_heads": 2, "qk_ln": True}}
    assert rules.dim(mpt, "kv") == 2
    assert rules.dim({"n_heads": 8, "attn_config": {}}, "kv") == 8
    assert flag_holds("attn_config.qk_ln", mpt) and not flag_holds("!attn_config.qk_ln", mpt)
    assert flag_holds("!attn_config.clip_qkv", mpt)


# ----------------------------------------------------------------------------------------------------
# layer sets: period and offset (Jamba), an upper bound (Ernie-4.5)


def test_modular_sets_and_an_upper_bound(tmp_path):
    rules = family(tmp_path, """\
        [dims]
        layers = "num_hidden_layers"
        period = "attn_layer_period"
        offset = "attn_layer_offset"
        start = "moe_layer_start_index"
        end = "moe_layer_end_index|num_hidden_layers - 1"
        [loops]
        layer = "layers"
        [sets.attention]
        loop = "layer"
        period = "period"
        offset = "offset"
        [sets.moe]
        loop = "layer"
        from = "start"
        upto = "end"
        """)
    config = dict(num_hidden_layers=16, attn_layer_period=8, attn_layer_offset=4, moe_layer_start_index=1,
                  moe_layer_end_index=13)
    assert rules.members(config, "attention", range(16)) == {4, 12}
    assert rules.members(config, "moe", range(16)) == set(range(1, 14))
    del config["moe_layer_end_index"]
    assert rules.members(config, "moe", range(16)) == set(range(1, 16))
    with pytest.raises(RuleError, match="0 <= offset < period"):
        rules.members({**config, "attn_layer_offset": 8}, "attention", range(16))


def test_an_offset_needs_a_period(tmp_path):
    with pytest.raises(RuleError, match="offset needs period"):
        family(tmp_path, '[dims]\nk = "x"\n[loops]\nlayer = "k"\n[sets.s]\nloop = "layer"\noffset = "k"\n')


# ----------------------------------------------------------------------------------------------------
# merged with one fused source: split or refused


def test_a_fused_merged_source_without_split_is_refused_naming_the_param(tmp_path):
    """GraniteMoE's stacked input_linear [E, 2I, H] as merged without split would be cut as one column: rank 0
    all gate rows, rank 1 all up rows, right shapes, wrong values. Refused, naming the param and the fix."""
    text = open(next(f.source for f in shipped_families() if f.name == "granitemoe")).read()
    wrong = text.replace('split = ["expert_inter", "expert_inter"]\n', "")
    assert wrong != text
    with pytest.raises(RuleError, match=r"params\.'model\.layers\.\{layer\}\.block_sparse_moe\.experts\.w13_weight': a "
                                        r"merged param with one source .* needs split"):
        parse_rules(write(tmp_path, wrong, "granitemoe.toml"))
    with pytest.raises(RuleError, match=r"shared_mlp\.input_linear\.weight'.*needs split"):
        family(tmp_path, '[dims]\nh = "hidden_size"\n[params."shared_mlp.input_linear.weight"]\nstyle = "merged"\n')


# ----------------------------------------------------------------------------------------------------
# stored_shape, permute, transform


def test_stored_shape_serves_the_reshaped_tensor_and_checks_the_stored_one(tmp_path):
    rules = family(tmp_path, """\
        [dims]
        experts = "n_experts"
        [params."gate.bias"]
        style = "replicate"
        stored_shape = ["1", "experts"]
        shape = ["experts"]
        dtype = "float32"
        parts = ["moe_statics.bias"]
        """)
    config = {"n_experts": 4}
    entries = one_file_entries({"moe_statics.bias": (1, 4)}, dtype="BF16")
    plan = build_plan(entries, config, rules, Layout(world=2, tp=2))
    values = arange_values(entries)
    for rank in range(2):
        got = staged_shards(plan, rank, values)["gate.bias"]
        assert got.dtype == torch.float32 and torch.equal(got, values["moe_statics.bias"].reshape(4).float())
    with pytest.raises(PlanError, match=r"moe_statics\.bias has shape \[4\], but param gate\.bias .* stored as \[1, 4\]"):
        build_plan(one_file_entries({"moe_statics.bias": (4,)}), config, rules, Layout(world=1, tp=1))


@pytest.mark.parametrize("body,needle", [
    ('[params."w"]\nstyle = "replicate"\nstored_shape = ["1"]\n', "stored_shape needs shape"),
    ('[params."w"]\nstyle = "row"\npermute = "rotary_halves"\n', "permute = 'rotary_halves' takes style qkv / kv / column"),
    ('[params."w"]\nstyle = "column"\npermute = "sideways"\n', "permute 'sideways'; allowed: rotary_halves"),
    ('[params."w"]\nstyle = "column"\ntransform = "exp"\n', "transform 'exp'; allowed: neg_exp (-exp(x))"),
])
def test_landing_keys_are_checked(tmp_path, body, needle):
    with pytest.raises(RuleError, match=re.escape(needle)):
        family(tmp_path, body)


def halves(head: torch.Tensor) -> torch.Tensor:
    """Rows 0, 2, 4, ..., then 1, 3, 5, ... of one head (written out, not by reshapes)."""
    return head[list(range(0, len(head), 2)) + list(range(1, len(head), 2))]


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_permute_serves_each_q_and_k_head_in_halves_and_leaves_v(tmp_path, tp):
    rules = family(tmp_path, """\
        extends = "llama"
        [params."model.layers.{layer}.self_attn.qkv_proj.weight"]
        style = "qkv"
        permute = "rotary_halves"
        parts = ["model.layers.{layer}.self_attn.q_proj.weight", "model.layers.{layer}.self_attn.k_proj.weight",
                 "model.layers.{layer}.self_attn.v_proj.weight"]
        """)
    entries = llama_entries()
    plan = build_plan(entries, LLAMA_CONFIG, rules, Layout(world=tp, tp=tp))
    values = arange_values(entries)
    q, k, v = (values[f"model.layers.0.self_attn.{x}_proj.weight"] for x in "qkv")
    kv_per_rank = max(1, KV // tp)
    for rank in range(tp):
        got = staged_shards(plan, rank, values)["model.layers.0.self_attn.qkv_proj.weight"]
        q_heads = range(rank * HEADS // tp, (rank + 1) * HEADS // tp)
        kv_heads = range(rank * KV // tp, rank * KV // tp + kv_per_rank) if tp <= KV else [rank // (tp // KV)]
        want = torch.cat([halves(q[h * HD:(h + 1) * HD]) for h in q_heads] +
                         [halves(k[h * HD:(h + 1) * HD]) for h in kv_heads] +
                         [v[h * HD:(h + 1) * HD] for h in kv_heads])
        assert torch.equal(got, want), f"tp {tp} rank {rank}"


def test_transform_serves_minus_exp_in_the_delivered_dtype(tmp_path):
    rules = family(tmp_path, """\
        [dims]
        inner = "d_inner"
        state = "d_state"
        [params."mamba.A"]
        style = "column"
        shape = ["inner", "state"]
        dtype = "float32"
        transform = "neg_exp"
        parts = ["mamba.A_log"]
        """)
    entries = one_file_entries({"mamba.A_log": (8, 4)}, dtype="BF16")
    plan = build_plan(entries, {"d_inner": 8, "d_state": 4}, rules, Layout(world=2, tp=2))
    a_log = torch.linspace(-2, 2, 32).reshape(8, 4).to(torch.bfloat16)
    for rank in range(2):
        got = staged_shards(plan, rank, {"mamba.A_log": a_log})["mamba.A"]
        assert torch.equal(got, -torch.exp(a_log.float())[rank * 4:(rank + 1) * 4])


def test_a_permuted_param_is_not_quantized_while_loading(tmp_path):
    rules = family(tmp_path, """\
        extends = "llama"
        [params."model.layers.{layer}.mlp.down_proj.weight"]
        style = "row"
        shape = ["hidden", "intermediate"]
        transform = "neg_exp"
        """)
    with pytest.raises(PlanError, match=r"model\.layers\.0\.mlp\.down_proj\.weight: a param the rules permute or "
                                        r"transform cannot also be quantized"):
        build_plan(llama_entries(), LLAMA_CONFIG, rules, Layout(world=1, tp=1),
                   quantization=for_load(LLAMA_CONFIG, quantize="fp8"))


def test_the_rotary_op_on_a_bias_and_on_all_rows():
    bias = torch.arange(16.)
    step = type("S", (), {"runs": ((0, 8),)})()
    (out,) = OPS["rotary_halves"](step, None, bias.clone())
    assert torch.equal(out, torch.cat([halves(bias[:8]), halves(bias[8:])]))


# ----------------------------------------------------------------------------------------------------
# rules check shows the row order of a head style, so a wrong style with the right shapes shows


PACKED = {"model.layers.0.attn.wqkv.weight": ((HEADS + 2 * KV) * HD, H)}


@pytest.mark.parametrize("style,rows", [
    ("qkv", "q <- model.layers.0.attn.wqkv.weight rows [0, 8); k <- model.layers.0.attn.wqkv.weight rows [32, 40); "
            "v <- model.layers.0.attn.wqkv.weight rows [48, 56)"),
    ("qkv_packed", "q <- model.layers.0.attn.wqkv.weight rows [0, 8); k <- model.layers.0.attn.wqkv.weight rows "
                   "[16, 24); v <- model.layers.0.attn.wqkv.weight rows [24, 32)"),
])
def test_rules_check_prints_the_rows_of_one_head_of_each_part(tmp_path, style, rows):
    rules = family(tmp_path, f"""\
        [dims]
        hidden = "hidden_size"
        heads = "num_attention_heads"
        kv_heads = "num_key_value_heads"
        head_dim = "hidden_size / num_attention_heads * 1"
        layers = "num_hidden_layers"
        [loops]
        layer = "layers"
        [params."model.layers.{{layer}}.attn.wqkv.weight"]
        style = "{style}"
        """)
    config = {**LLAMA_CONFIG, "hidden_size": HEADS * HD}
    text = explain(rules, one_file_entries({n: (r, HEADS * HD) for n, (r, _) in PACKED.items()}), config, tp=2).text
    assert f"rank 0's first head of each part (8 rows): {rows}" in text, text
    assert "assumes the source rows are " + ("[q heads; k heads; v heads]" if style == "qkv" else
                                             "packed per kv head: [its q heads, k, v]") in text


def test_rules_check_names_the_landing_steps(tmp_path):
    rules = next(f for f in shipped_families() if f.name == "llama4")
    entries = llama_entries()
    text = explain(rules, entries, {**LLAMA_CONFIG, "intermediate_size_mlp": INTER, "num_local_experts": 2,
                                    "intermediate_size": 16, "interleave_moe_layer_step": 2}, tp=2).text
    assert "inside each q / k head: stored rows 0, 2, 4, ..., then 1, 3, 5, ... (permute = rotary_halves" in text


def test_a_per_layer_list_of_numbers_or_flags_selects_layers(tmp_path):
    """Llama-4's no_rope_layers [1, 1, 1, 0, ...] (one entry per layer), as layer_types' strings do."""
    rules = family(tmp_path, """\
        [dims]
        layers = "num_hidden_layers"
        [loops]
        layer = "layers"
        [sets.nope]
        loop = "layer"
        list = "no_rope_layers"
        equals = 0
        [sets.sliding]
        loop = "layer"
        list = "sliding"
        equals = true
        """)
    config = {"num_hidden_layers": 4, "no_rope_layers": [1, 1, 1, 0], "sliding": [True, False, True, False]}
    assert rules.members(config, "nope", range(4)) == {3}
    assert rules.members(config, "sliding", range(4)) == {0, 2}
    with pytest.raises(RuleError, match="no_rope_layers should be a list with one entry per layer"):
        rules.members({**config, "no_rope_layers": [1, 0]}, "nope", range(4))


@pytest.mark.parametrize("expr", ["(" * 5000 + "hidden" + ")" * 5000, "f ? " * 3000 + "1" + " : 2" * 3000])
def test_an_expression_nested_past_the_limit_is_refused_not_a_recursion_error(expr):
    with pytest.raises(RuleError, match=rf"\[dims\] x: .*nests \d+ deep .*at most {MAX_NESTING}"):
        evaluate(expr, {"hidden": 8, "f": True}.get, "rules.toml [dims] x")
    assert evaluate("(" * MAX_NESTING + "hidden" + ")" * MAX_NESTING, {"hidden": 8}.get, "x")[0] == 8
