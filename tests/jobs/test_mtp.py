"""Multi-token-prediction layers on request (--mtp off | include | only; distload/rules/mtp.py, issues 20 and 22).

A tiny DeepSeek-V3 with one whole MTP layer appended as DeepSeek-V3 ships it (`model.layers.{N}`: a decoder block
and enorm, hnorm, eh_proj, shared_head.norm, shared_head.head, its own embed_tokens), against an independent
slicing: the block as layout_oracle.py cuts a decoder layer (its num_hidden_layers one higher), the MTP-only
params written out here from vLLM's DeepSeekMTP (norms and eh_proj whole, head and embedding vocab rows).
Pure plans, then one real load on 2 gloo ranks, then the refusal by the command line.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch

import distload
from distload.checkpoint import discover
from distload.errors import PlanError
from distload.plan import build_plan
from distload.quant import for_load
from distload.report import summary_line
from distload.rules import rules_for
from distload.topology import Layout
from checks import differences, tensor_bytes
from hf_models import checkpoint_tensors, read_config, save_checkpoint
from layout_oracle import vocab_rows
from spawn import run_ranks
from moe_checks import expected_hosts, expected_shards, materialise
from hf_models import with_whole_mtp_layer

REPLICATED = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight")
VOCAB = ("shared_head.head.weight", "embed_tokens.weight")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp")
    return str(with_whole_mtp_layer(save_checkpoint("deepseek_v3", root / "base"), root / "mtp"))


@pytest.fixture(scope="module")
def glm_ckpt(tmp_path_factory):
    """GLM-4.5's MTP layer has DeepSeek-V3's layout (shared_head.head and embed_tokens of its own)."""
    root = tmp_path_factory.mktemp("glm_mtp")
    return str(with_whole_mtp_layer(save_checkpoint("glm4_moe", root / "base"), root / "mtp"))


def plan_for(path: str, mode: str, world: int, tp: int | None = None, ep: int = 1, pp: int = 1):
    index = discover(path)
    rules = rules_for(index.config, mtp_mode=mode)
    return build_plan(dict(index.tensors), dict(index.config), rules, Layout(world=world, tp=tp or world, ep=ep, pp=pp),
                      quantization=for_load(index.config))


def oracle(hf: dict, config: dict, mode: str, rank: int, tp: int, ep: int) -> dict:
    """Rank `rank` of `tp` (one stage): the target model's shards and/or the MTP layer's, by slicing alone."""
    n = config["num_hidden_layers"]
    mtp = f"model.layers.{n}."
    hosts = expected_hosts(8, tp, ep)[rank]
    with_block = expected_shards(hf, {**config, "num_hidden_layers": n + 1}, rank, tp, ep, hosts)
    want = {k: v for k, v in with_block.items() if mode == "include" or (k.startswith(mtp)) == (mode == "only")}
    if mode != "off":
        want.update({mtp + k: hf[mtp + k] for k in REPLICATED})
        want.update({mtp + k: vocab_rows(hf[mtp + k], rank, tp) for k in VOCAB})
    return want


def stage_of(name: str, layers: int, pp: int) -> int:
    """vLLM's stage of a param at 2 layers on 2 stages: layer 0 and the embedding first, the rest (layer 1, the
    MTP layer 2, norm, lm_head) last."""
    m = re.match(r"model\.layers\.(\d+)\.", name)
    if m:
        return 0 if int(m.group(1)) < layers // pp else pp - 1
    return 0 if name == "model.embed_tokens.weight" else pp - 1


@pytest.mark.parametrize("mode", ["include", "only", "off"])
@pytest.mark.parametrize("world,ep", [(1, 1), (2, 1), (4, 1), (2, 2)])
def test_every_rank_holds_the_oracles_mtp_shards(ckpt, mode, world, ep):
    hf, config = checkpoint_tensors(ckpt), read_config(ckpt)
    plan = plan_for(ckpt, mode, world, ep=ep)
    assert plan.missing == () and plan.unexpected == ()
    for rank in range(world):
        problems = differences(materialise(plan, rank, hf), oracle(hf, config, mode, rank, world, ep),
                               f"mtp {mode} world {world} ep {ep} rank {rank}")
        assert not problems, "\n".join(problems)


@pytest.mark.parametrize("mode", ["include", "only"])
def test_glm4_moe_loads_its_mtp_layer_by_the_same_rules(glm_ckpt, mode):
    hf, config = checkpoint_tensors(glm_ckpt), read_config(glm_ckpt)
    plan = plan_for(glm_ckpt, mode, 2)
    assert plan.family == "glm4_moe" and plan.missing == () and plan.unexpected == ()
    for rank in range(2):
        problems = differences(materialise(plan, rank, hf), oracle(hf, config, mode, rank, 2, 1), f"glm rank {rank}")
        assert not problems, "\n".join(problems)


def test_under_pipeline_parallelism_the_mtp_layer_is_on_the_last_stage_only(ckpt):
    hf, config = checkpoint_tensors(ckpt), read_config(ckpt)
    n = config["num_hidden_layers"]
    plan = plan_for(ckpt, "include", 4, tp=2, pp=2)
    assert plan.missing == () and plan.unexpected == () and plan.layout.pp_layers == (1, 1)
    for rank in range(4):
        stage, t = rank // 2, rank % 2
        want = {k: v for k, v in oracle(hf, config, "include", t, 2, 1).items() if stage_of(k, n, 2) == stage}
        assert any(k.startswith(f"model.layers.{n}.") for k in want) == (stage == 1)
        problems = differences(materialise(plan, rank, hf), want, f"tp 2 x pp 2 rank {rank}")
        assert not problems, "\n".join(problems)
    only = plan_for(ckpt, "only", 4, tp=2, pp=2)   # the draft alone: the first stage holds and reads nothing
    assert [len(only.specs[r]) for r in range(4)][:2] == [0, 0] and only.specs[2] and only.specs[3]
    assert all(d.rank in (2, 3) for s in only.sources.values() for d in s.deliveries)


def test_bytes_read_by_mode(ckpt):
    """off: nothing of the MTP layer; include: every checkpoint byte once (the MTP layer's own embed_tokens is a
    tensor of its own, read once for the draft, as model.embed_tokens is for the target); only: the MTP layer."""
    config = read_config(ckpt)
    mtp = f"model.layers.{config['num_hidden_layers']}."
    mtp_bytes = sum(t.numel() * t.element_size() for k, t in checkpoint_tensors(ckpt).items() if k.startswith(mtp))
    total = tensor_bytes(ckpt)
    off, include, only = (plan_for(ckpt, mode, 2) for mode in ("off", "include", "only"))
    assert off.checkpoint_bytes == total - mtp_bytes and not any(s.startswith(mtp) for s in off.sources)
    assert include.ignored == ()
    assert include.checkpoint_bytes == total
    assert only.checkpoint_bytes == mtp_bytes and all(s.startswith(mtp) for s in only.sources)
    assert "lm_head.weight" in only.ignored and "model.layers.0.input_layernorm.weight" in only.ignored


def test_the_report_says_what_became_of_the_mtp_layers(ckpt):
    from distload.rules.mtp import describe, report_fields

    config = read_config(ckpt)
    off = report_fields(rules_for(config), config, Layout(world=2, tp=2))
    assert off["mode"] == "off" and off["layers"] == [2] and "--mtp include" in off["skipped"]
    include = report_fields(rules_for(config, mtp_mode="include"), config, Layout(world=4, tp=2, pp=2))
    assert include == {"mode": "include", "layers": [2], "stage": 1}
    assert describe(include) == "MTP layers 2: loaded (include) on pipeline stage 1"


def _load_include(path: str) -> list[str]:
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    result = distload.load(path, tp=world, mtp="include", progress=False)
    hf, config = checkpoint_tensors(path), read_config(path)
    assert result.report["mtp"] == {"mode": "include", "layers": [config["num_hidden_layers"]], "stage": 0}
    assert f"mtp=include(layers {config['num_hidden_layers']})" in summary_line(result.report)
    assert result.report["storage_bytes_read"] == tensor_bytes(path)   # every byte once, the MTP layer's too
    return differences(dict(result.params), oracle(hf, config, "include", rank, world, 1), f"rank {rank}")


def test_a_real_load_with_mtp_include_at_tp_2_equals_the_oracle(ckpt):
    problems = [p for rank_problems in run_ranks(2, _load_include, ckpt) for p in rank_problems]
    assert not problems, "\n".join(problems)


def test_mtp_on_a_model_without_mtp_layers_is_one_line_naming_the_option(tmp_path):
    path = save_checkpoint("llama", tmp_path / "llama")
    with pytest.raises(PlanError, match=r"--mtp only: .*num_nextn_predict_layers"):
        rules_for(read_config(path), mtp_mode="only")
    run = subprocess.run([sys.executable, "-m", "distload", "inspect", str(path), "--mtp", "only"],
                         capture_output=True, text=True, timeout=120)
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 1 and len(lines) == 1, run.stderr
    assert "--mtp only" in lines[0] and "num_nextn_predict_layers" in lines[0] and "--mtp off" in lines[0]


def test_a_bad_mode_is_refused_by_name():
    with pytest.raises(distload.errors.DistloadError, match=r"--mtp 'draft' \(mtp=\): choose one of off, include, only"):
        distload.LoadOptions(mtp="draft")


def test_vllms_draft_names_are_the_planned_mtp_params(ckpt):
    """vLLM 0.32's DeepSeekMTP params (deepseek_mtp.py: the block as mtp_block, the layer's embed_tokens as the
    draft's model.embed_tokens; FusedMoE's routed_experts), written out by hand, name exactly what mtp="only" plans."""
    from distload.serving.names import profile_for

    n = read_config(ckpt)["num_hidden_layers"]
    block = [f"model.layers.{n}.mtp_block.{x}" for x in (
        "input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.fused_qkv_a_proj.weight",
        "self_attn.q_a_layernorm.weight", "self_attn.q_b_proj.weight", "self_attn.kv_a_layernorm.weight",
        "self_attn.kv_b_proj.weight", "self_attn.o_proj.weight", "mlp.gate.weight", "mlp.gate.e_score_correction_bias",
        "mlp.experts.routed_experts.w13_weight", "mlp.experts.routed_experts.w2_weight",
        "mlp.shared_experts.gate_up_proj.weight", "mlp.shared_experts.down_proj.weight")]
    own = [f"model.layers.{n}.{x}" for x in REPLICATED + ("shared_head.head.weight",)]
    vllm_names = block + own + ["model.embed_tokens.weight"]
    profile = profile_for("vllm", "0.32.0")
    assert profile.is_draft(["DeepSeekMTPModel"]) and not profile.is_draft(["DeepseekV3ForCausalLM"])
    draft = profile.as_draft(n)
    assert sorted(draft.distload_name(name) for name in vllm_names) == sorted(plan_for(ckpt, "only", 2).specs[0])
    alias = f"model.layers.{n}.mtp_block.self_attn.mla_attn.kv_b_proj.weight"   # vLLM 0.32 holds it twice
    assert draft.distload_name(draft.alias_target(alias, set(vllm_names))) == f"model.layers.{n}.self_attn.kv_b_proj.weight"
    assert profile.distload_name("model.embed_tokens.weight") == "model.embed_tokens.weight"   # the target model's


def test_a_bad_mtp_table_is_refused_by_name(tmp_path):
    from distload.errors import RuleError
    from distload.rules import parse_rules

    bad = tmp_path / "bad.toml"
    bad.write_text('name = "bad"\narchitectures = ["X"]\nextends = "llama"\n[mtp]\ncount = "nextn"\n')
    with pytest.raises(RuleError, match=r"bad\.toml: \[mtp\] count names dim 'nextn', not in \[dims\]"):
        parse_rules(bad)


def test_a_block_fp8_mtp_layer_is_cut_as_its_decoder_layer_with_its_scales(tmp_path):
    """DeepSeek's FP8 release quantizes the MTP block and eh_proj too: their weight_scale_inv travel with them,
    every byte read once, each MTP param and scale of the shape of the same param of the last decoder layer."""
    from fp8_checkpoints import quantized_checkpoint
    from fp8_checkpoints import BLOCK_DIMS

    bf16 = save_checkpoint("deepseek_v3", tmp_path / "bf16", dtype=torch.bfloat16, max_shard_size="2MB", **BLOCK_DIMS)
    fp8 = str(quantized_checkpoint(with_whole_mtp_layer(bf16, tmp_path / "mtp"), tmp_path / "fp8", "block",
                                   block=(128, 128)))
    plan = plan_for(fp8, "include", 2)
    assert plan.missing == () and plan.unexpected == () and plan.checkpoint_bytes == tensor_bytes(fp8)
    n = read_config(fp8)["num_hidden_layers"]
    for rank in range(2):
        specs = plan.specs[rank]
        block = {k[len(f"model.layers.{n}."):]: s for k, s in specs.items() if k.startswith(f"model.layers.{n}.")}
        assert "eh_proj.weight_scale_inv" in block and "self_attn.kv_b_proj.weight_scale_inv" in block
        for name, spec in block.items():
            decoder = specs.get(f"model.layers.{n - 1}.{name}")
            assert decoder is None or (decoder.local_shape, decoder.dtype) == (spec.local_shape, spec.dtype), name


def test_the_command_line_loads_the_mtp_layer_and_reports_it(ckpt, tmp_path):
    from jobs import torchrun

    report = tmp_path / "report.json"
    run = torchrun(2, "load", ckpt, "--tp", "2", "--mtp", "include", "--report", str(report), "--no-progress")
    assert run.returncode == 0, run.stderr
    got = json.loads(report.read_text())
    n = read_config(ckpt)["num_hidden_layers"]
    assert got["ok"] and got["mtp"] == {"mode": "include", "layers": [n], "stage": 0}
    assert got["storage_bytes_read"] == tensor_bytes(ckpt) and got["ignored"] == []
