"""distload.models: the reference TP forward over oracle shards gives transformers' logits.

Every tiny family (and a few RoPE / sliding-window variants) is saved with save_pretrained, sliced per rank
by tests/layout_oracle.py, and run through `forward` at tp 1 (in process), 2 and 4 (real gloo ranks, all
cases of a world size inside one run_ranks call). fp32 agrees with transformers to ~1e-6, so the bound
below is far tighter than the 2e-2 a bf16 run needs, yet far looser than float noise.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

from distload.errors import DistloadError
from distload.models import FAMILIES as FORWARD_FAMILIES
from distload.models import family_of, forward
from hf_models import (DENSE, FAMILIES, MOE, build_model, checkpoint_tensors, read_config,
                             save_checkpoint)
from layout_oracle import padded_vocab, serving_shards
from spawn import run_ranks

T = 24  # longer than the windows and original context lengths below, so scaled RoPE and SWA really act
TOL = 1e-3

# name -> (family, build overrides). Each variant makes a RoPE type, the sliding window or a dense layer of
# an MoE model matter at T tokens.
VARIANTS: dict[str, tuple[str, dict]] = {family: (family, {}) for family in FAMILIES}
VARIANTS |= {
    "llama_rope_linear": ("llama", dict(rope_parameters=dict(rope_type="linear", factor=2.0, rope_theta=10000.0))),
    "llama_rope_dynamic": ("llama", dict(max_position_embeddings=16,
                                         rope_parameters=dict(rope_type="dynamic", factor=2.0, rope_theta=10000.0))),
    "llama_rope_llama3": ("llama", dict(rope_parameters=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=16, rope_theta=500000.0))),
    "qwen3_rope_yarn": ("qwen3", dict(max_position_embeddings=64, rope_parameters=dict(
        rope_type="yarn", factor=4.0, original_max_position_embeddings=16, rope_theta=10000.0))),
    "phi3_longrope_partial": ("phi3", dict(max_position_embeddings=64, original_max_position_embeddings=16,
                                           rope_parameters=dict(rope_type="longrope", rope_theta=10000.0,
                                                                partial_rotary_factor=0.5,
                                                                short_factor=[1.0, 1.1, 1.2, 1.3],
                                                                long_factor=[1.0, 2.0, 3.0, 4.0]))),
    "mistral_swa": ("mistral", dict(sliding_window=8)),
    "qwen2_moe_dense_layer0": ("qwen2_moe", dict(mlp_only_layers=[0])),  # a dense MLP inside an MoE model
}


@dataclass(frozen=True)
class Case:
    variant: str
    ep: int = 1
    expert_ids: tuple[tuple[int, ...], ...] | None = None  # per rank; None: the contiguous placement

    @property
    def id(self) -> str:
        return f"{self.variant} ep{self.ep}" + (f" hosts{list(map(list, self.expert_ids))}" if self.expert_ids else "")


def cases(world: int) -> list[Case]:
    out = [Case(v) for v in VARIANTS]
    out += [Case(f, ep) for f in MOE for ep in (2, 4) if ep <= world and ep > 1]
    # EPLB replicas: an expert hosted by two groups must be counted once (by the first group hosting it).
    if world == 2:
        out += [Case(f, 2, ((0, 1, 2, 3), (1, 3))) for f in MOE]
        out += [Case("mixtral", 2, ((0, 1), (0, 1, 2, 3)))]
    if world == 4:
        out += [Case(f, 2, ((0, 1, 2), (0, 1, 2), (1, 2, 3), (1, 2, 3))) for f in MOE]
    return out


@pytest.fixture(scope="module")
def refs(tmp_path_factory) -> dict[str, tuple[str, torch.Tensor]]:
    """variant -> (checkpoint dir, transformers' fp32 logits [T, V])."""
    out = {}
    for name, (family, overrides) in VARIANTS.items():
        ckpt = save_checkpoint(family, tmp_path_factory.mktemp(name), **overrides)
        with torch.no_grad():
            out[name] = (str(ckpt), build_model(family, **overrides)(INPUT_IDS[None]).logits[0])
    return out


# Ids across the whole vocab, including the last real rows next to the zero padding.
INPUT_IDS = torch.cat([torch.randint(0, 250, (T - 2,), generator=torch.Generator().manual_seed(0)),
                       torch.tensor([249, 0])])


def compare(logits: torch.Tensor, ref: torch.Tensor) -> tuple[float, bool]:
    rel = ((logits - ref).abs().max() / ref.abs().max()).item()
    return rel, bool(torch.equal(logits.argmax(-1), ref.argmax(-1)))


def run_cases(case_list: list[Case], refs: dict, input_ids: torch.Tensor) -> list[tuple[str, float, bool]]:
    """On every rank (also in process for world 1): oracle shards -> forward -> compare with transformers."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if world > 1:
        torch.set_num_threads(1)  # W processes share the CI cores: oversubscribed threads make gloo crawl
    loaded = {}
    results = []
    for case in case_list:
        ckpt, ref = refs[case.variant]
        if ckpt not in loaded:
            loaded[ckpt] = (read_config(ckpt), checkpoint_tensors(ckpt))
        config, hf = loaded[ckpt]
        ids = list(case.expert_ids[rank]) if case.expert_ids else None
        shards = serving_shards(hf, config, rank, world, case.ep, ids)
        logits = forward(shards, config, input_ids, tp_rank=rank, tp_size=world, local_expert_ids=ids, ep_size=case.ep)
        assert logits.dtype == torch.float32 and logits.shape == (T, config["vocab_size"])
        results.append((case.id, *compare(logits, ref)))
    return results


def check(results: list[tuple[str, float, bool]], rank: int = 0) -> None:
    bad = [f"rank {rank} {cid}: rel err {rel:.2e}, argmax same {same}" for cid, rel, same in results
           if not (rel < TOL and same)]
    assert not bad, "\n".join(bad)


def test_tp1_in_process(refs):
    check(run_cases(cases(1), refs, INPUT_IDS))


@pytest.mark.parametrize("world", [2, 4])
def test_tp_on_gloo_ranks(refs, world):
    per_rank = run_ranks(world, run_cases, cases(world), refs, INPUT_IDS)
    assert len(per_rank[0]) == len(cases(world))
    for rank, results in enumerate(per_rank):
        check(results, rank)


def test_every_family_has_a_forward_row(refs):
    for family in DENSE + MOE:
        config = read_config(refs[family][0])
        assert family_of(config) is FORWARD_FAMILIES[FAMILIES[family]["model_type"]]
        # ... found by architectures alone too (a config.json without model_type)
        assert family_of({"architectures": config["architectures"]}) is family_of(config)


def test_legacy_rope_config_spellings(refs):
    """Older config.json files: `rope_scaling` with `type`, `rope_theta` at top level; Phi-3's "su"."""
    for name, legacy_type in (("llama_rope_linear", "linear"), ("phi3_longrope_partial", "su")):
        ckpt, ref = refs[name]
        config = read_config(ckpt)
        rope = dict(config.pop("rope_parameters"))
        config["rope_theta"] = rope.pop("rope_theta")
        rope.pop("rope_type")
        config["rope_scaling"] = {"type": legacy_type, **rope}
        logits = forward(serving_shards(checkpoint_tensors(ckpt), config, 0, 1), config, INPUT_IDS,
                         tp_rank=0, tp_size=1)
        check([(name, *compare(logits, ref))])


def test_bf16_compute(refs):
    ckpt, ref = refs["llama"]
    config = read_config(ckpt)
    logits = forward(serving_shards(checkpoint_tensors(ckpt), config, 0, 1), config, INPUT_IDS,
                     tp_rank=0, tp_size=1, dtype=torch.bfloat16)
    assert logits.dtype == torch.float32
    assert compare(logits, ref)[0] < 2e-2


def test_oracle_layout_by_hand():
    """Pin the oracle to the layout in plain numbers (arange fill: a value tells where it came from)."""
    hidden, n_heads, n_kv, d, vocab = 2, 4, 2, 1, 5
    config = dict(model_type="llama", hidden_size=hidden, num_attention_heads=n_heads, num_key_value_heads=n_kv,
                  head_dim=d, vocab_size=vocab, num_hidden_layers=1, tie_word_embeddings=True)
    a = "model.layers.0."
    hf = {"model.embed_tokens.weight": torch.arange(10.0).view(5, 2), "model.norm.weight": torch.ones(2),
          a + "self_attn.q_proj.weight": torch.arange(8.0).view(4, 2),
          a + "self_attn.k_proj.weight": 100 + torch.arange(4.0).view(2, 2),
          a + "self_attn.v_proj.weight": 200 + torch.arange(4.0).view(2, 2),
          a + "self_attn.o_proj.weight": 300 + torch.arange(8.0).view(2, 4),
          a + "mlp.gate_proj.weight": 400 + torch.arange(8.0).view(4, 2),
          a + "mlp.up_proj.weight": 500 + torch.arange(8.0).view(4, 2),
          a + "mlp.down_proj.weight": 600 + torch.arange(8.0).view(2, 4)}
    # tp 4 > 2 kv heads: rank 3 has q head 3 and kv head 3 // 2 = 1.
    s = serving_shards(hf, config, 3, 4)
    assert s[a + "self_attn.qkv_proj.weight"].tolist() == [[6, 7], [102, 103], [202, 203]]
    assert s[a + "self_attn.o_proj.weight"].tolist() == [[303], [307]]
    assert s[a + "mlp.gate_up_proj.weight"].tolist() == [[406, 407], [506, 507]]
    assert s[a + "mlp.down_proj.weight"].tolist() == [[603], [607]]
    # Vocab 5 pads to 64: 16 rows per rank; rank 0 holds the 5 real rows then zeros, rank 3 only zeros.
    assert padded_vocab(5, 4) == 64 and padded_vocab(250, 3) == 384
    s0 = serving_shards(hf, config, 0, 4)
    assert s0["model.embed_tokens.weight"].shape == (16, 2)
    assert s0["model.embed_tokens.weight"][:5].tolist() == hf["model.embed_tokens.weight"].tolist()
    assert not s0["model.embed_tokens.weight"][5:].any() and not s["model.embed_tokens.weight"].any()
    assert s0["lm_head.weight"] is s0["model.embed_tokens.weight"]
    # tp 2 = kv heads: rank 1 has q heads 2, 3 and kv head 1.
    assert serving_shards(hf, config, 1, 2)[a + "self_attn.qkv_proj.weight"].tolist() == \
        [[4, 5], [6, 7], [102, 103], [202, 203]]


def test_refuses_what_it_does_not_implement(refs):
    ckpt, _ = refs["llama"]
    config, hf = read_config(ckpt), checkpoint_tensors(ckpt)
    with pytest.raises(DistloadError, match="tp=3"):
        forward(serving_shards(hf, config, 0, 1), config, INPUT_IDS, tp_rank=0, tp_size=3)
    with pytest.raises(DistloadError, match="mamba"):
        family_of({"model_type": "mamba", "architectures": ["MambaForCausalLM"]})
    with pytest.raises(DistloadError, match="attention_bias"):
        forward({}, {**config, "attention_bias": True}, INPUT_IDS, tp_rank=0, tp_size=1)
    with pytest.raises(DistloadError, match="rope_type 'mrope'"):
        forward(serving_shards(hf, config, 0, 1), {**config, "rope_parameters": {"rope_type": "mrope"}},
                INPUT_IDS, tp_rank=0, tp_size=1)


def test_tied_lm_head_may_be_left_out(refs):
    ckpt, ref = refs["llama_mqa_tied"]
    config = read_config(ckpt)
    shards = serving_shards(checkpoint_tensors(ckpt), config, 0, 1)
    del shards["lm_head.weight"]
    check([("llama_mqa_tied without lm_head", *compare(forward(shards, config, INPUT_IDS, tp_rank=0, tp_size=1), ref))])
