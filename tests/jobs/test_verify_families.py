"""The reference forward and `distload verify` for the families past Llama's: GPT-2, GPTBigCode, StarCoder2,
Gemma 2 / 3, OLMo2, Cohere, Granite, InternLM2, each against transformers' logits.

What runs where (one run_ranks session per world size runs every case of that world; torchrun costs ~5 s):
- forward over tests/layout_oracle.py's shards (independent of distload's rules) at tp 1 (in process), 2, 4,
  with variants that make sliding windows, soft-caps, multipliers and replicated kv heads act;
- `distload.verify.verify` on real loads at tp 2 and 4, and the must-show: InternLM2's wqkv cut with the plain
  `qkv` style by mistake (shapes match, so no plan can tell) FAILs, naming layer 0 as where hidden states
  diverge. InternLM2's checkpoint is synthetic (transformers runs it only as remote code): the reference is
  the same weights converted here to a Llama checkpoint, passed as `reference=`;
- pipeline stages at world 4 (tp 2 x pp 2, tp 1 x pp 4): each rank slices its stage's params itself, stages
  hand hidden states on point to point, the last stage's logits match transformers';
- one real `torchrun -m distload verify --reference` of the wrong rule, for the CLI's exit code and message.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from distload.models.divergence import first_divergence
from distload.models.family import family_of, standard_config
from hf_models import checkpoint_tensors, read_config, save_checkpoint, save_internlm2_checkpoint
from layout_oracle import serving_shards
from spawn import run_ranks
from jobs import torchrun_verify

T = 12                # longer than the sliding windows below
TOL_FORWARD = 1e-3    # fp32 forward vs transformers is ~1e-6: far tighter than verify's 2e-2
TOL = 2e-2
INPUT_IDS = [1, 17, 42, 7, 249, 0, 128, 63, 200, 5, 99, 150]  # the vocab's last real row next to the padding

# name -> (tests/hf_models family, overrides)
VARIANTS: dict[str, tuple[str, dict]] = {
    "gpt2": ("gpt2", {}),                                   # Conv1D weights, learned positions, gelu_new
    "gpt_bigcode": ("gpt_bigcode", {}),                     # multi-query: one kv head, replicated at tp 2 / 4
    "starcoder2": ("starcoder2", {}),
    "starcoder2_swa": ("starcoder2", dict(sliding_window=4)),
    # layer 0 sliding, layer 1 full; soft-caps small enough that tanh bends the scores and logits
    "gemma2": ("gemma2", dict(sliding_window=4, attn_logit_softcapping=1.0, final_logit_softcapping=2.0)),
    # q/k norms; sliding layers with their own RoPE base (10k local, 1M global)
    "gemma3": ("gemma3", dict(sliding_window=4, layer_types=["sliding_attention", "full_attention"])),
    "olmo2": ("olmo2", {}),
    "olmo2_mqa": ("olmo2_mqa", {}),                         # k_norm over a kv head replicated at tp 2 / 4
    "cohere": ("cohere", {}),
    "cohere_qk_norm": ("cohere_qk_norm", {}),
    "granite": ("granite", dict(embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.1,
                                logits_scaling=4.0)),
    "internlm2": ("internlm2", {}),
    "internlm2_mqa": ("internlm2", dict(num_key_value_heads=1)),
}
PP_VARIANTS: dict[str, tuple[str, dict]] = {"llama_3layers": ("llama", dict(num_hidden_layers=3)),
                                            "llama_4layers_tied": ("llama_mqa_tied", dict(num_hidden_layers=4)),
                                            "phi3": ("phi3", {}), "qwen3_moe": ("qwen3_moe", {})}
# (tp, pp, variants) on 4 ranks: 3 layers split 2 + 1 as vLLM does; tied embeddings on first and last stage
PP_LAYOUTS = ((2, 2, ("llama_3layers", "gemma3", "gpt2")), (1, 4, ("llama_4layers_tied",)))
# `distload verify --pp` end to end on 4 ranks (the loader's stages, then the forward over them): (tp, pp, ep, variants)
PP_VERIFY = ((2, 2, 1, ("llama_3layers", "phi3", "gpt2", "qwen3_moe")), (2, 2, 2, ("qwen3_moe",)),
             (1, 4, 1, ("llama_4layers_tied",)))
WRONG_WQKV = ('name = "internlm2_wrong"\narchitectures = ["X"]\nextends = "internlm2"\n'
              '[params."model.layers.{layer}.attention.wqkv.weight"]\nstyle = "qkv"\n')


def internlm2_as_llama(src: Path, out: Path) -> Path:
    """InternLM2's checkpoint as the Llama checkpoint it is: wqkv unpacked per kv-head group (its q heads, then k,
    then v) into q/k/v_proj, the other names renamed, config.json as Llama's."""
    from safetensors.torch import save_file

    config, tensors = read_config(src), checkpoint_tensors(src)
    heads, n_kv, hidden = config["num_attention_heads"], config["num_key_value_heads"], config["hidden_size"]
    d = hidden // heads
    renames = {"model.tok_embeddings.": "model.embed_tokens.", "output.": "lm_head.",
               "attention.wo.": "self_attn.o_proj.",
               "feed_forward.w1.": "mlp.gate_proj.", "feed_forward.w3.": "mlp.up_proj.",
               "feed_forward.w2.": "mlp.down_proj.", "attention_norm.": "input_layernorm.",
               "ffn_norm.": "post_attention_layernorm."}
    llama = {}
    for name, t in tensors.items():
        if name.endswith("attention.wqkv.weight"):
            groups = t.reshape(n_kv, heads // n_kv + 2, d, hidden)
            q, k, v = (x.reshape(-1, hidden) for x in groups.split([heads // n_kv, 1, 1], dim=1))
            layer = name[: -len("attention.wqkv.weight")]
            llama.update({layer + f"self_attn.{p}_proj.weight": x.contiguous() for p, x in zip("qkv", (q, k, v))})
            continue
        new = next((name.replace(a, b) for a, b in renames.items() if a in name), name)
        llama[new] = t
    out.mkdir(parents=True)
    save_file(llama, str(out / "model.safetensors"))
    keep = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "num_hidden_layers",
            "rms_norm_eps", "vocab_size", "tie_word_embeddings", "rope_theta", "rope_scaling",
            "max_position_embeddings")
    (out / "config.json").write_text(json.dumps({
        **{k: config[k] for k in keep if k in config}, "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_act": config.get("hidden_act", "silu"), "attention_bias": config.get("bias", False)}))
    return out


def reference_logits(path: str) -> torch.Tensor:
    """transformers' fp32 logits of INPUT_IDS, from the checkpoint on disk."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True).eval()
    with torch.no_grad():
        return model(torch.tensor([INPUT_IDS])).logits[0]


@pytest.fixture(scope="module")
def refs(tmp_path_factory) -> dict[str, dict]:
    """variant -> checkpoint dir, reference dir (what transformers runs), transformers' logits."""
    out = {}
    for name, (family, overrides) in {**VARIANTS, **PP_VARIANTS}.items():
        root = tmp_path_factory.mktemp(name)
        if family == "internlm2":
            ckpt = save_internlm2_checkpoint(root / "ckpt", **overrides)
            reference = internlm2_as_llama(ckpt, root / "as-llama")
        else:
            ckpt = reference = save_checkpoint(family, root / "ckpt", **overrides)
        out[name] = dict(ckpt=str(ckpt), reference=str(reference), logits=reference_logits(str(reference)))
    return out


@pytest.fixture(scope="module")
def wrong_rules(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("rules") / "internlm2_wrong.toml"
    path.write_text(WRONG_WQKV)
    return str(path)


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got - ref).abs().max() / ref.abs().max()).item()


def _oracle_forward(refs: dict, names, rank: int, world: int) -> list[tuple[str, float, bool]]:
    from distload.models import forward

    results = []
    for name in names:
        r = refs[name]
        config = read_config(r["ckpt"])
        shards = serving_shards(checkpoint_tensors(r["ckpt"]), config, rank, world)
        logits = forward(shards, config, torch.tensor(INPUT_IDS), tp_rank=rank, tp_size=world)
        same = bool(torch.equal(logits.argmax(-1), r["logits"].argmax(-1)))
        results.append((name, rel_err(logits, r["logits"]), same))
    return results


def stage_params(shards: dict, config: dict, layers: range) -> dict:
    """The params one pipeline stage holds: its layers; the embeddings on the first, norm + lm_head on the last."""
    family = family_of(config)
    names, n = family.names, standard_config(config, family)["num_hidden_layers"]
    first, last = layers.start == 0, layers.stop == n
    out = {}
    for name, t in shards.items():
        layer = next((i for i in range(n) if name.startswith(names.layer.format(i))), None)
        if layer is not None:
            keep = layer in layers
        elif name in (names.embed, names.positions):
            keep = first
        else:
            keep = last
        if keep:
            out[name] = t
    return out


def _pipeline(refs: dict, rank: int) -> list[tuple[str, int, int, float | None, bool | None]]:
    """tp 2 x pp 2 and tp 1 x pp 4 on 4 ranks, vLLM's rank order (rank = pp_rank * tp + tp_rank): per case
    (variant, tp, pp, rel err, argmax same), the last two None on ranks of the stages before the last."""
    from distload.models import forward
    from distload.stages import pp_layer_range
    from distload.transfer.stage_links import new_groups

    results = []
    for tp, pp, names in PP_LAYOUTS:
        pp_rank, tp_rank = rank // tp, rank % tp
        group = new_groups([list(range(s * tp, (s + 1) * tp)) for s in range(pp)])[pp_rank]
        for name in names:
            r = refs[name]
            config = read_config(r["ckpt"])
            layers = pp_layer_range(standard_config(config, family_of(config))["num_hidden_layers"], pp_rank, pp)
            shards = stage_params(serving_shards(checkpoint_tensors(r["ckpt"]), config, tp_rank, tp), config, layers)
            logits = forward(shards, config, torch.tensor(INPUT_IDS), tp_rank=tp_rank, tp_size=tp, group=group,
                             layers=layers, prev_rank=rank - tp if pp_rank > 0 else None,
                             next_rank=rank + tp if pp_rank < pp - 1 else None)
            if logits is None:
                results.append((name, tp, pp, None, None))
            else:
                same = bool(torch.equal(logits.argmax(-1), r["logits"].argmax(-1)))
                results.append((name, tp, pp, rel_err(logits, r["logits"]), same))
    return results


def _stages_for_verify(refs: dict, rank: int) -> tuple[float, bool, list[int]]:
    """models.pipeline.forward_over_stages (what verify --pp runs) at tp 2 x pp 2: logits on every rank, the
    hidden states of both stages."""
    from distload.models import forward
    from distload.models.pipeline import forward_over_stages
    from distload.stages import pp_layer_range

    r = refs["llama_3layers"]
    config = read_config(r["ckpt"])
    layers = pp_layer_range(config["num_hidden_layers"], rank // 2, 2)
    shards = stage_params(serving_shards(checkpoint_tensors(r["ckpt"]), config, rank % 2, 2), config, layers)
    logits, hidden = forward_over_stages(forward, shards, config, torch.tensor(INPUT_IDS), rank=rank, tp=2, pp=2,
                                         layers=layers)
    return rel_err(logits, r["logits"]), bool(torch.equal(logits.argmax(-1), r["logits"].argmax(-1))), sorted(hidden)


def _session(refs: dict, wrong_rules: str) -> dict:
    """On every rank of one world: oracle forwards, real verifies, the wrong rule, and (world 4) stages."""
    import torch.distributed as dist

    from distload.verify import verify

    torch.set_num_threads(1)  # W processes share the CI cores
    rank, world = dist.get_rank(), dist.get_world_size()
    out = dict(forward=_oracle_forward(refs, VARIANTS, rank, world), verify={})
    for name in VARIANTS:
        v = verify(refs[name]["ckpt"], input_ids=INPUT_IDS, tolerance=TOL, reference=refs[name]["reference"],
                   tp=world, progress=False)
        out["verify"][name] = v.verdict
    out["wrong"] = verify(refs["internlm2"]["ckpt"], input_ids=INPUT_IDS, tolerance=TOL, config=wrong_rules,
                          reference=refs["internlm2"]["reference"], tp=world, progress=False).verdict
    if world == 4:
        out["pipeline"] = _pipeline(refs, rank)
        out["stages_for_verify"] = _stages_for_verify(refs, rank)
        out["verify_pp"] = [(name, tp, pp, ep, verify(refs[name]["ckpt"], input_ids=INPUT_IDS, tolerance=TOL, tp=tp,
                                                      pp=pp, ep=ep, progress=False).verdict)
                            for tp, pp, ep, names in PP_VERIFY for name in names]
    return out


@pytest.fixture(scope="module")
def sessions(refs, wrong_rules):
    cache = {}

    def get(world: int) -> list[dict]:
        if world not in cache:
            cache[world] = run_ranks(world, _session, refs, wrong_rules)
        return cache[world]
    return get


def test_forward_tp1_in_process(refs):
    bad = [f"{n}: rel err {rel:.2e}, argmax same {same}" for n, rel, same in _oracle_forward(refs, VARIANTS, 0, 1)
           if not (rel < TOL_FORWARD and same)]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("world", [2, 4])
def test_forward_over_oracle_shards(sessions, world):
    bad = [f"rank {r} {n}: rel err {rel:.2e}, argmax same {same}" for r, s in enumerate(sessions(world))
           for n, rel, same in s["forward"] if not (rel < TOL_FORWARD and same)]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_verify_real_loads_match_transformers(sessions, world):
    per_rank = sessions(world)
    for name in VARIANTS:
        verdicts = {s["verify"][name] for s in per_rank}
        assert len(verdicts) == 1, f"{name}: ranks disagree: {verdicts}"
        verdict = verdicts.pop()
        assert verdict.compared and verdict.ok and verdict.max_rel < TOL and verdict.argmax_same, (name, verdict)
        print(f"verify {name} tp {world}: max rel err {verdict.max_rel:.2e}")  # shown with pytest -s


@pytest.mark.parametrize("world", [1, 2, 4])
def test_wrong_wqkv_rule_fails_naming_the_first_diverging_layer(sessions, world):
    verdicts = {s["wrong"] for s in sessions(world)}
    assert len(verdicts) == 1
    verdict = verdicts.pop()
    assert verdict.compared and not verdict.ok and verdict.exit_code == 1, verdict
    assert verdict.diverging_layer == 0, verdict
    assert "hidden states first diverge at layer 0" in verdict.message, verdict.message
    assert "while its input agrees" in verdict.message, verdict.message


def test_pipeline_stages_match_transformers(sessions):
    """tp 2 x pp 2 and tp 1 x pp 4: only the last stage's ranks return logits, and they are transformers'."""
    per_rank = sessions(4)
    for rank, s in enumerate(per_rank):
        assert len(s["pipeline"]) == sum(len(names) for _, _, names in PP_LAYOUTS)
        for name, tp, pp, rel, same in s["pipeline"]:
            if rank // tp < pp - 1:  # an earlier stage hands on its hidden states and returns no logits
                assert rel is None, (rank, name, tp, pp)
            else:
                assert rel < TOL_FORWARD and same, (rank, name, tp, pp, rel, same)


def test_verify_pp_loads_stages_and_matches_transformers(sessions):
    """`verify --tp T --pp P`: each rank loads only its stage (the loader's plan), the forward runs stage after
    stage, and every rank gets the same verdict: transformers' logits."""
    for rank, s in enumerate(sessions(4)):
        assert len(s["verify_pp"]) == sum(len(names) for *_, names in PP_VERIFY)
        for name, tp, pp, ep, verdict in s["verify_pp"]:
            assert verdict.ok and verdict.max_rel < TOL, (rank, name, tp, pp, ep, verdict.message)


def test_first_divergence_names_the_layer():
    ref = [torch.ones(2, 3) * (k + 1) for k in range(4)]  # 3 layers
    ok = {k: t.clone() for k, t in enumerate(ref)}
    assert first_divergence(ok, ref, TOL)[0] is None and "through the final norm" in first_divergence(ok, ref, TOL)[1]
    assert first_divergence({**ok, 0: ref[0] * 2}, ref, TOL)[0] is None
    assert "embeddings already differ" in first_divergence({**ok, 0: ref[0] * 2}, ref, TOL)[1]
    layer, text = first_divergence({**ok, 2: ref[2] * 2, 3: ref[3] * 2}, ref, TOL)
    assert layer == 1 and "first diverge at layer 1 (its output" in text and "while its input agrees" in text
    layer, text = first_divergence({**ok, 3: torch.full((2, 3), float("nan"))}, ref, TOL)
    assert layer == 2 and "final-normed output" in text


def test_internlm2_without_reference_says_to_pass_one(refs):
    from distload.errors import DistloadError
    from distload.verify import reference_outputs

    with pytest.raises(DistloadError, match="--reference"):
        reference_outputs(refs["internlm2"]["ckpt"], INPUT_IDS)


def test_torchrun_verify_wrong_rule_names_the_layer(refs, wrong_rules):
    proc = torchrun_verify(2, refs["internlm2"]["ckpt"], "--tp", "2", "--input-ids", ",".join(map(str, INPUT_IDS)),
                           "--config", wrong_rules, "--reference", refs["internlm2"]["reference"])
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "distload verify: FAIL" in proc.stdout and "hidden states first diverge at layer 0" in proc.stdout, \
        proc.stdout + proc.stderr
    assert f"against {refs['internlm2']['reference']}" in proc.stdout


def test_gemma3_legacy_rope_spelling(refs):
    """Older Gemma 3 config.json files: a top-level rope_theta for the full layers and rope_local_base_freq for the
    sliding ones (1M and 10k here: the wrong base for either layer type changes the logits)."""
    from distload.models import forward

    r = refs["gemma3"]
    config = read_config(r["ckpt"])
    nested = config.pop("rope_parameters")
    config["rope_theta"] = nested["full_attention"]["rope_theta"]
    config["rope_local_base_freq"] = nested["sliding_attention"]["rope_theta"]
    assert config["rope_theta"] != config["rope_local_base_freq"]
    logits = forward(serving_shards(checkpoint_tensors(r["ckpt"]), config, 0, 1), config, torch.tensor(INPUT_IDS),
                     tp_rank=0, tp_size=1)
    assert rel_err(logits, r["logits"]) < TOL_FORWARD


def test_refuses_what_the_new_families_do_not_implement(refs):
    from distload.errors import DistloadError
    from distload.models import forward

    gpt2 = read_config(refs["gpt2"]["ckpt"])
    for key, value in (("scale_attn_by_inverse_layer_idx", True), ("scale_attn_weights", False)):
        with pytest.raises(DistloadError, match=key):
            forward({}, {**gpt2, key: value}, torch.tensor(INPUT_IDS), tp_rank=0, tp_size=1)
    with pytest.raises(DistloadError, match="multi_query=false"):
        standard_config({**read_config(refs["gpt_bigcode"]["ckpt"]), "multi_query": False},
                        family_of({"model_type": "gpt_bigcode"}))
    with pytest.raises(DistloadError, match="hidden_activation='relu2'"):
        gemma = read_config(refs["gemma2"]["ckpt"])
        forward(serving_shards(checkpoint_tensors(refs["gemma2"]["ckpt"]), gemma, 0, 1),
                {**gemma, "hidden_activation": "relu2"}, torch.tensor(INPUT_IDS), tp_rank=0, tp_size=1)


def test_internlm2_reference_is_the_llama_it_was_packed_from(refs):
    """The converted reference computes what the Llama that save_internlm2_checkpoint packed computes: the
    unpacking in internlm2_as_llama is right, independently of distload's qkv_packed rule."""
    from hf_models import build_model

    for name in ("internlm2", "internlm2_mqa"):
        with torch.no_grad():
            packed_from = build_model("llama", **VARIANTS[name][1])(torch.tensor([INPUT_IDS])).logits[0]
        assert rel_err(refs[name]["logits"], packed_from) < 1e-6, name


def test_forward_over_stages_shares_logits_and_hidden_states(sessions):
    """What verify --pp runs: every rank gets the last stage's logits and both stages' hidden states (3 layers:
    embeddings, layers 0 and 1 on stage 0, the final-normed output on stage 1)."""
    for rank, s in enumerate(sessions(4)):
        rel, same, keys = s["stages_for_verify"]
        assert rel < TOL_FORWARD and same and keys == [0, 1, 2, 3], (rank, rel, same, keys)
