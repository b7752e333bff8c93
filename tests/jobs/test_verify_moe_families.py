"""`distload verify` for the families with a forward of their own (distload/models FORWARDS): DeepSeek-V3 (MLA,
grouped sigmoid routing, shared experts), GPT-OSS (sinks, sliding layers, yarn, interleaved clamped SwiGLU,
expert biases) and GLM-4.5-MoE, against transformers at tp 2 and tp 2 x ep 2 (and tp 4 with kv heads replicated).

What runs where: every case goes through `distload.verify.verify` (what the CLI calls: the real load, forward,
rank-0 comparison, verdict broadcast) inside ONE run_ranks call per world size; the CLI itself through real
torchrun once per family. The reference is transformers in this test process, from the model object that was
saved (its e_score_correction_bias randomised too, so the biased choice is exercised).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import pytest
import torch

from hf_models import DEEPSEEK_V3, build_model, with_mtp_layer
from jobs import torchrun_verify

TOL = 2e-2
# 12 ids across the vocab (250): longer than GPT-OSS's sliding window (8), so the window masks something.
TOKENS = "1,17,42,7,249,0,128,63,200,5,99,31"
INPUT_IDS = [int(t) for t in TOKENS.split(",")]

# checkpoint name -> (hf_models family, overrides)
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64, mscale=0.707,
            mscale_all_dim=1.0, beta_fast=32.0, beta_slow=1.0)
CHECKPOINTS: dict[str, tuple[str, dict]] = {
    "deepseek_v3": ("deepseek_v3", {}),
    "deepseek_v3_no_q_lora": ("deepseek_v3_no_q_lora", {}),
    "deepseek_v2": ("deepseek_v2", {}),
    # yarn with mscale_all_dim (softmax scale and cos/sin scaled), rope not interleaved
    "deepseek_v3_yarn": ("deepseek_v3", dict(rope_parameters=YARN, rope_interleave=False)),
    "gpt_oss": ("gpt_oss", {}),
    "glm4_moe": ("glm4_moe", {}),
    "qwen3_next": ("qwen3_next", {}),
}


@dataclass(frozen=True)
class Case:
    ckpt: str
    ep: int = 1
    placement: str = "linear"
    expert_map: tuple[tuple[int, ...], ...] | None = None

    @property
    def id(self) -> str:
        extra = [f"ep{self.ep}"]
        extra += [self.placement] if self.placement != "linear" else []
        extra += ["hosts" + "_".join("".join(map(str, ids)) for ids in self.expert_map)] if self.expert_map else []
        return "-".join([self.ckpt, *extra])


CASES = {
    2: [Case("deepseek_v3"), Case("deepseek_v3", ep=2), Case("deepseek_v3_no_q_lora"), Case("deepseek_v3_yarn", ep=2),
        Case("deepseek_v3", ep=2, expert_map=((0, 1, 2, 3, 4, 5, 6, 7), (2, 5))), Case("deepseek_v3_mtp", ep=2),
        Case("deepseek_v2"), Case("deepseek_v2", ep=2),
        Case("gpt_oss"), Case("gpt_oss", ep=2), Case("gpt_oss", ep=2, placement="round_robin"),
        Case("glm4_moe"), Case("glm4_moe", ep=2), Case("qwen3_next"), Case("qwen3_next", ep=2)],
    4: [Case("deepseek_v3", ep=2), Case("gpt_oss", ep=2), Case("gpt_oss", ep=4), Case("glm4_moe", ep=2),
        Case("qwen3_next", ep=2)],
}


def build(name: str):
    """The tiny model of a checkpoint name, every param and the router's correction bias random."""
    family, overrides = CHECKPOINTS[name]
    model = build_model(family, **overrides)
    with torch.no_grad():
        for buf_name, buf in model.named_buffers():
            if buf_name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn_like(buf) * 0.05)
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """(name -> checkpoint directory, name -> transformers' fp32 logits of the saved model)."""
    root = tmp_path_factory.mktemp("moe-ckpt")
    paths, logits = {}, {}
    for name in CHECKPOINTS:
        model = build(name)
        model.save_pretrained(root / name, max_shard_size="100KB")
        paths[name] = str(root / name)
        with torch.no_grad():
            logits[name] = model(torch.tensor([INPUT_IDS])).logits[0]
    # The same model with a multi-token-prediction layer appended (as DeepSeek-V3 ships it): not part of the model.
    paths["deepseek_v3_mtp"] = with_mtp_layer(paths["deepseek_v3"], root / "deepseek_v3_mtp")[0]
    logits["deepseek_v3_mtp"] = logits["deepseek_v3"]
    return paths, logits


