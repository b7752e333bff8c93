"""vLLM serves what distload loads: load_format="distload" against vLLM's own safetensors load, at tp 2 on CPU.

Each case starts vLLM instances through tests/vllm_serve.py (one process tree per load format) and
compares what every worker held (tests/vllm_probe.py): each param as loaded, before vLLM's post-load
processing, and the whole state_dict after it, bit for bit; for dense models also 16 greedy tokens.
The same for a distload save served with load_format="sharded_state" (distload/serving/vllm_save.py).
Then as a user meets it: vLLM's OpenAI server started by the README's own command (tests/support/vllm_http.py), one
server per loader (distload, vLLM's own, sharded_state of a `--for vllm` save), each asked the same three completions
over HTTP; a bad loader config value and a truncated weight file end the server with distload's line last; and the
venv itself is the one the README's install block makes (scripts/vllm_stage.sh builds it so).
The instances need vLLM in the running interpreter (scripts/vllm_stage.sh makes such a venv and runs this
file there); the naming-profile and export tests need none.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from distload.errors import DistloadError, PlanError, RuleError
from distload.inspect_cmd import inspect_load
from distload.options import LoadOptions
from distload.serving.names import profile_for
from distload.serving.vllm_save import architecture_aliased, engine_tensors
from distload.serving.vllm_save import export as export_for_vllm

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM is not installed in this interpreter: scripts/vllm_stage.sh runs "
                                       "these tests in a venv of their own (pip install 'distload[vllm]')")

HERE = Path(__file__).resolve().parents[1] / "support"  # vllm_serve.py, vllm_probe.py
SERVE = HERE / "vllm_serve.py"
SIZES = dict(hidden_size=128, head_dim=32)  # vLLM's CPU attention takes head_dim 32 and up
# What DeepSeek-V3's released config.json says and transformers' config leaves out: vLLM makes the router's
# e_score_correction_bias only for topk_method noaux_tc.
OVERRIDES = {"deepseek_v3": dict(topk_method="noaux_tc", scoring_func="sigmoid")}
STEPS = 16
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0|1"}
_runs: dict[tuple, dict] = {}  # one vLLM instance per (checkpoint, format, ep) for the whole module


def run_vllm(ckpt: Path, load_format: str, tmp: Path, ep: bool = False, tokens: bool = True, pp: int = 1,
             mtp: bool = False) -> dict:
    """One instance's result (vllm_serve.py's JSON); with load_format="distload", also distload's report."""
    key = (str(ckpt), load_format, ep, tokens, pp, mtp)
    if key in _runs:
        return _runs[key]
    tag = f"{Path(ckpt).name}-{load_format}-{'ep' if ep else 'tp'}-pp{pp}" + "-mtp" * mtp
    out, report = tmp / f"{tag}.json", tmp / f"{tag}-report.json"
    extra = {"report": str(report)} if load_format == "distload" else {}
    cmd = [sys.executable, str(SERVE), str(ckpt), load_format, str(out), "--extra", json.dumps(extra)]
    cmd += ["--ep"] * ep + ["--tokens"] * tokens + ["--pp", str(pp)] + ["--mtp"] * mtp
    # PYTHONSAFEPATH (scripts/vllm_stage.sh) keeps the script's folder off sys.path: vllm_serve imports vllm_probe.
    path = os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH", "")) if p)
    proc = subprocess.run(cmd, env={**os.environ, **VLLM_ENV, "PYTHONPATH": path}, cwd=HERE, capture_output=True,
                          text=True, timeout=900)
    if proc.returncode != 0:
        raise AssertionError(f"vLLM ({load_format}) exited {proc.returncode}:\n{proc.stderr[-6000:]}")
    result = json.loads(out.read_text())
    if load_format == "distload":
        result["report"] = json.loads(report.read_text())
    _runs[key] = result
    return result


def assert_same_state(ours: dict, theirs: dict) -> None:
    assert len(ours["ranks"]) == len(theirs["ranks"]) == 2
    for rank, (mine, ref) in enumerate(zip(ours["ranks"], theirs["ranks"])):
        for stage in ("loaded", "processed"):
            assert ref[stage], f"rank {rank}: no {stage} snapshot"
            assert mine[stage].keys() == ref[stage].keys(), f"rank {rank} {stage}: different names"
            differ = sorted(n for n in ref[stage] if mine[stage][n] != ref[stage][n])
            assert not differ, f"rank {rank} {stage}: params differ: {differ[:10]}"


