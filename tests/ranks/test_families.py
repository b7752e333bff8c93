"""The families shipped for their layout (configs/*.toml; tests/hf_models.py LAYOUT_FAMILIES): every rank's
shards exact against layout_oracle.py's independent slicing, at tp 1, 2, 4 (and kv heads replicated where
tp > kv heads), in the pure plan and in real loads on gloo ranks, every byte read once.
"""

from __future__ import annotations

import pytest

from distload.checkpoint import discover
from distload.plan import build_plan
from distload.quant import for_load
from distload.rules import rules_for
from distload.topology import Layout
from checks import differences, tensor_bytes
from hf_models import LAYOUT_FAMILIES, save_checkpoint, save_internlm2_checkpoint, with_mtp_layer
from spawn import run_ranks
from plan_checks import arange_values, assert_matches_oracle
from plan_checks import staged_shards

EXPECTED_FAMILY = {"gemma2": "gemma2", "gemma3": "gemma3", "olmo2": "olmo2", "olmo2_mqa": "olmo2",
                   "granite": "granite", "starcoder2": "starcoder2", "cohere": "cohere", "cohere_qk_norm": "cohere",
                   "gpt2": "gpt2", "gpt_bigcode": "gpt_bigcode",
                   "glm4_moe": "glm4_moe", "qwen3_next": "qwen3_next", "deepseek_v3": "deepseek_v3",
                   "deepseek_v3_no_q_lora": "deepseek_v3", "deepseek_v2": "deepseek_v2", "gpt_oss": "gpt_oss",
                   "internlm2": "internlm2", "internlm2_mqa": "internlm2"}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    out = {fam: str(save_checkpoint(fam, root / fam)) for fam in LAYOUT_FAMILIES}
    out["internlm2"] = str(save_internlm2_checkpoint(root / "internlm2"))    # not built by transformers offline
    out["internlm2_mqa"] = str(save_internlm2_checkpoint(root / "internlm2_mqa", num_key_value_heads=1))
    return out


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("family", sorted(LAYOUT_FAMILIES) + ["internlm2", "internlm2_mqa"])
def test_plan_matches_the_serving_layout(checkpoints, family, tp):
    index = discover(checkpoints[family])
    entries, config = dict(index.tensors), dict(index.config)
    rules = rules_for(config)
    assert rules.name == EXPECTED_FAMILY[family]
    plan = build_plan(entries, config, rules, Layout(world=tp, tp=tp))
    assert plan.missing == () and plan.unexpected == ()
    if any(plan.post):  # params stored transposed: staged as stored, then a transpose step
        assert_staged_matches_oracle(plan, arange_values(entries), config)
    else:
        assert_matches_oracle(plan, arange_values(entries), config)


def assert_staged_matches_oracle(plan, values, config) -> None:
    """The pure plan of a load with post-load transposes against the oracle, on every rank."""
    import torch

    from layout_oracle import serving_shards

    for rank in range(plan.layout.world):
        got = staged_shards(plan, rank, values)
        want = serving_shards(values, config, plan.layout.tp_rank(rank), plan.layout.tp)
        assert set(got) == set(want), set(got) ^ set(want)
        for n, t in want.items():
            assert torch.equal(got[n], t), f"rank {rank} {n} differs from the oracle"


def test_the_family_files_need_their_constructs(checkpoints):
    """OLMo2 without the inherited input_layernorm; Cohere's q/k norms only with use_qk_norm."""
    olmo = discover(checkpoints["olmo2"])
    assert not any("input_layernorm" in n for n in olmo.tensors)
    plain, qk = (build_plan(dict(discover(checkpoints[f]).tensors), dict(discover(checkpoints[f]).config),
                            rules_for(discover(checkpoints[f]).config), Layout(world=2, tp=2))
                 for f in ("cohere", "cohere_qk_norm"))
    assert not any("q_norm" in n for n in plain.specs[0])
    assert qk.specs[0]["model.layers.0.self_attn.k_norm.weight"].local_shape == (1, 16)


def _load_all(checkpoints: dict) -> list[str]:
    import torch.distributed as dist

    import distload
    from hf_models import checkpoint_tensors, read_config
    from layout_oracle import serving_shards

    rank, world = dist.get_rank(), dist.get_world_size()
    problems = []
    for fam, path in sorted(checkpoints.items()):
        result = distload.load(path, tp=world, progress=False)
        want = serving_shards(checkpoint_tensors(path), read_config(path), rank, world)
        problems += differences(result.params, want, f"{fam} tp{world} rank{rank}")
        if result.report["storage_bytes_read"] != tensor_bytes(path):  # every byte read, once
            problems.append(f"{fam}: read {result.report['storage_bytes_read']} bytes, the tensors hold "
                            f"{tensor_bytes(path)}")
    return problems


@pytest.mark.parametrize("world", [2, 4])
def test_real_loads_are_exact_on_every_rank(checkpoints, world):
    problems = [p for r in run_ranks(world, _load_all, checkpoints) for p in r]
    assert not problems, "\n".join(problems)


