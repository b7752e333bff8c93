"""Expert layouts as a regular dimension (issue 18): ranks that host the same experts at the same rank of their
expert group hold one planned value, so expert groups that host the same experts are replicas like dense ones.

The reference is independent of the plan: tests/layout_oracle.py slices the transformers-saved tensors per rank
(its `local_expert_ids` covers EPLB maps), test_moe.expected_hosts gives the placement from its definitions;
test_families.staged_shards fills each rank from the plan's pieces alone, every element exactly once. Every case
also holds the plan's bookkeeping to the bytes: each source read once, each rank receiving what it keeps.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import distload
from checks import differences, tensor_bytes
from distload.checkpoint import discover
from distload.dtypes import itemsize
from distload.plan import build_plan
from distload.quant import for_load
from distload.plan.experts import expert_placement
from distload.plan.source_shares import SourceShares, share_takers
from distload.rules import rules_for
from distload.topology import Layout
from fp8_checkpoints import quantized_checkpoint
from hf_models import checkpoint_tensors, read_config, save_checkpoint
from plan_checks import staged_shards
from moe_checks import expected_hosts, expected_shards, num_experts, stack_experts


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("expert-groups")
    out = {fam: str(save_checkpoint(fam, root / fam)) for fam in ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3",
                                                                  "gpt_oss")}
    out["qwen3_moe_stacked"] = str(stack_experts(Path(out["qwen3_moe"]), root / "qwen3_moe_stacked"))
    bf16 = save_checkpoint("deepseek_v3", root / "ds-bf16", dtype=torch.bfloat16, max_shard_size="2MB",
                           hidden_size=256, intermediate_size=512, moe_intermediate_size=256, q_lora_rank=256,
                           kv_lora_rank=128, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128)
    out["deepseek_v3_fp8"] = str(quantized_checkpoint(bf16, root / "ds-fp8", "block", block=(128, 128)))
    return out


def halves(n: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return tuple(range(n // 2)), tuple(range(n // 2, n))


def layouts(n: int) -> list[tuple[int, int, str, tuple | None]]:
    """(world, ep, placement, expert map) at tp = world: plain, round robin, expert groups hosting the same
    experts at a regular stride (replicas), a group hosting every expert, one group of two ranks."""
    a, b = halves(n)
    return [(4, 2, "linear", None), (4, 4, "round_robin", None), (4, 4, "linear", (a, b, a, b)),
            (4, 2, "linear", (a + b, a + b, b, b)), (2, 1, "linear", None)]


def received(plan, rank: int) -> int:
    return sum(b.recv_bytes[rank] for b in plan.buckets)


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe", "qwen3_moe", "qwen3_moe_stacked", "deepseek_v3", "gpt_oss"])
def test_expert_groups_hold_what_the_oracle_slices(ckpts, name):
    stored = checkpoint_tensors(ckpts[name])
    original = checkpoint_tensors(ckpts[name.removesuffix("_stacked")])
    config = read_config(ckpts[name])
    n = num_experts(config) if "n_routed_experts" not in config else config["n_routed_experts"]
    for world, ep, placement, emap in layouts(n):
        where = f"{name} world {world} ep {ep} {placement} map {emap}"
        plan = distload.inspect(ckpts[name], tp=world, ep=ep, expert_placement=placement, expert_map=emap)
        hosts = expected_hosts(n, world, ep, placement, emap)
        assert sum(b.read_bytes for b in plan.buckets) == plan.checkpoint_bytes == tensor_bytes(ckpts[name]), where
        for rank in range(world):
            problems = differences(staged_shards(plan, rank, stored),
                                   expected_shards(original, config, rank, world, ep, hosts[rank]), f"{where} rank {rank}")
            assert not problems, "\n".join(problems)
            assert received(plan, rank) == plan.owned_bytes(rank), (where, rank)
            for spec in plan.specs[rank].values():
                if spec.style == "expert":
                    assert list(spec.experts) == hosts[rank], (where, spec.name)


def _plan(path: str, layout: Layout, **options):
    index = discover(path)
    return build_plan(dict(index.tensors), dict(index.config), rules_for(index.config), layout,
                      quantization=for_load(index.config), **options)


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen3_moe_stacked", "gpt_oss", "deepseek_v3_fp8"])
def test_expert_groups_that_host_the_same_experts_plan_like_one(ckpts, name):
    """Two expert groups per host set (an EPLB map at a regular stride) change no rank's shard and no bucket:
    the plan at 4 ranks is the plan at 2 with each group twice, its expert shares taken by groups of 2."""
    config = read_config(ckpts[name])
    n = config.get("n_routed_experts") or num_experts(config)
    a, b = halves(n)
    for world, tp, ep, emap in ((2, 2, 2, (a, b)), (4, 2, 2, (a, a, b, b))):   # 1 and 2 ranks per expert group
        one = _plan(ckpts[name], Layout(world=world, tp=tp, ep=ep, expert_map=emap))
        two = _plan(ckpts[name], Layout(world=2 * world, tp=tp, ep=2 * ep, expert_map=emap * 2))
        where = f"{name} world {world} -> {2 * world}"
        assert all(dict(two.specs[r]) == dict(one.specs[r % world]) for r in range(2 * world)), where
        assert [(x.reader, x.chunks, x.read_bytes) for x in two.buckets] == \
            [(x.reader, x.chunks, x.read_bytes) for x in one.buckets], where
        expert_shares = [s for src in two.sources.values() for s in src.shares
                         if two.specs[s.ranks.first][s.param].style == "expert"]
        assert expert_shares and all(s.ranks.count == 2 and s.ranks.step == world for s in expert_shares), where
        assert all(received(two, r) == two.owned_bytes(r) for r in range(2 * world)), where


def test_placement_is_stored_per_expert_group_and_rank_in_it():
    plain = expert_placement(128, Layout(world=1024, tp=8, ep=128))
    assert plain.period == 1024 and len(plain.hosts) == 128 and plain.of(1023) == (127,) and plain.of(8) == (1,)
    one_group = expert_placement(128, Layout(world=64, tp=8, ep=1))
    assert one_group.period == 64 and one_group.hosts == (tuple(range(128)),)
    a, b = halves(8)
    replicated = expert_placement(8, Layout(world=16, tp=2, ep=8, expert_map=(a, a, b, b) * 4))
    assert replicated.period == 4 and replicated.keys == ((0, 0), (0, 1), (1, 0), (1, 1))
    assert replicated.per_rank() == [a, a, b, b] * 4


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen3_moe_stacked", "gpt_oss", "deepseek_v3_fp8"])
def test_expert_shares_are_made_only_for_the_ranks_that_move_them(ckpts, name):
    """An expert source's shares are made when first asked (expert_layouts.py): planning makes none, a rank
    that walks its buckets makes only those of the sources it receives, and the takers every rank buckets by
    (made from the cut templates, or from the weight's for block scales) are the made shares' own."""
    config = read_config(ckpts[name])
    n = config.get("n_routed_experts") or num_experts(config)
    a, b = halves(n)
    ep = min(n, 8)   # at most 2 ranks per expert group: the block-FP8 experts' rows split into whole blocks
    for world, tp, ep, emap in ((16, 16 // ep, ep, None), (16, 2, 8, (a + b,) * 2 + (b,) * 14)):
        layout = Layout(world=world, tp=tp, ep=ep, expert_map=emap, local_world=4, readers=(0, 4, 8, 12))
        plan = _plan(ckpts[name], layout, staging_bytes=1024)   # real experts fill buckets of their own
        lazy = {s.name: s for s in plan.sources.values() if isinstance(s.shares, SourceShares)}
        where = f"{name} world {world} ep {ep} map {emap}"
        assert lazy and not any(s.shares.made for s in lazy.values()), where
        rank = 13   # hosts one expert of n (ep = n) or n / ep of them, or half of them (the map)
        for bucket in plan.buckets:
            plan.items(bucket, rank)
        takes = {c.source for bk in plan.buckets if not bk.broadcast and any(rank in g for g, _ in bk.groups)
                 for c in bk.chunks}
        made = {n for n, s in lazy.items() if s.shares.made}
        assert made and made <= takes, where
        if emap is None and name in ("qwen3_moe", "deepseek_v3_fp8"):   # a source per expert (not stacked)
            assert len(made) < len(lazy) // 2, where
        for s in lazy.values():
            assert share_takers(tuple(s.shares), itemsize(s.dtype)) == s.takers, (where, s.name)
            assert len(s.shares) == len(s.takers), (where, s.name)