def assert_read_once(result: dict) -> None:
    report = result["report"]
    assert report["ok"], report
    assert report["world_size"] == 2
    assert report["storage_bytes_read"] == report["checkpoint_bytes"], report


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from hf_models import save_checkpoint

    root = tmp_path_factory.mktemp("vllm_ckpts")
    made = {}

    def checkpoint(family: str) -> Path:
        if family not in made:
            made[family] = save_checkpoint(family, root / family, dtype=torch.bfloat16,
                                           **{**SIZES, **OVERRIDES.get(family, {})})
        return made[family]
    return checkpoint


def distload_save(ckpt: Path, out: Path, *extra: str, nproc: int = 2) -> Path:
    """`distload load CKPT --tp 2 --save-sharded OUT` under torchrun, as a training job would."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "-m", "distload", "load",
           str(ckpt), "--tp", "2", "--save-sharded", str(out), "--no-progress", *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


@needs_vllm
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_dense_tp2_state_and_tokens(family, checkpoints, tmp_path):
    ckpt = checkpoints(family)
    ours, theirs = run_vllm(ckpt, "distload", tmp_path), run_vllm(ckpt, "safetensors", tmp_path)
    assert_same_state(ours, theirs)
    assert len(theirs["tokens"]) == STEPS
    assert ours["tokens"] == theirs["tokens"]
    assert_read_once(ours)


@needs_vllm
@pytest.mark.parametrize("kind", ["fp8", "int8"])
def test_channel_quantized_llama_tp2_state_and_tokens(kind, checkpoints, tmp_path):
    """Per-channel FP8 (compressed-tensors strategy channel, FP8-dynamic) and INT8 W8A8 Llama, made by
    tests/support/channel_checkpoints.py: every param vLLM holds, before and after its post-load processing (its
    CPU kernels: ChannelWiseTorchFP8ScaledMM, CPUInt8ScaledMM), is bitwise its default loader's, and the greedy
    tokens are. vLLM 0.32's CPU build builds no FP8 fused MoE ('Unsupported FP8 MoE backend: NONE', with either
    loader): the MoE cut is checked against the oracle in tests/checkpoints/test_channel_quant.py."""
    import channel_checkpoints as cc

    ckpt = cc.channel_checkpoint(checkpoints("llama"), tmp_path / f"llama-{kind}", kind)
    ours, theirs = run_vllm(ckpt, "distload", tmp_path), run_vllm(ckpt, "safetensors", tmp_path)
    assert_same_state(ours, theirs)
    assert len(theirs["tokens"]) == STEPS and ours["tokens"] == theirs["tokens"]
    assert_read_once(ours)
    assert ours["report"]["quantization"].startswith(f"{kind}-channel")
    loaded = ours["ranks"][0]["loaded"]
    assert loaded["model.layers.0.self_attn.qkv_proj.weight_scale"].startswith("torch.float32 [")   # [rows, 1]
    hidden = SIZES["hidden_size"]   # o_proj is row-parallel: its scale is whole on every rank
    assert loaded["model.layers.0.self_attn.o_proj.weight_scale"].startswith(f"torch.float32 [{hidden}, 1]")


@needs_vllm
@pytest.mark.parametrize("family,ep", [("mixtral", False), ("mixtral", True), ("qwen3_moe", False), ("qwen2_moe", False),
                                       ("deepseek_v3", False), ("gpt_oss", False)])
def test_moe_tp2_state(family, ep, checkpoints, tmp_path):
    ckpt = checkpoints(family)  # no tokens: vLLM's CPU fused-MoE kernel crashes generating with EP
    ours = run_vllm(ckpt, "distload", tmp_path, ep=ep, tokens=False)
    theirs = run_vllm(ckpt, "safetensors", tmp_path, ep=ep, tokens=False)
    assert_same_state(ours, theirs)
    assert_read_once(ours)


@needs_vllm
def test_mtp_draft_state(checkpoints, tmp_path):
    """DeepSeek-V3 with its MTP layer served as the speculative draft (vLLM's DeepSeekMTP, loaded through the
    plugin with mtp="only"): the draft's params as vLLM's default loader fills them, and the target's too. No
    tokens: vLLM's CPU MLA backend does not generate with these tiny head sizes."""
    from hf_models import with_whole_mtp_layer

    ckpt = with_whole_mtp_layer(checkpoints("deepseek_v3"), tmp_path / "deepseek_v3_mtp")
    ours = run_vllm(ckpt, "distload", tmp_path, tokens=False, mtp=True)
    theirs = run_vllm(ckpt, "safetensors", tmp_path, tokens=False, mtp=True)
    assert_same_state(ours, theirs)
    for rank, (mine, ref) in enumerate(zip(ours["ranks"], theirs["ranks"])):
        assert "draft" in ref and ref["draft"]["loaded"], f"rank {rank}: vLLM built no MTP draft"
        assert any(".mtp_block." in n for n in ref["draft"]["loaded"]), sorted(ref["draft"]["loaded"])[:10]
        assert_same_state({"ranks": [mine["draft"]] * 2}, {"ranks": [ref["draft"]] * 2})


