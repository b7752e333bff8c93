"""The families shipped for their layout (configs/*.toml; tests/hf_models.py LAYOUT_FAMILIES): every rank's
shards exact against layout_oracle.py's independent slicing, at tp 1, 2, 4 (and kv heads replicated where
tp > kv heads), in the pure plan and in real loads on gloo ranks, every byte read once.
"""

from __future__ import annotations

import pytest

from distload.checkpoint import discover
from distload.plan import build_plan
from distload.rules import rules_for
from distload.topology import Layout
from checks import differences, tensor_bytes
from hf_models import LAYOUT_FAMILIES, save_checkpoint
from spawn import run_ranks
from test_plan import arange_values, assert_matches_oracle

EXPECTED_FAMILY = {"gemma2": "gemma2", "gemma3": "gemma3", "olmo2": "olmo2", "olmo2_mqa": "olmo2",
                   "granite": "granite", "starcoder2": "starcoder2", "cohere": "cohere", "cohere_qk_norm": "cohere"}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {fam: str(save_checkpoint(fam, root / fam)) for fam in LAYOUT_FAMILIES}


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("family", sorted(LAYOUT_FAMILIES))
def test_plan_matches_the_serving_layout(checkpoints, family, tp):
    index = discover(checkpoints[family])
    entries, config = dict(index.tensors), dict(index.config)
    rules = rules_for(config)
    assert rules.name == EXPECTED_FAMILY[family]
    plan = build_plan(entries, config, rules, Layout(world=tp, tp=tp))
    assert plan.missing == () and plan.unexpected == ()
    assert_matches_oracle(plan, arange_values(entries), config)


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
