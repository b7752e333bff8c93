"""Packed 4-bit checkpoints (issue 23): plan-time cuts and refusals, then whole loads on real gloo ranks.

The checkpoints are made here from a tiny Hugging Face Llama (tests/hf_models.py) by the reference quantizer
(tests/quant4_reference.py) in each format's on-disk layout (tests/quant4_checkpoints.py). Expectations
come from neither the planner nor the kernels: each packed tensor is spread over its logical weight's grid,
cut by tests/layout_oracle.py like a float weight and sampled back; with --dequantize every rank's BF16
shard equals the oracle's cut of the reference dequantization of the full tensor.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import quant4_checkpoints as q4
from fp8_checkpoints import skew_parts
from distload.checkpoint import discover
from distload.errors import PlanError
from distload.plan import build_plan
from distload.quant import for_load
from distload.rules import rules_for
from distload.topology import Layout
from layout_oracle import serving_shards
from spawn import run_ranks
from quant4_checkpoints import reload_differences, save_sharded_at_tp2

FORMATS = ["gptq", "gptq-act", "awq", "ct", "ct-asym", "nvfp4", "bnb", "bnb-nested"]
MOE_FORMATS = ["gptq-act", "awq", "ct-asym", "nvfp4"]
ROW_STYLE = ("self_attn.o_proj.", "mlp.down_proj.")
SERVING_LINEARS = ("self_attn.qkv_proj.", "self_attn.o_proj.", "mlp.gate_up_proj.", "mlp.down_proj.")
PARTS = {"self_attn.qkv_proj.": ("self_attn.q_proj.", "self_attn.k_proj.", "self_attn.v_proj."),
         "self_attn.o_proj.": ("self_attn.o_proj.",), "mlp.gate_up_proj.": ("mlp.gate_proj.", "mlp.up_proj."),
         "mlp.down_proj.": ("mlp.down_proj.",)}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from hf_models import save_checkpoint

    root = tmp_path_factory.mktemp("quant4")
    llama = save_checkpoint("llama", root / "llama", dtype=torch.bfloat16)
    # bitsandbytes blocks hold 64 inputs: a wider model, so that tp 4 cuts whole blocks
    wide = save_checkpoint("llama", root / "llama-wide", dtype=torch.bfloat16, hidden_size=256, intermediate_size=512,
                           max_shard_size="1MB")
    moe = save_checkpoint("qwen3_moe", root / "qwen3-moe", dtype=torch.bfloat16)
    # up 1/4 of gate, k 4x q: fused parts whose NVFP4 global scales (weight_scale_2) differ
    skewed = skew_parts(save_checkpoint("llama", root / "llama-skewed", dtype=torch.bfloat16))
    return {"llama": llama, **{fmt: q4.packed_checkpoint(wide if fmt.startswith("bnb") else llama, root / fmt, fmt)
                               for fmt in FORMATS},
            "nvfp4-skewed": q4.packed_checkpoint(skewed, root / "nvfp4-skewed", "nvfp4"),
            **{f"moe-{fmt}": q4.packed_checkpoint(moe, root / f"moe-{fmt}", fmt) for fmt in MOE_FORMATS}}


def _plan(path, tp=2, **options):
    index = discover(str(path))
    return build_plan(index.tensors, index.config, rules_for(index.config), Layout(world=tp, tp=tp),
                      quantization=for_load(index.config, **options))


# ----------------------------------------------------------------------------------------------------
# Plan time


def test_gptq_specs_follow_vllm_serving_layout(checkpoints):
    plan = _plan(checkpoints["gptq"])
    a = "model.layers.0."
    got = {n: (s.dtype, s.local_shape) for n, s in plan.specs[1].items() if n.startswith(a) and "norm" not in n}
    # hidden 64, q 64 rows, k/v 32 each (2 kv heads of 16), intermediate 128, group 16, tp 2
    assert got == {
        a + "self_attn.qkv_proj.qweight": ("I32", (8, 64)), a + "self_attn.qkv_proj.qzeros": ("I32", (4, 8)),
        a + "self_attn.qkv_proj.scales": ("F16", (4, 64)), a + "self_attn.qkv_proj.g_idx": ("I32", (64,)),
        a + "self_attn.o_proj.qweight": ("I32", (4, 64)), a + "self_attn.o_proj.qzeros": ("I32", (2, 8)),
        a + "self_attn.o_proj.scales": ("F16", (2, 64)), a + "self_attn.o_proj.g_idx": ("I32", (32,)),
        a + "mlp.gate_up_proj.qweight": ("I32", (8, 128)), a + "mlp.gate_up_proj.qzeros": ("I32", (4, 16)),
        a + "mlp.gate_up_proj.scales": ("F16", (4, 128)), a + "mlp.gate_up_proj.g_idx": ("I32", (64,)),
        a + "mlp.down_proj.qweight": ("I32", (8, 64)), a + "mlp.down_proj.qzeros": ("I32", (4, 8)),
        a + "mlp.down_proj.scales": ("F16", (4, 64)), a + "mlp.down_proj.g_idx": ("I32", (64,)),
    }
    assert plan.specs[1][a + "self_attn.qkv_proj.g_idx"].style == "replicate"
    assert plan.quantization.startswith("gptq group 16")
    assert not plan.missing and not plan.unexpected


def test_gptq_desc_act_row_parallel_keeps_scales_whole(checkpoints):
    plan = _plan(checkpoints["gptq-act"])
    o = "model.layers.0.self_attn.o_proj."
    spec = plan.specs[1]
    assert spec[o + "scales"].local_shape == (4, 64) and spec[o + "scales"].style == "replicate"
    assert spec[o + "qzeros"].local_shape == (4, 8) and spec[o + "g_idx"].local_shape == (32,)


@pytest.mark.parametrize("fmt, tp", [(f, tp) for f in FORMATS for tp in (1, 2, 4)])
def test_every_format_plans_at_tp_1_2_4(checkpoints, fmt, tp):
    plan = _plan(checkpoints[fmt], tp=tp)
    assert not plan.missing and not plan.unexpected
    deq = _plan(checkpoints[fmt], tp=tp, dequantize=True)
    w, config = deq.specs[0]["model.layers.1.mlp.gate_up_proj.weight"], discover(str(checkpoints[fmt])).config
    assert (w.dtype, w.local_shape) == ("BF16", (2 * config["intermediate_size"] // tp, config["hidden_size"]))
    assert all(len(steps) == 2 * 4 for steps in deq.post)


@pytest.mark.parametrize("fmt, tp, words", [
    ("gptq", 8, "num_attention_heads=4"),                         # the heads refuse first
    ("awq", 4, None), ("nvfp4", 4, None),
])
def test_tp_that_splits_nothing_is_accepted_or_refused_by_heads(checkpoints, fmt, tp, words):
    if words is None:
        _plan(checkpoints[fmt], tp=tp)
        return
    with pytest.raises(PlanError, match=words):
        _plan(checkpoints[fmt], tp=tp)


def _regroup(path: Path, out: Path, group: int) -> Path:
    """The same checkpoint metadata claiming a bigger group: scales and zeros resized (their bytes unread)."""
    import json
    import shutil

    shutil.copytree(path, out)
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"]["group_size"] = group
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_a_tp_that_splits_a_group_is_refused_with_the_numbers(checkpoints, tmp_path):
    from safetensors.torch import load_file, save_file

    path = _regroup(checkpoints["awq"], tmp_path / "awq64", 64)
    for f in path.glob("*.safetensors"):   # group 64: one group per 64 inputs
        t = load_file(f)
        for n in list(t):
            if n.endswith((".scales", ".qzeros")):
                t[n] = t[n][: t[n].shape[0] * 16 // 64].contiguous()
        save_file(t, str(f), metadata={"format": "pt"})
    _plan(path, tp=1)
    with pytest.raises(PlanError) as info:
        _plan(path, tp=2)
    msg = str(info.value)
    assert "o_proj" in msg and "tp=2" in msg and "64-value group of its" in msg and "(try tp 1)" in msg, msg


def test_an_odd_pack_is_refused(checkpoints, tmp_path):
    """hidden 64 with 16 heads: at tp 8 a rank's one kv head of 4 rows splits AWQ's 8-column words of k_proj."""
    import json
    import shutil

    path = tmp_path / "awq-heads"
    shutil.copytree(checkpoints["awq"], path)
    config = json.loads((path / "config.json").read_text())
    config.update(num_attention_heads=16, num_key_value_heads=8, head_dim=4)
    (path / "config.json").write_text(json.dumps(config))
    _plan(path, tp=1)
    with pytest.raises(PlanError, match=r"qkv_proj.weight \(rule qkv, awq group 16 .*tp=8 cuts .*k_proj.weight "
                                        r"at output 4, inside a 8-value pack of its q(weight|zeros).*\(try tp 1, 2, 4\)"):
        _plan(path, tp=8)


def test_scheme_errors_name_the_config_key():
    from distload.quant import checkpoint_format as checkpoint_scheme

    assert checkpoint_scheme({}) is None
    assert checkpoint_scheme({"quantization_config": {"quant_method": "fp8"}}).name == "fp8"
    with pytest.raises(PlanError, match="bits 8"):
        checkpoint_scheme({"quantization_config": {"quant_method": "gptq", "bits": 8}})
    with pytest.raises(PlanError, match="gptq_v2"):
        checkpoint_scheme({"quantization_config": {"quant_method": "gptq", "checkpoint_format": "gptq_v2"}})
    with pytest.raises(PlanError, match="version 'gemv'"):
        checkpoint_scheme({"quantization_config": {"quant_method": "awq", "version": "gemv"}})
    with pytest.raises(PlanError, match="FP8"):
        checkpoint_scheme({"quantization_config": {"quant_method": "modelopt", "quant_algo": "FP8"}})
    ct = {"quant_method": "compressed-tensors", "format": "pack-quantized",
          "config_groups": {"g": {"weights": {"num_bits": 8, "type": "int", "strategy": "group"}}}}
    with pytest.raises(PlanError, match="8-bit int"):
        checkpoint_scheme({"quantization_config": ct})


def test_dequantize_and_quantize_options(checkpoints):
    with pytest.raises(PlanError, match="already quantized"):
        _plan(checkpoints["gptq"], quantize="fp8")
    plan = _plan(checkpoints["gptq"], dequantize=True)
    assert "-> BF16" in plan.quantization
    assert not any(n.endswith((".qweight", ".qzeros", ".scales", ".g_idx")) for n in plan.specs[0])


# ----------------------------------------------------------------------------------------------------
# Whole loads: tp 2 on gloo ranks


def _expected_packed(ckpt: dict, config: dict, fmt: str, rank: int, tp: int, ep: int = 1) -> dict:
    """Rank `rank`'s packed serving tensors, cut by the oracle on each tensor's logical grid."""
    out = {}
    for suffix, orient in q4.ORIENT[fmt].items():
        hf = dict(ckpt)
        present = {q4.packed_base(n, fmt)[0] for n in ckpt if (q4.packed_base(n, fmt) or (0, 0))[1] == suffix}
        if not present:
            continue
        shapes = {b: q4.logical_shape(ckpt, b, fmt) for b in present}
        for b in present:
            if orient is not None:
                flat = fmt.startswith("bnb") and suffix in q4.FLAT
                hf[b + "weight"] = q4.logical_grid(ckpt[b + suffix], orient, *shapes[b], flat=flat)
        shards = serving_shards(hf, config, rank, tp, ep) if orient is not None else {}
        for i in range(config["num_hidden_layers"]):
            a = f"model.layers.{i}."
            moe = a + "mlp.gate.weight" in ckpt
            for serving, parts in PARTS.items():
                if moe and serving.startswith("mlp."):
                    continue
                name = a + serving + suffix
                if orient is None:   # per part, in part order
                    out[name] = torch.cat([ckpt[a + p + suffix].reshape(-1) for p in parts])
                    if len(parts) == 1:
                        out[name] = ckpt[a + parts[0] + suffix]
                elif fmt == "gptq-act" and suffix in ("scales", "qzeros") and serving in ROW_STYLE:
                    out[name] = ckpt[a + parts[0] + suffix]        # desc_act: every group on every rank
                else:
                    out[name] = q4.sample_back(shards[a + serving + "weight"], orient)
            if moe:
                out.update(_expected_experts(ckpt, config, fmt, suffix, orient, shards, a, rank, tp, ep))
    return out


def _expected_experts(ckpt, config, fmt, suffix, orient, shards, a, rank, tp, ep) -> dict:
    """w13_<suffix> / w2_<suffix> of the rank's local experts (ascending ids), like w13_weight / w2_weight."""
    n = config.get("num_experts") or config["num_local_experts"]
    ids = range((rank // (tp // ep)) * n // ep, (rank // (tp // ep) + 1) * n // ep)
    out = {}
    for w, parts in (("w13_", ("gate_proj.", "up_proj.")), ("w2_", ("down_proj.",))):
        name = a + "mlp.experts." + w + suffix
        if orient is None:   # input scales: every expert's (the kernels take their max)
            which = range(n) if suffix == "input_scale" else ids
            out[name] = torch.stack([torch.cat([ckpt[f"{a}mlp.experts.{e}.{p}{suffix}"].reshape(-1) for p in parts])
                                     for e in which])
        elif fmt == "gptq-act" and suffix in ("scales", "qzeros") and w == "w2_":
            out[name] = torch.stack([ckpt[f"{a}mlp.experts.{e}.down_proj.{suffix}"] for e in ids])
        else:
            grid = shards[a + "mlp.experts." + w + "weight"]
            out[name] = torch.stack([q4.sample_back(g, orient) for g in grid])
    return out


def _assemble(plan, ckpt: dict, rank: int) -> dict:
    """Rank `rank`'s staging params built in this process from the plan's deliveries (no transfer)."""
    from distload.dtypes import torch_dtype
    from distload.plan.shard import view2d

    out = {n: torch.zeros(s.local_shape, dtype=torch_dtype(s.dtype)) for n, s in plan.staging_specs(rank).items()}
    for src in plan.sources.values():
        full = ckpt[src.name].reshape(view2d(src.shape))   # flat bitsandbytes tensors: the plan's view
        for d in src.deliveries:
            if d.rank != rank:
                continue
            pc = d.piece
            dst = out[d.param].view(view2d(tuple(out[d.param].shape)))
            rows, cols = pc.rows[1] - pc.rows[0], pc.cols[1] - pc.cols[0]
            dst[pc.dst_row:pc.dst_row + rows, pc.dst_col:pc.dst_col + cols] = full[pc.rows[0]:pc.rows[1], pc.cols[0]:pc.cols[1]]
    return out


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_rank_cut_exact_at_tp_1_2_4(checkpoints, fmt):
    """The plan's pieces applied in-process: packed shards and their dequantization against the oracle."""
    from distload.quant import OPS
    from hf_models import checkpoint_tensors, read_config

    ckpt, config = checkpoint_tensors(checkpoints[fmt]), read_config(checkpoints[fmt])
    reference = q4.dequantized(ckpt, fmt)
    for tp in (1, 2, 4):
        plan, deq = _plan(checkpoints[fmt], tp=tp), _plan(checkpoints[fmt], tp=tp, dequantize=True)
        for rank in range(tp):
            got = _assemble(plan, ckpt, rank)
            for name, want in _expected_packed(ckpt, config, fmt, rank, tp).items():
                assert torch.equal(got[name].reshape(want.shape), want), (fmt, tp, rank, name)
            staged = _assemble(deq, ckpt, rank)
            oracle = serving_shards(reference, config, rank, tp)
            for step in deq.post[rank]:
                finals = [deq.specs[rank][n] for n in step.outputs]
                (w,) = OPS[step.op](step, finals, *(staged[n] for n in step.inputs))
                assert torch.equal(w, oracle[step.outputs[0]].to(torch.bfloat16)), (fmt, tp, rank, step.outputs)


@pytest.mark.parametrize("fmt", MOE_FORMATS)
def test_moe_experts_cut_exact_at_tp_and_ep(checkpoints, fmt):
    """Qwen3-MoE: w13_/w2_ packed tensors of each rank's local experts, TP-split inside, and dequantized."""
    from distload.quant import OPS
    from hf_models import checkpoint_tensors, read_config

    path = checkpoints[f"moe-{fmt}"]
    ckpt, config = checkpoint_tensors(path), read_config(path)
    reference = q4.dequantized(ckpt, fmt)
    index = discover(str(path))
    for tp, ep in ((1, 1), (2, 1), (2, 2), (4, 2)):
        layout = Layout(world=tp, tp=tp, ep=ep)
        plan = build_plan(index.tensors, index.config, rules_for(index.config), layout,
                          quantization=for_load(index.config))
        deq = build_plan(index.tensors, index.config, rules_for(index.config), layout,
                         quantization=for_load(index.config, dequantize=True))
        for rank in range(tp):
            got = {n: t for n, t in _assemble(plan, ckpt, rank).items() if n in plan.specs[rank]}  # not check-only
            want = _expected_packed(ckpt, config, fmt, rank, tp, ep)
            assert {n for n in got if "experts.w" in n} == {n for n in want if "experts.w" in n}
            for name, w in want.items():
                assert torch.equal(got[name].reshape(w.shape), w), (fmt, tp, ep, rank, name)
            staged = _assemble(deq, ckpt, rank)
            oracle = serving_shards(reference, config, rank, tp, ep)
            for step in deq.post[rank]:
                finals = [deq.specs[rank][n] for n in step.outputs]
                (w,) = OPS[step.op](step, finals, *(staged[n] for n in step.inputs))
                assert torch.equal(w, oracle[step.outputs[0]].to(torch.bfloat16)), (fmt, tp, ep, rank, step.outputs)


LOAD_CASES = ([(fmt, fmt, 1) for fmt in FORMATS] + [("nvfp4-skewed", "nvfp4", 1)]
              + [("moe-awq ep2", "awq", 2), ("moe-nvfp4 ep2", "nvfp4", 2)])
SERVING_PACKED = SERVING_LINEARS + ("mlp.experts.w",)


def _load_case(path: str, fmt: str, ep: int, rank: int, tp: int) -> list[str]:
    import distload
    from hf_models import checkpoint_tensors, read_config

    problems = []
    ckpt, config = checkpoint_tensors(path), read_config(path)
    packed = distload.load(path, tp=tp, ep=ep, progress=False)
    want = _expected_packed(ckpt, config, fmt, rank, tp, ep)
    held = {n for n in packed.params if any(s in n for s in SERVING_PACKED) and not n.endswith(".bias")}
    if held != set(want) or len(want) < 4 * config["num_hidden_layers"] * 2:
        problems.append(f"packed params {sorted(held ^ set(want))[:6]} differ from the oracle's")
    for name, t in want.items():
        got = packed.params.get(name)
        if got is None or got.dtype != t.dtype or not torch.equal(got.reshape(t.shape), t):
            problems.append(f"{name} differs from the oracle's cut"
                            + ("" if got is None else f" ({got.dtype} {list(got.shape)} vs {t.dtype} {list(t.shape)})"))
    deq = distload.load(path, tp=tp, ep=ep, progress=False, dequantize=True)
    oracle = serving_shards(q4.dequantized(ckpt, fmt), config, rank, tp, ep)
    for n, w in oracle.items():
        got = deq.params.get(n)
        want_w = w.to(torch.bfloat16) if any(s in n for s in SERVING_PACKED) else w
        if got is None or got.dtype != want_w.dtype or not torch.equal(got, want_w):
            problems.append(f"--dequantize: {n} differs from the reference dequantization")
    extra = sorted(set(deq.params) - set(oracle))
    if extra:
        problems.append(f"--dequantize: unexpected params {extra[:4]}")
    return problems + ["report not ok"] * (not packed.report["ok"] or not deq.report["ok"])


def _load_formats(paths: dict) -> dict:
    import torch.distributed as dist

    rank, tp = dist.get_rank(), dist.get_world_size()
    problems = []
    for case, fmt, ep in LOAD_CASES:
        path = paths[f"moe-{fmt}" if case.startswith("moe") else case]
        problems += [f"{case} rank {rank}: {p}" for p in _load_case(path, fmt, ep, rank, tp)]
    return {"problems": problems}


def test_skewed_nvfp4_parts_have_their_own_global_scales(checkpoints):
    """What the nvfp4-skewed load case stands on: gate and up (fused into gate_up_proj) scaled far apart."""
    from hf_models import checkpoint_tensors

    ckpt = checkpoint_tensors(checkpoints["nvfp4-skewed"])
    for i in range(2):
        a = f"model.layers.{i}.mlp."
        gate, up = (float(ckpt[a + p + "_proj.weight_scale_2"]) for p in ("gate", "up"))
        assert gate >= 3 * up, (i, gate, up)


def test_packed_4bit_loads_at_tp2(checkpoints):
    """Every format at tp 2 (and two MoE ones at ep 2) through distload.load on gloo ranks; NVFP4 also with gate
    and up at global scales 4x apart: packed, each part's weight_scale_2 carried in part order; dequantized, each
    part's rows its own reference dequantization."""
    results = run_ranks(2, _load_formats, {k: str(v) for k, v in checkpoints.items()})
    problems = [p for r in results for p in r["problems"]]
    assert not problems, "\n".join(problems[:40])


@pytest.mark.parametrize("fmt", ["gptq-act", "nvfp4"])
def test_sharded_save_reloads_and_reshards_packed_tensors(checkpoints, tmp_path, fmt):
    out = str(tmp_path / "sharded")
    run_ranks(2, save_sharded_at_tp2, str(checkpoints[fmt]), out)
    for tp in (2, 1):   # the same layout, and re-cut for tp 1
        differences = [n for r in run_ranks(tp, reload_differences, str(checkpoints[fmt]), out, tp) for n in r]
        assert not differences, (tp, sorted(differences)[:6])