@needs_vllm
def test_pipeline_parallel_state(checkpoints, tmp_path):
    """pipeline_parallel_size 2 (tp 1): each stage's params as vLLM's default loader fills them, the job reading
    the checkpoint once. No tokens: vLLM's CPU build fails generating with PP, with either loader."""
    ckpt = checkpoints("llama")
    ours = run_vllm(ckpt, "distload", tmp_path, tokens=False, pp=2)
    theirs = run_vllm(ckpt, "safetensors", tmp_path, tokens=False, pp=2)
    assert_same_state(ours, theirs)
    assert sorted(ours["ranks"][0]["loaded"]) != sorted(ours["ranks"][1]["loaded"])  # each stage its own layers
    assert_read_once(ours)
    assert ours["report"]["pp"] == 2


@needs_vllm
@pytest.mark.parametrize("family,tokens", [("llama", True), ("mixtral", False), ("qwen3_moe", False)])
def test_distload_save_served_as_sharded_state(family, tokens, checkpoints, tmp_path):
    ckpt = checkpoints(family)
    served = export_for_vllm(distload_save(ckpt, tmp_path / "save"), tmp_path / "vllm")
    ours = run_vllm(served, "sharded_state", tmp_path, tokens=tokens)
    theirs = run_vllm(ckpt, "safetensors", tmp_path, tokens=tokens)
    assert_same_state(ours, theirs)
    assert ours.get("tokens") == theirs.get("tokens")


@needs_vllm
def test_a_vllm_param_no_rule_fills_is_refused_by_name_before_any_read(checkpoints):
    from distload.engines.contract import check_destinations

    plan = inspect_load(str(checkpoints("llama")), LoadOptions(tp=2)).plan  # headers only
    specs = plan.specs[0]
    into = {name: torch.empty(spec.local_shape, dtype=torch.bfloat16) for name, spec in specs.items()}
    with pytest.raises(PlanError, match=r"no rule fills: 'model\.layers\.0\.self_attn\.extra\.weight'.*"
                                        r"configs/llama\.toml.*configs/serving/vllm\.toml"):
        check_destinations({**into, "model.layers.0.self_attn.extra.weight": torch.empty(2)}, specs, plan.family, None,
                           "vllm")
    down = "model.layers.1.mlp.down_proj.weight"
    with pytest.raises(PlanError, match=rf"{down}: vLLM \[64, 64\], distload's shard"):
        check_destinations({**into, down: torch.empty(64, 64, dtype=torch.bfloat16)}, specs, plan.family, None, "vllm")
    check_destinations(into, specs, plan.family, None, "vllm")


def test_a_quantized_models_kv_cache_scales_are_left_as_vllm_made_them():
    """vLLM makes q/k/v scales (and zero points) beside each attention of a quantized model; a checkpoint without
    kv-cache scales leaves them unfilled, so the plugin leaves them too (configs/serving/vllm.toml `unfilled`)."""
    profile = profile_for("vllm", "0.32.0+cpu")
    assert profile.leaves("model.layers.3.self_attn.attn.k_scale")
    assert profile.leaves("model.layers.3.self_attn.attn.v_zero_point")
    assert not profile.leaves("model.layers.3.self_attn.o_proj.weight_scale")


