"""Pipeline placement across nodes and expert groups (pure plans): an EPLB --expert-map per stage under dp x pp,
and a tied embedding read on each stage's node. The checkpoints, the oracle and vLLM's layer ranges are
test_pipeline.py's.
"""

from __future__ import annotations

import pytest

from checks import differences
from distload.errors import DistloadError
from pipeline_cases import cases_for, checkpoints, expected_shards, on_stage  # noqa: F401  (checkpoints: a fixture)


def test_expert_maps_place_each_stage_on_its_own_with_replicas(checkpoints):
    """--expert-map under pp 2 x dp 2 (world 8, tp 2, ep 2): each stage's expert groups (its dp x tp ranks, vLLM's
    EP group) host what the map gives them, and the stages may place their experts differently."""
    import distload
    from hf_models import read_config
    from layout_oracle import serving_shards
    from moe_checks import num_experts
    from plan_checks import arange_values, assert_coverage, assert_each_byte_read_once, materialise_through_buckets

    from distload.checkpoint import discover

    path = checkpoints["qwen3_moe"]
    index = discover(path)
    values, config = arange_values(dict(index.tensors)), read_config(path)
    n = num_experts(config)
    a, b = tuple(range(n // 2)), tuple(range(n // 2, n))
    # rank = (dp * pp + stage) * tp + t: stage 0 is ranks 0,1,4,5 (groups {0,1}, {4,5}); stage 1 is 2,3,6,7
    stage1_swapped = (a, a, b, b, b, b, a, a)
    stage1_one_group_hosts_all = (a, a, a + b, a + b, b, b, b, b)
    ranges = [(0, 3), (3, 5)]
    for emap in (stage1_swapped, stage1_one_group_hosts_all):
        plan = distload.inspect(path, tp=2, pp=2, ep=2, world=8, expert_map=emap)
        assert_each_byte_read_once(plan)
        for rank in range(8):
            stage = (rank // 2) % 2
            # dense params cut by tp 2; experts split over an expert group (2 of the stage's 4 ranks, dp-major)
            in_stage = (rank // 4) * 2 + rank % 2
            want = serving_shards(values, config, rank % 2, 2)
            experts = serving_shards(values, config, in_stage, 4, 2, list(emap[rank]))
            want.update({k: v for k, v in experts.items() if ".experts." in k})
            want = {k: v for k, v in want.items() if on_stage(k, stage, 2, ranges[stage], False)}
            assert set(plan.specs[rank]) == set(want), (emap, rank, set(plan.specs[rank]) ^ set(want))
            assert_coverage(plan, rank)
            assert not differences(materialise_through_buckets(plan, rank, values), want, f"{emap} rank {rank}")
    with pytest.raises(DistloadError) as e:     # stage 1 hosts only half the experts
        distload.inspect(path, tp=2, pp=2, ep=2, world=8, expert_map=(a, a, a, a, b, b, a, a))
    assert "pipeline stage 1" in str(e.value) and str(list(b)) in str(e.value), str(e.value)
    with pytest.raises(DistloadError) as e:     # ranks 2 and 3 form one expert group of stage 1
        distload.inspect(path, tp=2, pp=2, ep=2, world=8, expert_map=(a, a, a, b, b, b, b, a))
    assert "ranks 2 and 3 are in one expert group" in str(e.value), str(e.value)


def test_tied_embedding_is_read_on_each_stage_node(checkpoints):
    """Two nodes, one stage each, tied embeddings (GPT-2 and a tied Llama), and four nodes as dp 2 x pp 2: each
    node's reader reads the embedding rows its own ranks take, so no weight byte crosses between nodes; the
    embedding is the only tensor read more than once (once per node that holds it)."""
    import distload
    from hf_models import read_config
    from plan_checks import staged_shards
    from plan_checks import arange_values, assert_coverage, materialise_through_buckets

    from distload.checkpoint import discover

    for family, embed in (("llama_mqa_tied", "model.embed_tokens.weight"), ("gpt2", "transformer.wte.weight")):
        path = checkpoints[family]
        index = discover(path)
        values, config = arange_values(dict(index.tensors)), read_config(path)
        ranges = cases_for(family)[0][5]
        for world, local_world, holders in ((4, 2, 2), (8, 2, 4)):
            plan = distload.inspect(path, tp=2, pp=2, world=world, local_world=local_world)
            where = f"{family} world {world} ({local_world} per node)"
            assert plan.sources[embed].per_node, where
            assert sum(b.read_bytes for b in plan.buckets) == \
                plan.checkpoint_bytes + (holders - 1) * plan.sources[embed].nbytes, where
            for rank in range(world):
                # one stage per node: nothing crosses; with dp replicas the layers are read once per job and
                # fanned out across nodes, but the embedding still comes from the rank's own node
                assert world > 4 or plan.bytes_from_other_nodes(rank) == 0, (where, rank)
                for b in plan.buckets:
                    for item in plan.items(b, rank):
                        assert item.chunk.source != embed or plan.layout.same_node(b.reader, rank), (where, rank)
                want = expected_shards(values, config, rank % 4, 2, 2, 1, ranges)
                got = (staged_shards(plan, rank, values) if any(plan.post)
                       else materialise_through_buckets(plan, rank, values))
                if not any(plan.post):
                    assert_coverage(plan, rank)
                assert not differences(got, want, f"{where} rank {rank}")
        one_node = distload.inspect(path, tp=2, pp=2, world=4)
        assert not one_node.sources[embed].per_node    # one page cache: read once, as before
