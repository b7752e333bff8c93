"""Planning, pure: (checkpoint index, rules, config.json, layout) -> LoadPlan, with no I/O and no process group.

    types.py          the plan's value types (ParamSpec, Source, Share, Bucket, Item, LoadPlan, ...)
    ranks.py          groups of ranks holding one shard (Ranks), per-rank values stored once per group
    digest.py         the digest of a plan's inputs, which the ranks agree on
    targets.py        rules expanded into targets, matched against the checkpoint
    experts.py        expert placement: which ranks host which experts
    parts.py          a target's logical parts, sizes checked against config.json
    shard.py          the table of cuts: style + parts + (p, r) -> the pieces rank r holds
    layouts.py        per target and rank: its spec and the pieces that fill it
    expert_layouts.py expert params' layouts made per rank when asked; an expert source's shares per source
    source_shares.py  a source's shares made when first asked (expert sources), their takers known before
    spans.py          which rows each reader reads: job-wide rows, and each block's own (rank mode skips others')
    buckets.py        reader spans -> chunks -> buckets, interleaved across readers
    transpose.py      params stored transposed (GPT-2's Conv1D): staged as stored, turned after landing
    bounds.py         loop values config.json claims, bounded by what the checkpoint holds
    expected_shapes.py  every claimed tensor's full shape and dtype, from the rules' shape/dtype keys
    build.py          build_plan: the above in order (the collector paused: gc_freeze.collector_paused)
    wire.py           per bucket and rank: the wire ops each side posts (sender and receiver agree)
    reshard.py        plans that reload (and re-cut) a sharded save
    pipeline.py       pipeline stages: which ranks hold each param (distload/stages.py: the layer split)
"""

from .buckets import DEFAULT_STAGING_BYTES, buckets_for, interleaved
from .build import build_plan
from .experts import expert_hosts
from .shard import LocalLayout, Part, Piece, view2d
from .ranks import Ranks, RankSpecs, RankValues
from .types import (Bucket, Chunk, Delivery, Item, LoadPlan, ParamSpec, Share, Source, Target, broadcast_offset,
                    clip)

__all__ = ["DEFAULT_STAGING_BYTES", "Bucket", "Chunk", "Delivery", "Item", "LoadPlan", "LocalLayout", "ParamSpec",
           "Part", "Piece", "RankSpecs", "RankValues", "Ranks", "Share", "Source", "Target", "broadcast_offset", "buckets_for", "build_plan", "clip",
           "expert_hosts", "interleaved", "view2d"]