def test_unknown_vllm_version_is_refused_by_name():
    with pytest.raises(RuleError, match=r"vllm 0\.99\.1.*add a \[\[profile\]\].*vllm\.toml"):
        profile_for("vllm", "0.99.1")


def test_profile_renames_both_ways_and_knows_the_router_alias():
    profile = profile_for("vllm", "0.32.0+cpu")
    engine = "model.layers.3.mlp.experts.routed_experts.w13_weight"
    assert profile.distload_name(engine) == "model.layers.3.mlp.experts.w13_weight"
    assert profile.engine_name(profile.distload_name(engine)) == engine
    assert profile.alias_target("model.layers.3.mlp.experts.gate.weight") == "model.layers.3.mlp.gate.weight"
    assert profile.aliases_of("model.layers.3.mlp.gate.weight", (".mlp.experts.gate.weight",)) == \
        ["model.layers.3.mlp.experts.gate.weight"]
    assert profile_for("vllm", "0.31.2").distload_name(engine) == engine


def test_an_alias_suffix_names_the_param_the_model_has():
    profile = profile_for("vllm", "0.32.0")
    held = "model.layers.1.mlp.experts._shared_experts._layer.gate_up_proj.weight"
    qwen2_moe, deepseek = "model.layers.1.mlp.shared_expert.gate_up_proj.weight", \
        "model.layers.1.mlp.shared_experts.gate_up_proj.weight"
    assert profile.alias_target(held, {qwen2_moe, held}) == qwen2_moe
    assert profile.alias_target(held, {deepseek, held}) == deepseek
    assert profile.alias_target(held, {held}) is None  # no param it could duplicate: a param of its own
    assert profile.alias_target("model.layers.0.self_attn.mla_attn.mla_attn.kv_b_proj.weight") == \
        "model.layers.0.self_attn.kv_b_proj.weight"


def test_export_names_one_tensor_once_and_adds_attention_scales():
    profile = profile_for("vllm", "0.32.0")
    gate, w13 = torch.arange(8.0).reshape(2, 4), torch.arange(24.0).reshape(1, 6, 4)
    tensors = {"model.layers.0.mlp.gate.weight": gate, "model.layers.0.mlp.experts.w13_weight": w13,
               "model.layers.0.self_attn.o_proj.weight": torch.zeros(4, 2), "model.embed_tokens.weight": gate}
    out = engine_tensors(tensors, {"lm_head.weight": "model.embed_tokens.weight"}, profile, aliased=(".mlp.experts.gate.weight",))
    assert sorted(out) == sorted(["model.layers.0.mlp.experts.gate.weight", "lm_head.weight",
                                  "model.layers.0.mlp.experts.routed_experts.w13_weight",
                                  "model.layers.0.self_attn.o_proj.weight",
                                  *(f"model.layers.0.self_attn.attn.{b}" for b in
                                    ("_k_scale", "_v_scale", "_q_scale", "_prob_scale"))])
    assert out["model.layers.0.mlp.experts.gate.weight"] is gate and out["lm_head.weight"] is gate
    assert out["model.layers.0.self_attn.attn._k_scale"].dtype == torch.float32
    assert "model.layers.0.mlp.gate.weight" in engine_tensors(tensors, {}, profile, aliased=())


def test_export_refuses_an_architecture_without_sharded_state_names():
    profile = profile_for("vllm", "0.32.0")
    assert architecture_aliased({"architectures": ["Qwen3MoeForCausalLM"]}, profile, "0.32.0")
    assert not architecture_aliased({"architectures": ["LlamaForCausalLM"]}, profile, "0.32.0")
    with pytest.raises(DistloadError, match=r"Qwen2MoeForCausalLM.*\[profile\.sharded_state\].*vllm\.toml"):
        architecture_aliased({"architectures": ["Qwen2MoeForCausalLM"]}, profile, "0.32.0")


