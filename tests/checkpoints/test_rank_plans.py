"""build_plan's rank mode: a rank plans the job-wide buckets and its own node's, nothing of the rows other nodes
alone take and read, and does exactly what it would do with the whole job's plan (no processes).

For every rank of several multi-node layouts (experts on their nodes, tp across nodes, replicas, several
readers per node, pipeline stages, tiny buckets), the rank's plan and the whole plan must give that rank
the same buckets (numbers and contents), the same wire ops and items in every bucket it takes part in, the
same specs and the same job totals; and the layouts where nodes own rows must leave other nodes' sources
out of the rank's plan (else the mode saves nothing).
"""

from __future__ import annotations

import pytest

from distload.plan import build_plan
from distload.quant import for_load
from distload.plan.wire import wire_ops
from distload.rules import rules_for
from distload.topology import Layout
from plan_checks import decoder

LAYOUTS = {
    # (layout, moe, what a rank leaves out: other nodes' sources (and their buckets), their buckets only, nothing)
    "experts-on-their-node": (Layout(world=4, tp=4, ep=4, readers=(0, 2), local_world=2), True, "sources"),
    "experts-four-nodes": (Layout(world=8, tp=8, ep=4, readers=(0, 2, 4, 6), local_world=2), True, "sources"),
    "expert-groups-over-two-nodes": (Layout(world=8, tp=8, ep=2, readers=(0, 2, 4, 6), local_world=2), True, "sources"),
    # DeepSeek-V3 at 4096 in small: tp inside a node, an expert group over a block of two nodes, attention replicated
    "expert-group-blocks": (Layout(world=8, tp=2, ep=2, readers=(0, 2, 4, 6), local_world=2), True, "sources"),
    "tp-across-nodes": (Layout(world=8, tp=8, readers=(0, 4), local_world=4), False, "buckets"),
    "tp-across-nodes-two-readers-each": (Layout(world=4, tp=4, readers=(0, 1, 2, 3), local_world=2), False, "buckets"),
    "replicas-across-nodes": (Layout(world=8, tp=4, readers=(0, 4), local_world=4), False, ""),
    "experts-with-replicas": (Layout(world=8, tp=4, ep=2, readers=(0, 4), local_world=4), True, "sources"),
    "pipeline-stage-per-node": (Layout(world=4, tp=2, pp=2, readers=(0, 2), local_world=2), False, "sources"),
    "pipeline-stages-with-experts": (Layout(world=8, tp=2, pp=2, ep=2, readers=(0, 2, 4, 6), local_world=2), True,
                                     "sources"),
    # EPLB: expert 0 hosted twice (replicas across nodes, job-wide), the others once (on their node)
    "eplb-map": (Layout(world=8, tp=2, ep=4, readers=(0, 2, 4, 6), local_world=2,
                        expert_map=((0, 1),) * 2 + ((0, 2),) * 2 + ((3,),) * 2 + ((1, 2),) * 2), True, "sources"),
    "pipeline-stages-replicated": (Layout(world=8, tp=2, pp=2, readers=(0, 2, 4, 6), local_world=2), False, ""),
}
STAGING = {"default": 16 << 20, "tiny": 64 << 10}


def plan_of(layout_name: str, staging: str, rank: int | None):
    layout, moe, _ = LAYOUTS[layout_name]
    ents, config = decoder(moe=moe)
    return build_plan(ents, config, rules_for(config), layout, staging_bytes=STAGING[staging], rank=rank)


def what_rank_does(plan, rank: int, shm: bool) -> dict:
    """Per bucket the rank takes part in (by number): the bucket, its ops and its items."""
    out = {}
    for b in plan.buckets:
        ops, items = wire_ops(plan, b, rank, shm), plan.items(b, rank)
        if ops or items or b.reader == rank:
            out[b.index] = (b, ops, items)
    return out