def _verify_cases(cases: list[Case], paths: dict[str, str]) -> list[dict]:
    """On every rank: verify each case as the CLI does; this rank's verdicts and logits."""
    import torch.distributed as dist

    from distload.errors import DistloadError
    from distload.verify import verify

    torch.set_num_threads(1)  # W processes share the CI cores
    world = dist.get_world_size()
    results = []
    for case in cases:
        try:
            out = verify(paths[case.ckpt], input_ids=INPUT_IDS, tolerance=TOL, tp=world, ep=case.ep,
                         expert_placement=case.placement, expert_map=case.expert_map, progress=False)
        except DistloadError as exc:
            results.append(dict(id=case.id, error=str(exc)))
            continue
        results.append(dict(id=case.id, verdict=out.verdict, logits=out.logits.tolist(), tp=out.tp, ep=out.ep))
    return results


@pytest.fixture(scope="module")
def api_runs(saved):
    from spawn import run_ranks

    cache = {}

    def get(world: int):
        if world not in cache:
            cache[world] = run_ranks(world, _verify_cases, CASES[world], saved[0])
        return cache[world]
    return get


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("world", [2, 4])
def test_verify_matches_transformers(api_runs, saved, world):
    per_rank = api_runs(world)
    for case in CASES[world]:
        rows = [next(r for r in results if r["id"] == case.id) for results in per_rank]
        assert all("verdict" in r for r in rows), f"{case.id}: {rows}"
        assert len({r["verdict"] for r in rows}) == 1, f"{case.id}: ranks disagree"
        verdict, ref = rows[0]["verdict"], saved[1][case.ckpt]
        assert (rows[0]["tp"], rows[0]["ep"]) == (world, case.ep)
        ours = torch.tensor(rows[0]["logits"])
        assert ours.shape == ref.shape == (len(INPUT_IDS), 250)
        for r in rows:  # the gathered logits are the same on every rank
            assert torch.equal(torch.tensor(r["logits"]), ours), case.id
        print(f"{case.id} tp{world}: max rel err {verdict.max_rel:.3e} (vs in-process {rel_err(ours, ref):.3e})")
        # float32 throughout: far inside the tolerance, so a layout slip of any size shows
        assert verdict.compared and verdict.ok and verdict.argmax_same and verdict.max_rel < 1e-4, (case.id, verdict)
        assert rel_err(ours, ref) < 1e-4 and torch.equal(ours.argmax(-1), ref.argmax(-1)), case.id


def _swap_halves(t: torch.Tensor) -> torch.Tensor:
    """[gate; up] -> [up; gate] along each expert's rows."""
    a, b = t.chunk(2, dim=-2)
    return torch.cat([b, a], dim=-2)


def _deinterleave(t: torch.Tensor) -> torch.Tensor:
    """GPT-OSS's interleaved gate/up rows read as if they were [gate; up] halves."""
    return torch.cat([t[..., 0::2, :], t[..., 1::2, :]], dim=-2)


# checkpoint -> (param suffix, a plausible wrong layout of it with the right shape)
WRONG_LAYOUTS = {
    "deepseek_v3": ("mlp.experts.w13_weight", _swap_halves),
    "gpt_oss": ("mlp.experts.w13_weight", _deinterleave),
    "glm4_moe": ("mlp.shared_experts.gate_up_proj.weight", lambda t: _swap_halves(t[None])[0]),
    "qwen3_next": ("linear_attn.in_proj_ba.weight", lambda t: t.flip(0)),
}