def test_save_sharded_for_vllm_writes_what_the_export_writes_beside_a_save_that_still_reloads(checkpoints, tmp_path):
    """`--save-sharded OUT --for vllm==V` in one job: OUT holds vLLM's files, tensor for tensor what the
    export (served by vLLM in test_distload_save_served_as_sharded_state) writes, and is still a distload
    save. A job whose world is not its tp is refused before any byte moves."""
    from safetensors.torch import load_file

    from distload.serving.vllm_save import VLLM_FILE

    ckpt = checkpoints("llama")
    out = distload_save(ckpt, tmp_path / "out", "--for", "vllm==0.32.0")
    reference = export_for_vllm(distload_save(ckpt, tmp_path / "plain"), tmp_path / "exported", "0.32.0")
    for rank in range(2):
        ours, theirs = (load_file(d / VLLM_FILE.format(rank=rank)) for d in (out, reference))
        assert sorted(ours) == sorted(theirs)
        assert all(torch.equal(ours[n], theirs[n]) for n in theirs)
    assert json.loads((out / "config.json").read_text()) == json.loads((reference / "config.json").read_text())
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "distload", "load",
           str(out), "--no-progress"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "every param loaded exactly once" in proc.stdout, proc.stderr[-4000:]
    with pytest.raises(AssertionError, match=r"--for vllm==0\.32\.0: vLLM's sharded_state reads one file per tp rank"):
        distload_save(ckpt, tmp_path / "replicas", "--for", "vllm==0.32.0", nproc=4)
    assert not (tmp_path / "replicas").exists()



# -- vLLM's OpenAI server, started as the README writes it -------------------------------------------------------------

PROMPTS = ["w17 w42 w99 w7", "w3 w150 w64", "w200 w5 w88 w31 w9"]
DISTLOAD_ARGS = re.compile(r" --load-format distload --model-loader-extra-config '[^']*'")
_answers: dict[str, list[dict]] = {}   # per loader, the server's completions of PROMPTS (one server per loader)


def readme_server_command(loader: str = "distload", extra_config: str | None = None) -> str:
    """The README's CPU server command (<!-- block: vllm-serve-cpu -->) as it is, or with another loader or
    another model_loader_extra_config in place of distload's."""
    from readme_blocks import command

    readme = command("vllm-serve-cpu")
    assert DISTLOAD_ARGS.search(readme), readme
    if extra_config is not None:
        return DISTLOAD_ARGS.sub(f" --load-format distload --model-loader-extra-config '{extra_config}'", readme)
    if loader == "distload":
        return readme
    return DISTLOAD_ARGS.sub("" if loader == "auto" else f" --load-format {loader}", readme)


@pytest.fixture(scope="module")
def tokenized(checkpoints):
    from vllm_http import add_tokenizer

    return add_tokenizer(checkpoints("llama"))


def answers(loader: str, ckpt: Path, workdir: Path) -> list[dict]:
    """The completions of PROMPTS by one server (`loader`: distload, auto for vLLM's own, or sharded_state)."""
    from vllm_http import Server

    if loader not in _answers:
        workdir.mkdir(parents=True, exist_ok=True)
        server = Server(readme_server_command(loader), ckpt, workdir).start()
        try:
            server.wait_ready()
            _answers[loader] = [server.complete(prompt) for prompt in PROMPTS]
        finally:
            server.stop()
    return _answers[loader]


def assert_same_answers(ours: list[dict], theirs: list[dict]) -> None:
    from vllm_http import STEPS

    for prompt, mine, ref in zip(PROMPTS, ours, theirs):
        assert len(ref["tokens"]) == STEPS and ref["text"].split(), (prompt, ref)
        assert mine["text"] == ref["text"], (prompt, mine["text"], ref["text"])
        assert mine["tokens"] == ref["tokens"] and mine["logprobs"] == ref["logprobs"], (prompt, mine, ref)


@needs_vllm
def test_the_openai_server_as_the_readme_starts_it_answers_as_vllms_own_loader(tokenized, tmp_path_factory):
    """`python -m vllm.entrypoints.openai.api_server ... --load-format distload ...` verbatim from the README (plus a
    port, --enforce-eager and --max-model-len), 3 completions over HTTP: vLLM's own loader's text, tokens, logprobs."""
    workdir = tmp_path_factory.mktemp("served-distload")
    ours = answers("distload", tokenized, workdir)
    theirs = answers("auto", tokenized, tmp_path_factory.mktemp("served-auto"))
    assert_same_answers(ours, theirs)
    report = json.loads((workdir / "load.json").read_text())   # the README's "report": "load.json", in the cwd
    assert report["ok"] and report["world_size"] == 2
    assert report["storage_bytes_read"] == report["checkpoint_bytes"], report