@pytest.mark.parametrize("staging", list(STAGING))
@pytest.mark.parametrize("layout_name", list(LAYOUTS))
def test_a_rank_does_with_its_own_plan_what_the_whole_plan_says(layout_name, staging):
    whole = plan_of(layout_name, staging, None)
    layout, _, leaves_out = LAYOUTS[layout_name]
    indices = [b.index for b in whole.buckets]
    assert indices == sorted(set(indices))   # numbered in posting order (the engine and postprocess walk it)
    sources_left_out = buckets_left_out = 0
    for rank in range(layout.world):
        mine = plan_of(layout_name, staging, rank)
        assert mine.planned_for == rank and whole.planned_for is None
        assert [b.index for b in mine.buckets] == sorted({b.index for b in mine.buckets})
        by_index = {b.index: b for b in whole.buckets}
        assert all(by_index[b.index] == b for b in mine.buckets), rank   # every bucket it plans, as the job's
        for shm in (True, False):
            assert what_rank_does(mine, rank, shm) == what_rank_does(whole, rank, shm), (rank, shm)
        assert dict(mine.specs[rank]) == dict(whole.specs[rank])
        assert (mine.post[rank] if mine.post else ()) == (whole.post[rank] if whole.post else ())
        assert (mine.checkpoint_bytes, mine.digest) == (whole.checkpoint_bytes, whole.digest)
        assert set(mine.sources) <= set(whole.sources)
        # What a sharded save lists as the original checkpoint: every source of the job, whatever the rank planned.
        assert {e.name: (e.dtype, tuple(e.shape)) for e in mine.received} == \
            {s.name: (s.dtype, tuple(s.shape)) for s in whole.sources.values()}
        assert all(mine.sources[n] == whole.sources[n] for n in mine.sources)
        # The node's readers plan their own buckets alike (same numbers): what a reader sends its node's ranks.
        node_buckets = {b.index for b in mine.buckets if layout.same_node(b.reader, rank)}
        assert node_buckets == {b.index for b in whole.buckets if layout.same_node(b.reader, rank)}
        sources_left_out += len(whole.sources) - len(mine.sources)
        buckets_left_out += len(whole.buckets) - len(mine.buckets)
    assert (sources_left_out > 0) == (leaves_out == "sources"), sources_left_out
    assert (buckets_left_out > 0) == (leaves_out != ""), buckets_left_out


def test_one_node_plans_the_whole_job_whatever_the_rank():
    ents, config = decoder(moe=True)
    layout = Layout(world=4, tp=4, ep=4)
    whole = build_plan(ents, config, rules_for(config), layout)
    mine = build_plan(ents, config, rules_for(config), layout, rank=3)
    assert mine.buckets == whole.buckets and mine.sources.keys() == whole.sources.keys()
    assert mine.planned_for is None   # nothing left out: the whole plan


@pytest.mark.parametrize("layout", [Layout(world=4, tp=2, ep=2, readers=(0, 2), local_world=2),
                                    Layout(world=8, tp=2, ep=2, readers=(0, 2, 4, 6), local_world=2)],
                         ids=["expert-group-per-node", "expert-group-over-two-nodes"])
def test_block_fp8_experts_and_their_scales(tmp_path, layout):
    """A block-FP8 MoE checkpoint (real files): expert weights and their scales (made per source from the
    weight's layouts, quant/block_grid.py) left out of other blocks' plans alike, and each rank's part as the job's."""
    from distload.checkpoint import discover
    from fp8_checkpoints import quantized_checkpoint
    from hf_models import save_checkpoint

    index = discover(quantized_checkpoint(save_checkpoint("mixtral", tmp_path / "bf16"), tmp_path / "fp8", "block"))
    rules = rules_for(index.config)
    q = for_load(index.config)
    whole = build_plan(index.tensors, index.config, rules, layout, quantization=q)
    for rank in range(layout.world):
        mine = build_plan(index.tensors, index.config, rules, layout, quantization=q, rank=rank)
        assert what_rank_does(mine, rank, False) == what_rank_does(whole, rank, False), rank
        assert dict(mine.specs[rank]) == dict(whole.specs[rank]) and mine.post[rank] == whole.post[rank]
        left_out = set(whole.sources) - set(mine.sources)
        assert any(n.endswith("weight_scale_inv") for n in left_out), sorted(left_out)
        assert {n.rsplit(".", 1)[0] for n in left_out if n.endswith("weight_scale_inv")} == \
            {n.rsplit(".", 1)[0] for n in left_out if n.endswith(".weight")}, sorted(left_out)   # weight and scale alike


def test_a_merged_run_of_other_blocks_sources_counts_as_its_members():
    """A rank's plan sums a run of fixed Elsewheres (one node's rows each) into one; the job-wide rows then go
    where the run's members, counted one by one, would send them."""
    from distload.plan.spans import Elsewhere, merged_run, reader_spans

    whole = plan_of("replicas-across-nodes", "default", None)
    layout, sources = whole.layout, sorted(whole.sources.values(), key=lambda s: (s.file, s.offset))
    on_node_1 = Elsewhere(((frozenset({1}), whole.checkpoint_bytes // 8),), whole.checkpoint_bytes // 8, True)
    over_both = Elsewhere(((frozenset({0}), 1 << 10), (frozenset({1}), 3 << 10)), 4 << 10, True)
    run = [(on_node_1, 3), (over_both, 2)]
    merged = merged_run(run)
    assert merged.nbytes == 3 * on_node_1.nbytes + 2 * over_both.nbytes
    assert dict(merged.segments) == {frozenset({0}): 2 << 10, frozenset({1}): 3 * on_node_1.nbytes + (6 << 10)}
    one_by_one = [on_node_1] * 3 + [over_both] * 2 + sources
    assert reader_spans([merged] + sources, layout) == reader_spans(one_by_one, layout)
    # Counting matters here: node 1's own bytes move the shared rows to node 0.
    assert reader_spans([on_node_1] + sources, layout) != reader_spans(one_by_one, layout)