def test_gpt2_conv1d_weights_are_staged_as_stored_and_transposed_after_landing(checkpoints):
    from dataclasses import replace

    from distload.errors import PlanError

    index = discover(checkpoints["gpt2"])
    entries, config = dict(index.tensors), dict(index.config)
    plan = build_plan(entries, config, rules_for(config), Layout(world=2, tp=2))
    name = "transformer.h.0.mlp.c_fc.weight"
    assert plan.staging_specs(1)[name].local_shape == (64, 128) and plan.specs[1][name].local_shape == (128, 64)
    assert {s.op for steps in plan.post for s in steps} == {"transpose"}
    from distload.rules_check import explain

    text = explain(rules_for(config), entries, config, tp=2).text
    assert ("transformer.h.{layer}.mlp.c_fc.weight  [column] x2: global [256, 64], rank 0 holds [128, 64]\n"
            "    from transformer.h.0.mlp.c_fc.weight [64, 256] F32\n    stored transposed") in text
    # A checkpoint saved [out, in] (not GPT-2's Conv1D) is refused, naming the stored shape the rule expects.
    e = entries[name]
    with pytest.raises(PlanError, match=r"c_fc.weight has 256 rows but config.json says hidden = 64.*looks transposed"):
        build_plan({**entries, name: replace(e, shape=(256, 64))}, config, rules_for(config), Layout(world=2, tp=2))
    with pytest.raises(PlanError, match="a transposed param cannot also be quantized"):
        build_plan(entries, config, rules_for(config), Layout(world=2, tp=2), quantization=for_load(config, "fp8"))
    # A save of it cannot be re-cut (its params were made by the transpose step): the refusal names the step.
    from distload.plan.reshard import reshard_plan

    manifest = {"checkpoint_tensors": {n: {"dtype": e.dtype, "shape": list(e.shape)} for n, e in entries.items()},
                "hf_config": config, "params": {}, "world_size": 2, "tp": 2, "ep": 1}
    with pytest.raises(PlanError, match=r"made by post-load steps \(transpose\); re-cutting them is not supported"):
        reshard_plan(manifest, rules_for(config), Layout(world=4, tp=4), 1 << 20)


def test_the_mtp_layer_after_the_decoder_is_read_not_at_all(checkpoints, tmp_path):
    path, extra = with_mtp_layer(checkpoints["glm4_moe"], tmp_path / "mtp")
    index = discover(path)
    plan = build_plan(dict(index.tensors), dict(index.config), rules_for(index.config), Layout(world=2, tp=2))
    assert plan.unexpected == () and set(extra) <= set(plan.ignored)
    assert not set(extra) & set(plan.sources)                     # no byte of it is read
    assert any("model.layers.2" in note for note in plan.notes)   # and the report says it was skipped


def test_qwen3_next_keeps_whole_key_head_groups(checkpoints):
    """in_proj_qkvz packs q, k, v, z per key head: a tp that would split a group is refused, though its rows
    divide (4 key heads, tp 8: 192 rows per rank of 1536)."""
    from distload.errors import PlanError

    index = discover(checkpoints["qwen3_next"])
    with pytest.raises(PlanError, match=r"linear_attn\.[\w.]+ \(rule \w+\): 4 heads \(rule groups\), tp=8"):
        build_plan(dict(index.tensors), dict(index.config), rules_for(index.config), Layout(world=8, tp=8))


def test_a_packed_wqkv_cut_as_plain_qkv_plans_but_differs_from_the_oracle(checkpoints, tmp_path):
    """The shapes match, so no plan can tell the wrong style: only comparing shards (or logits) catches it."""
    import torch

    from distload.rules import parse_rules
    from layout_oracle import serving_shards
    from plan_checks import materialise_from_deliveries

    wrong = tmp_path / "wrong.toml"
    wrong.write_text('name = "wrong"\narchitectures = ["X"]\nextends = "internlm2"\n'
                     '[params."model.layers.{layer}.attention.wqkv.weight"]\nstyle = "qkv"\n')
    index = discover(checkpoints["internlm2"])
    entries, config = dict(index.tensors), dict(index.config)
    values = arange_values(entries)
    name = "model.layers.0.attention.wqkv.weight"
    for rules, equal in ((rules_for(config), True), (parse_rules(wrong), False)):
        plan = build_plan(entries, config, rules, Layout(world=2, tp=2))
        got = materialise_from_deliveries(plan, 1, values)[name]
        assert torch.equal(got, serving_shards(values, config, 1, 2)[name]) == equal


def test_qwen3_next_reads_nothing_of_its_mtp_head(checkpoints, tmp_path):
    import json
    import shutil

    import torch
    from safetensors.torch import save_file

    out = tmp_path / "mtp"
    shutil.copytree(checkpoints["qwen3_next"], out)
    extra = {"mtp.fc.weight": torch.ones(64, 128), "mtp.norm.weight": torch.ones(64),
             "mtp.layers.0.self_attn.q_proj.weight": torch.ones(128, 64)}
    save_file(extra, out / "model-mtp.safetensors")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    index["weight_map"].update({name: "model-mtp.safetensors" for name in extra})
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    found = discover(str(out))
    plan = build_plan(dict(found.tensors), dict(found.config), rules_for(found.config), Layout(world=2, tp=2))
    assert plan.unexpected == () and set(extra) <= set(plan.ignored) and not set(extra) & set(plan.sources)