@pytest.mark.parametrize("name", sorted(WRONG_LAYOUTS))
def test_the_forward_tells_a_wrong_layout(saved, name):
    """In this process at tp 1 (no process group): the oracle's shards give transformers' logits, and the same
    shards with one param in a wrong layout of the right shape do not, so a verify OK is not vacuous."""
    from distload.models import forward_for
    from hf_models import checkpoint_tensors, read_config
    from layout_oracle import serving_shards

    config = read_config(saved[0][name])
    shards = serving_shards(checkpoint_tensors(saved[0][name]), config, 0, 1)
    run, ref = forward_for(config), saved[1][name]
    assert rel_err(run(shards, config, torch.tensor(INPUT_IDS), tp_rank=0, tp_size=1), ref) < 1e-4
    suffix, wrong = WRONG_LAYOUTS[name]
    broken = {k: (wrong(v) if k.endswith(suffix) else v) for k, v in shards.items()}
    assert sum(k.endswith(suffix) for k in shards) >= 1
    assert rel_err(run(broken, config, torch.tensor(INPUT_IDS), tp_rank=0, tp_size=1), ref) > TOL


def test_every_listed_forward_takes_the_arguments_of_forward_forward():
    import inspect

    from distload.models import FORWARDS, forward, forward_for

    assert set(FORWARDS) >= {"deepseek_v3", "gpt_oss", "glm4_moe", "qwen3_next"}
    # The arguments every forward takes; forward.forward's later ones (pipeline stages, hidden states) are
    # optional, and verify passes them only to a forward that has them.
    common = list(inspect.signature(forward).parameters.values())
    common = common[:[p.name for p in common].index("group") + 1]
    for model_type in FORWARDS:
        run = forward_for({"model_type": model_type})
        assert run is not forward and list(inspect.signature(run).parameters.values()) == common, model_type


def test_quantized_weights_are_refused_by_name(saved):
    """Block-FP8 weights and their scales would be multiplied as plain numbers: the forward names them instead."""
    from distload.errors import DistloadError
    from distload.models import forward_for
    from hf_models import checkpoint_tensors, read_config
    from layout_oracle import serving_shards

    config = read_config(saved[0]["deepseek_v3"])
    shards = serving_shards(checkpoint_tensors(saved[0]["deepseek_v3"]), config, 0, 1)
    name = "model.layers.1.mlp.shared_experts.down_proj.weight"
    shards[name] = shards[name].to(torch.float8_e4m3fn)
    shards[name + "_scale_inv"] = torch.ones(1, 1)
    with pytest.raises(DistloadError, match=r"down_proj\.weight \(and 1 more\): the loaded weights are quantized"):
        forward_for(config)(shards, config, torch.tensor(INPUT_IDS), tp_rank=0, tp_size=1)


# ----------------------------------------------------------------------------------------------------
# The CLI through real torchrun


CLI_CASES = [("deepseek_v3", 2, 2), ("gpt_oss", 2, 2), ("glm4_moe", 2, 1), ("qwen3_next", 2, 2)]


@pytest.mark.parametrize("name,tp,ep", CLI_CASES, ids=[f"{n}-tp{t}-ep{e}" for n, t, e in CLI_CASES])
def test_torchrun_verify(saved, name, tp, ep):
    proc = torchrun_verify(tp, saved[0][name], "--tp", str(tp), "--ep", str(ep), "--input-ids", TOKENS)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    m = re.search(r"max rel err ([0-9.e+-]+) \(.*argmax same: (True|False)", proc.stdout)
    assert m and float(m.group(1)) < TOL and m.group(2) == "True", proc.stdout
    assert f"world {tp} (tp {tp}, ep {ep})" in proc.stdout and "distload verify: OK" in proc.stdout
    print(f"{name} tp{tp} ep{ep} (torchrun): max rel err {m.group(1)}")


def test_deepseek_fixture_has_what_the_issue_asks():
    """q_lora, kv_lora, >= 8 routed experts, a shared expert, a dense first layer, grouped routing."""
    assert DEEPSEEK_V3["q_lora_rank"] and DEEPSEEK_V3["kv_lora_rank"] and DEEPSEEK_V3["n_routed_experts"] >= 8
    assert DEEPSEEK_V3["n_shared_experts"] == 1 and DEEPSEEK_V3["first_k_dense_replace"] == 1
    assert DEEPSEEK_V3["n_group"] > 1 and DEEPSEEK_V3["topk_group"] < DEEPSEEK_V3["n_group"]
