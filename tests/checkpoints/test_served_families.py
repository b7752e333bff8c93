"""The families of issue 38 in vLLM 0.32's layout (configs/*.toml; tests/support/hf_models.py SERVED_FAMILIES):
every rank's params from the pure plan (delivered, then the plan's post-load steps: transposes, the rules' permutes
and value transforms) equal served_layouts.py's independent slicing, names, shapes, dtypes and values, at tp 1, 2, 4
(kv heads replicated where tp > kv heads) and, for the MoE families, ep 2 at tp 2 and 4. OLMo 2's q/k norms whole
on every rank as vLLM keeps them."""

from __future__ import annotations

import pytest
import torch

from distload.checkpoint import discover
from distload.plan import build_plan
from distload.rules import rules_for
from distload.topology import Layout
from hf_models import SERVED_FAMILIES, checkpoint_tensors, save_checkpoint
from plan_checks import staged_shards
from served_layouts import shards

FAMILY = {"falcon_mqa": "falcon", "falcon_rw": "falcon", "olmo2": "olmo2", "olmo2_mqa": "olmo2"}
MOE = ("llama4", "olmoe", "phimoe", "granitemoe", "granitemoeshared", "ernie4_5_moe", "jamba")
CASES = [(f, tp, 1) for f in sorted(SERVED_FAMILIES) + ["olmo2", "olmo2_mqa"] for tp in (1, 2, 4)]
CASES += [(f, tp, 2) for f in MOE for tp in (2, 4)]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("served")
    out = {fam: save_checkpoint(fam, root / fam) for fam in SERVED_FAMILIES}
    out["olmo2"] = save_checkpoint("olmo2", root / "olmo2")
    out["olmo2_mqa"] = save_checkpoint("olmo2_mqa", root / "olmo2_mqa")
    return out


@pytest.mark.parametrize("family,tp,ep", CASES)
def test_each_rank_holds_what_vllm_lays_out(checkpoints, family, tp, ep):
    index = discover(checkpoints[family])
    entries, config = dict(index.tensors), dict(index.config)
    rules = rules_for(config)
    assert rules.name == FAMILY.get(family, family)
    plan = build_plan(entries, config, rules, Layout(world=tp, tp=tp, ep=ep))
    assert plan.missing == () and plan.unexpected == (), (plan.missing, plan.unexpected)
    values = checkpoint_tensors(checkpoints[family])
    for rank in range(tp):
        got, want = staged_shards(plan, rank, values), shards(values, config, rank, tp, ep)
        assert set(got) == set(want), f"rank {rank}: {sorted(set(got) ^ set(want))}"
        for name, t in want.items():
            assert (got[name].shape, got[name].dtype) == (t.shape, t.dtype), f"rank {rank} {name}"
            assert torch.equal(got[name], t), f"rank {rank} {name} differs from vLLM's layout"


@pytest.mark.parametrize("family,old,new,param", [
    ("llama4", 'permute = "rotary_halves"\n', "", "model.layers.0.self_attn.qkv_proj.weight"),
    ("bloom", 'query_key_value.weight"]\nstyle = "qkv_packed"', 'query_key_value.weight"]\nstyle = "qkv"',
     "transformer.h.0.self_attention.query_key_value.weight"),
])
def test_a_wrong_head_rule_plans_with_the_right_shapes_and_differs_naming_the_param(checkpoints, tmp_path, family,
                                                                                    old, new, param):
    """What only the values show (and `rules check` prints as the row order, and vLLM's comparison names)."""
    from distload.rules import parse_rules, shipped_families
    from distload.rules_check import explain

    text = open(next(f.source for f in shipped_families() if f.name == family)).read()
    assert old in text
    (tmp_path / "wrong.toml").write_text(text.replace(old, new, 1))
    wrong, right = parse_rules(tmp_path / "wrong.toml"), rules_for(dict(discover(checkpoints[family]).config))
    index = discover(checkpoints[family])
    entries, config = dict(index.tensors), dict(index.config)
    shown = [explain(rules, entries, config, tp=2).text for rules in (wrong, right)]
    assert all(text.splitlines()[-1].startswith("OK") for text in shown)
    assert shown[0] != shown[1]   # the row order (or the permutation line) differs on screen
    plan = build_plan(entries, config, wrong, Layout(world=2, tp=2))
    values = checkpoint_tensors(checkpoints[family])
    got, want = staged_shards(plan, 0, values), shards(values, config, 0, 2)
    assert got[param].shape == want[param].shape and not torch.equal(got[param], want[param])