@needs_vllm
def test_a_for_vllm_save_served_by_the_openai_server_with_sharded_state(tokenized, tmp_path, tmp_path_factory):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "distload", "load",
           str(tokenized), "--tp", "2", "--save-sharded", str(tmp_path / "save"), "--for", "vllm", "--no-progress"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert f"saved 2 rank files and manifest.json to {tmp_path / 'save'}" in proc.stdout, proc.stdout
    assert "load_format='sharded_state'" in proc.stdout, proc.stdout
    ours = answers("sharded_state", tmp_path / "save", tmp_path_factory.mktemp("served-sharded"))
    theirs = answers("auto", tokenized, tmp_path_factory.mktemp("served-auto"))
    assert_same_answers(ours, theirs)


def assert_ends_with_distloads_line(server, *expected: str) -> list[str]:
    """The server stops by itself within 60 s of distload's failure, distload's line among its last 5 lines."""
    failed_at = None
    while failed_at is None:
        rc = server.wait_exit(5)
        failed_at = server.first_line_with("distload.errors.")
        if rc is not None and failed_at is None:
            raise AssertionError(f"the server exited {rc} with no distload error:\n{server.tail()}")
    rc = server.wait_exit(max(1.0, failed_at + 60 - time.monotonic()))
    assert rc is not None, f"the server still runs 60 s after distload's failure:\n{server.tail()}"
    assert rc != 0
    last = [line for _, line in server.lines[-5:]]
    said = [line for line in last if re.match(r"distload: error on ranks? \d", line)]
    assert said, "\n".join(last)
    for text in expected:
        assert any(text in line for line in said), (text, last)
    return said


@needs_vllm
def test_a_bad_loader_config_value_ends_the_server_with_distloads_line_last(tokenized, tmp_path):
    from vllm_http import Server

    server = Server(readme_server_command(extra_config='{"readers": "bogus"}'), tokenized, tmp_path).start()
    try:
        said = assert_ends_with_distloads_line(server, """model_loader_extra_config "readers": 'bogus'""")
    finally:
        server.stop()
    assert not any("--readers" in line for line in said), said   # the key as the user wrote it


@needs_vllm
def test_a_truncated_weight_file_ends_the_server_with_distloads_line_last(tokenized, tmp_path):
    from vllm_http import Server

    broken = shutil.copytree(tokenized, tmp_path / "broken")
    victim = sorted(broken.glob("*.safetensors"))[-1]
    os.truncate(victim, victim.stat().st_size - 100)
    server = Server(readme_server_command(), broken, tmp_path).start()
    try:
        assert_ends_with_distloads_line(server, victim.name)
    finally:
        server.stop()


@needs_vllm
def test_this_venv_is_the_one_the_readmes_install_block_makes():
    """scripts/vllm_stage.sh makes its venv by running the README's install block as it is, in a fresh copy of the
    checkout, and stamps it; this venv carries the stamp of the block, script and extra of this checkout, and there
    vLLM imports and knows load_format="distload" from the plugin's entry point."""
    from readme_blocks import STAMP_FILE, install_stamp

    stamp = Path(sys.prefix) / STAMP_FILE
    if not stamp.is_file() and os.environ.get("DISTLOAD_VLLM_VENV"):
        pytest.skip(f"DISTLOAD_VLLM_VENV={os.environ['DISTLOAD_VLLM_VENV']}: a venv made by hand, not by the README")
    assert stamp.is_file(), f"{sys.prefix} was not made by the README's install block (scripts/vllm_stage.sh)"
    assert stamp.read_text().strip() == install_stamp(), "the README's install block changed since this venv was made"
    probe = ("from vllm.config.load import LoadConfig\n"
             "from vllm.model_executor.model_loader import get_model_loader\n"
             "from vllm.plugins import load_general_plugins\n"
             "load_general_plugins()\n"
             "print(type(get_model_loader(LoadConfig(load_format='distload'))).__module__)")
    proc = subprocess.run([sys.executable, "-P", "-c", probe], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("distload.engines.vllm"), proc.stderr[-3000:]
