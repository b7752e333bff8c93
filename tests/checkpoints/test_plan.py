"""distload.plan: the pure load plan (DESIGN §2 step 4, §4.2, §4.5).

The checkpoints are metadata only (TensorEntry: name, file, offset, dtype, shape): the tensors, files and
config.json that tests/hf_models.py's tiny Hugging Face models save, from tests/hf_metadata.py, without
transformers or a disk (test_metadata_checkpoints_are_what_transformers_saves holds the two together). The plan only
reads metadata, so values are made up here: every checkpoint tensor is filled with
`arange + offset` (offsets running over the whole checkpoint, so every element is unique). Each rank's
params are then built twice, once straight from the deliveries and once through the buckets' wire
items (a byte-level simulation of what transfer/ does), and compared with layout_oracle.py, an
independent slicing of the same tensors into the serving layout.
"""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
import torch

from distload.checkpoint import TensorEntry, discover
from distload.dtypes import itemsize
from distload.errors import PlanError
from distload.plan import build_plan, expert_hosts
from distload.rules import rules_for
from distload.topology import Layout
from hf_metadata import decoder_config, decoder_shapes, one_file_entries, sharded_entries
from hf_models import DENSE
from checks import TOY_MOE_RULES, toy_rules
from plan_checks import (arange_values, assert_coverage, assert_each_byte_read_once, assert_matches_oracle,
                         chunks_by_source, materialise_from_deliveries, materialise_through_buckets)

# ----------------------------------------------------------------------------------------------------
# Fixtures and helpers


@pytest.fixture(scope="module")
def ckpt():
    """ckpt(family) -> (entries, config, rules, total_bytes) of hf_models' `family` checkpoint, as metadata."""
    cache = {}

    def get(family):
        if family not in cache:
            config = decoder_config(family)
            entries = sharded_entries(decoder_shapes(config))
            cache[family] = (entries, config, rules_for(config), sum(e.nbytes for e in entries.values()))
        return cache[family]
    return get


def assert_items_consistent(plan) -> None:
    # Numbered in posting order: densely below block_own_from, then each reader's block-own ones (buckets.py).
    indices = [x.index for x in plan.buckets]
    assert indices == sorted(set(indices)) and indices[:plan.block_own_from] == list(range(plan.block_own_from))
    for b in plan.buckets:
        for rank in range(plan.layout.world):
            items = plan.items(b, rank)
            if b.broadcast:
                assert b.recv_bytes[rank] == b.read_bytes
                starts, at = {}, 0
                for c in b.chunks:
                    starts[c] = at
                    at += (c.rows[1] - c.rows[0]) * plan.sources[c.source].row_bytes
                for it in items:
                    assert it.offset == starts[it.chunk]
                    assert it.nbytes == (it.chunk.rows[1] - it.chunk.rows[0]) * plan.sources[it.chunk.source].row_bytes
                continue
            at = 0
            for it in items:
                assert it.offset == at, f"bucket {b.index} rank {rank}: offsets not contiguous"
                assert it.nbytes == it.piece.numel * itemsize(plan.sources[it.chunk.source].dtype)
                at += it.nbytes
            assert at == b.recv_bytes[rank]


# ----------------------------------------------------------------------------------------------------
# Dense families at tp 1, 2, 4


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("family", DENSE)
def test_dense_plan_matches_the_serving_layout(ckpt, family, tp):
    entries, config, rules, total = ckpt(family)
    plan = build_plan(entries, config, rules, Layout(world=tp, tp=tp))
    assert plan.family == rules.name
    assert plan.missing == () and plan.unexpected == ()
    values = arange_values(entries)
    assert_matches_oracle(plan, values, config)
    # Global shapes: the checkpoint's, or the concatenation of the parts.
    for rank in range(tp):
        for name, spec in plan.specs[rank].items():
            if name in entries:
                assert spec.global_shape == entries[name].shape
            assert spec.dtype == "F32"
    assert plan.checkpoint_bytes == total
    assert_each_byte_read_once(plan)
    assert_items_consistent(plan)


@pytest.mark.parametrize("family", ["llama", "phi3"])
def test_data_parallel_replicas(ckpt, family):
    """world 4, tp 2: ranks r and r + 2 hold the same shards."""
    entries, config, rules, total = ckpt(family)
    plan = build_plan(entries, config, rules, Layout(world=4, tp=2, readers=(0, 3)))
    values = arange_values(entries)
    assert_matches_oracle(plan, values, config)
    assert plan.specs[0] == plan.specs[2] and plan.specs[1] == plan.specs[3]
    assert sum(b.read_bytes for b in plan.buckets) == total
    assert_each_byte_read_once(plan)
    assert_items_consistent(plan)


def test_local_shapes_llama_tp4(ckpt):
    entries, config, rules, _ = ckpt("llama")
    specs = build_plan(entries, config, rules, Layout(world=4, tp=4)).specs[3]
    # hidden 64, intermediate 128, heads 4 x head_dim 16, kv heads 2 (-> 1 per rank, replicated), vocab 250 -> 256.
    assert specs["model.embed_tokens.weight"].local_shape == (64, 64)
    assert specs["model.embed_tokens.weight"].global_shape == (250, 64)
    assert specs["model.embed_tokens.weight"].padding == ((58, 64, 0, 64),)
    assert specs["lm_head.weight"].local_shape == (64, 64)
    assert specs["model.layers.1.self_attn.qkv_proj.weight"].local_shape == (16 + 16 + 16, 64)
    assert specs["model.layers.1.self_attn.qkv_proj.weight"].global_shape == (64 + 32 + 32, 64)
    assert specs["model.layers.1.self_attn.o_proj.weight"].local_shape == (64, 16)
    assert specs["model.layers.1.mlp.gate_up_proj.weight"].local_shape == (64, 64)
    assert specs["model.layers.1.mlp.gate_up_proj.weight"].global_shape == (256, 64)
    assert specs["model.layers.1.mlp.down_proj.weight"].local_shape == (64, 32)
    assert specs["model.norm.weight"].local_shape == (64,)


def test_replicated_sources_are_broadcast(ckpt):
    entries, config, rules, _ = ckpt("qwen2")
    plan = build_plan(entries, config, rules, Layout(world=2, tp=2))
    assert plan.sources["model.norm.weight"].broadcast
    assert plan.sources["model.layers.0.input_layernorm.weight"].broadcast
    assert not plan.sources["model.layers.0.mlp.down_proj.weight"].broadcast
    assert not plan.sources["model.layers.0.self_attn.q_proj.bias"].broadcast


# ----------------------------------------------------------------------------------------------------
# Tied embeddings


def test_tied_lm_head_is_an_alias(ckpt):
    entries, config, rules, total = ckpt("llama_mqa_tied")
    assert config["tie_word_embeddings"] and "lm_head.weight" not in entries
    plan = build_plan(entries, config, rules, Layout(world=4, tp=4))
    for rank in range(4):
        lm, emb = plan.specs[rank]["lm_head.weight"], plan.specs[rank]["model.embed_tokens.weight"]
        assert lm.alias_of == "model.embed_tokens.weight" and emb.alias_of is None
        assert (lm.local_shape, lm.global_shape, lm.padding) == (emb.local_shape, emb.global_shape, emb.padding)
        got = materialise_from_deliveries(plan, rank, arange_values(entries))
        assert got["lm_head.weight"] is got["model.embed_tokens.weight"]
    assert "lm_head.weight" not in plan.sources
    assert all(d.param != "lm_head.weight" for s in plan.sources.values() for d in s.deliveries)
    assert sum(b.read_bytes for b in plan.buckets) == total


def test_tied_stray_lm_head_is_ignored_not_read(ckpt):
    entries, config, rules, total = ckpt("llama_mqa_tied")
    emb = entries["model.embed_tokens.weight"]
    stray = TensorEntry("lm_head.weight", "extra.safetensors", emb.dtype, emb.shape, 8, emb.nbytes)
    plan = build_plan({**entries, "lm_head.weight": stray}, config, rules, Layout(world=2, tp=2))
    assert "lm_head.weight" in plan.ignored and plan.unexpected == ()
    assert "lm_head.weight" not in plan.sources
    assert sum(b.read_bytes for b in plan.buckets) == total
    assert plan.specs[0]["lm_head.weight"].alias_of == "model.embed_tokens.weight"


def test_untied_lm_head_is_its_own_param(ckpt):
    entries, config, rules, _ = ckpt("llama")
    plan = build_plan(entries, config, rules, Layout(world=2, tp=2))
    assert plan.specs[0]["lm_head.weight"].alias_of is None
    assert "lm_head.weight" in plan.sources


# ----------------------------------------------------------------------------------------------------
# Refusals: divisibility, names, config.json


@pytest.mark.parametrize("family", DENSE)
def test_tp3_refused_with_valid_sizes(ckpt, family):
    entries, config, rules, _ = ckpt(family)
    with pytest.raises(PlanError, match=r"tp=3.*\(try tp 1, 2, 4\)") as exc:
        build_plan(entries, config, rules, Layout(world=3, tp=3))
    assert "qkv_proj" in str(exc.value)


def test_missing_tensors_named_by_template(ckpt):
    entries, config, rules, _ = ckpt("llama")
    broken = {n: e for n, e in entries.items() if not n.endswith("mlp.up_proj.weight")}
    with pytest.raises(PlanError) as exc:
        build_plan(broken, config, rules, Layout(world=2, tp=2))
    msg = str(exc.value)
    assert "missing 2 tensor(s): 'model.layers.{0..1}.mlp.up_proj.weight'" in msg
    assert "unexpected" not in msg
    assert "llama" in msg and "--no-strict" in msg


def test_unexpected_tensors_named_by_template(ckpt):
    entries, config, rules, _ = ckpt("llama")
    base = entries["model.norm.weight"]
    extra = {f"model.layers.{i}.mlp.extra.weight": replace(base, name=f"model.layers.{i}.mlp.extra.weight",
                                                            file="extra.safetensors", offset=8 + i * base.nbytes)
             for i in range(2)}
    extra["vision_tower.proj"] = replace(base, name="vision_tower.proj", file="extra.safetensors", offset=8 + 2 * base.nbytes)
    with pytest.raises(PlanError) as exc:
        build_plan({**entries, **extra}, config, rules, Layout(world=2, tp=2))
    msg = str(exc.value)
    assert "unexpected 3 tensor(s): 'model.layers.{0..1}.mlp.extra.weight', 'vision_tower.proj'" in msg
    assert "missing" not in msg


def test_not_strict_lists_missing_and_unexpected(ckpt):
    entries, config, rules, total = ckpt("llama")
    gone = {"model.layers.0.mlp.up_proj.weight", "model.layers.1.mlp.up_proj.weight"}
    broken = {n: e for n, e in entries.items() if n not in gone}
    base = entries["model.norm.weight"]
    broken["model.layers.0.mlp.extra.weight"] = replace(base, name="model.layers.0.mlp.extra.weight",
                                                        file="extra.safetensors", offset=8)
    plan = build_plan(broken, config, rules, Layout(world=2, tp=2), strict=False)
    assert plan.missing == tuple(sorted(gone))
    assert plan.unexpected == ("model.layers.0.mlp.extra.weight",)
    for rank in range(2):
        assert not any(n.endswith("gate_up_proj.weight") for n in plan.specs[rank])
        assert "model.layers.0.mlp.down_proj.weight" in plan.specs[rank]
    # The orphaned gate_proj and the unexpected tensor are not read; everything else is, once.
    assert "model.layers.0.mlp.gate_proj.weight" not in plan.sources
    assert "model.layers.0.mlp.extra.weight" not in plan.sources
    unread = sum(entries[n].nbytes for n in entries if n.endswith(("mlp.up_proj.weight", "mlp.gate_proj.weight")))
    assert sum(b.read_bytes for b in plan.buckets) == total - unread
    assert_each_byte_read_once(plan)


@pytest.mark.parametrize("family,key,value,needle", [
    ("llama", "num_key_value_heads", 1, "k_proj.weight has 32 rows but config.json"),
    ("qwen2", "num_key_value_heads", 4, "k_proj.weight has 32 rows but config.json"),
    ("phi3", "num_key_value_heads", 1, "qkv_proj.weight has 128 rows but config.json"),
    ("llama", "vocab_size", 256, "config.json vocab_size=256"),
    ("phi3", "intermediate_size", 96, "config.json and the checkpoint disagree"),
])
def test_config_contradicting_tensors(ckpt, family, key, value, needle):
    entries, config, rules, _ = ckpt(family)
    with pytest.raises(PlanError, match=re.escape(needle)) as exc:
        build_plan(entries, {**config, key: value}, rules, Layout(world=2, tp=2))
    assert "config.json" in str(exc.value)


def test_mixed_dtype_parts_refused(ckpt):
    entries, config, rules, _ = ckpt("llama")
    k = entries["model.layers.0.self_attn.k_proj.weight"]
    bad = {**entries, k.name: replace(k, dtype="BF16", nbytes=k.nbytes // 2)}
    with pytest.raises(PlanError, match="different dtypes"):
        build_plan(bad, config, rules, Layout(world=1, tp=1))


# ----------------------------------------------------------------------------------------------------
# Buckets and readers


def test_small_staging_chunks_big_tensors(ckpt):
    entries, config, rules, total = ckpt("llama")
    staging = 1000
    plan = build_plan(entries, config, rules, Layout(world=2, tp=2), staging_bytes=staging)
    assert max(s.row_bytes for s in plan.sources.values()) <= staging
    for b in plan.buckets:
        assert b.read_bytes <= staging
        if not b.broadcast and len(b.chunks) > 1:
            assert sum(b.recv_bytes) - b.recv_bytes[b.reader] <= staging
    emb = plan.sources["model.embed_tokens.weight"]
    rows = [c.rows for _, c in chunks_by_source(plan)["model.embed_tokens.weight"]]
    per = staging // emb.row_bytes
    assert rows == [(a, min(a + per, 250)) for a in range(0, 250, per)]
    assert sum(b.read_bytes for b in plan.buckets) == total
    assert_each_byte_read_once(plan)
    assert_items_consistent(plan)
    assert_matches_oracle(plan, arange_values(entries), config)


def test_small_staging_bounds_sends_with_replicated_kv(ckpt):
    entries, config, rules, _ = ckpt("llama")
    staging = 1000
    plan = build_plan(entries, config, rules, Layout(world=4, tp=4), staging_bytes=staging)
    for b in plan.buckets:
        assert b.read_bytes <= staging
        if not b.broadcast:
            assert sum(b.recv_bytes) - b.recv_bytes[b.reader] <= staging, b


def test_default_staging_flushes_only_when_the_kind_changes(ckpt):
    """Nothing comes near the default staging size: one reader's buckets alternate broadcast / point-to-point runs."""
    entries, config, rules, total = ckpt("qwen3")
    plan = build_plan(entries, config, rules, Layout(world=2, tp=2))
    assert all(b.broadcast != n.broadcast for b, n in zip(plan.buckets, plan.buckets[1:]))
    assert sum(b.read_bytes for b in plan.buckets) == total


@pytest.mark.parametrize("readers", [(0, 2), (0, 1, 2, 3), (3, 1)])
def test_multiple_readers(ckpt, readers):
    entries, config, rules, total = ckpt("qwen3")
    plan = build_plan(entries, config, rules, Layout(world=4, tp=4, readers=readers), staging_bytes=4096)
    per_reader = {r: 0 for r in readers}
    for b in plan.buckets:
        assert b.reader in readers
        per_reader[b.reader] += b.read_bytes
    assert sum(per_reader.values()) == total
    biggest = max(s.nbytes for s in plan.sources.values())
    for r, n in per_reader.items():
        assert abs(n - total / len(readers)) <= biggest, (per_reader, total, biggest)
    # Each reader's chunks, in bucket order, are in file order (sequential reads).
    for r in readers:
        keys = [(plan.sources[c.source].file, plan.sources[c.source].offset, c.rows)
                for b in plan.buckets if b.reader == r for c in b.chunks]
        assert keys == sorted(keys)
    # Readers' buckets are interleaved: the first len(readers) buckets come from distinct readers.
    assert len({b.reader for b in plan.buckets[:len(readers)]}) == len(readers)
    assert_each_byte_read_once(plan)
    assert_items_consistent(plan)
    assert_matches_oracle(plan, arange_values(entries), config)


@pytest.mark.parametrize("family", DENSE)
@pytest.mark.parametrize("readers", [(0, 2), (0, 1, 2, 3), (0, 1, 2), (0,)])
def test_two_nodes_keep_their_rows_on_their_node(ckpt, family, readers):
    """Two nodes of two ranks: column-parallel and vocab rows are read on the node whose ranks keep them,
    only row-parallel and replicated tensors cross; each byte is still read once, and every rank ends with
    exactly the oracle's shard."""
    from checks import assert_rows_stay_on_their_node, cross_node_bytes

    entries, config, rules, total = ckpt(family)
    layout = Layout(world=4, tp=4, readers=readers, local_world=2)
    plan = build_plan(entries, config, rules, layout, staging_bytes=4096)
    assert_each_byte_read_once(plan)
    assert_items_consistent(plan)
    assert_matches_oracle(plan, arange_values(entries), config)
    assert_rows_stay_on_their_node(plan)
    if readers == (0,):  # node 1 reads nothing: it receives all it keeps
        kept = [sum(s.nbytes for s in plan.specs[r].values() if not s.alias_of) for r in range(4)]
        assert cross_node_bytes(plan)[2:] >= [0.9 * k for k in kept[2:]]
    elif len(readers) % 2 == 0:  # node 1 reads its own column-parallel rows: it receives well under what it keeps
        assert sum(cross_node_bytes(plan)[2:]) < 0.25 * sum(s.nbytes for r in (2, 3) for s in plan.specs[r].values()
                                                              if not s.alias_of)
    # Each reader's chunks, in bucket order, are in file order (sequential reads): its job-wide buckets, then
    # (several nodes reading) those of the rows its block alone takes.
    assert plan.block_own_from > 0 if len(readers) > 1 else plan.block_own_from == len(plan.buckets)
    for r in readers:
        for own in (False, True):
            keys = [(plan.sources[c.source].file, plan.sources[c.source].offset, c.rows)
                    for b in plan.buckets if b.reader == r and (b.index >= plan.block_own_from) == own
                    for c in b.chunks]
            assert keys == sorted(keys)


@pytest.mark.parametrize("world,tp,local_world", [(8, 4, 2), (6, 2, 2), (8, 4, 4), (4, 4, 1)])
def test_more_nodes_and_replicas(ckpt, world, tp, local_world):
    """4 nodes holding two tp-4 replicas, 3 or 2 nodes each a whole replica, 4 nodes of one rank (kv heads
    replicated across nodes): rows a replica on another node also needs are shared like any other, every
    byte is still read once, and every rank ends with the oracle's shard."""
    from checks import assert_rows_stay_on_their_node

    entries, config, rules, _ = ckpt("qwen3")
    layout = Layout(world=world, tp=tp, readers=tuple(range(0, world, local_world)), local_world=local_world)
    plan = build_plan(entries, config, rules, layout, staging_bytes=4096)
    assert_each_byte_read_once(plan)
    assert_items_consistent(plan)
    assert_matches_oracle(plan, arange_values(entries), config)
    assert_rows_stay_on_their_node(plan)


def test_many_nodes_read_equal_shares(ckpt):
    """16 nodes, each a tp-4 replica: every row is taken on every node, so the nodes split the checkpoint's
    bytes evenly, cutting a tensor (the embedding, bigger than a node's share) at a row where a share ends."""
    entries, config, rules, total = ckpt("qwen3")
    layout = Layout(world=64, tp=4, readers=tuple(range(0, 64, 4)), local_world=4)
    plan = build_plan(entries, config, rules, layout)
    assert_each_byte_read_once(plan)
    assert_matches_oracle(plan, arange_values(entries), config)
    per_node = {}
    for b in plan.buckets:
        per_node[b.reader] = per_node.get(b.reader, 0) + b.read_bytes
    share = total / len(layout.readers)
    assert max(s.nbytes for s in plan.sources.values()) > share   # a tensor that would overload one node whole
    widest = max(s.row_bytes for s in plan.sources.values())
    assert len(per_node) == 16 and max(per_node.values()) <= share * 17 / 16 + widest, (share, per_node)


def test_experts_over_two_nodes_are_read_on_one_of_them(tmp_path):
    """Expert groups of 8 ranks over two nodes of 4: rows both nodes take (w2, cut by columns) are read on one
    of the two, never on a third node; every byte once, every rank its oracle shard."""
    from checks import assert_rows_stay_on_their_node

    rules = toy_rules(tmp_path, TOY_MOE_RULES)
    entries = moe_entries()
    # The second group hosts the experts first in the file, so spreading by file order alone would not do.
    layout = Layout(world=16, tp=16, ep=2, readers=(0, 4, 8, 12), local_world=4,
                    expert_map=((2, 3),) * 8 + ((0, 1),) * 8)
    plan = build_plan(entries, MOE_CONFIG, rules, layout)
    values = arange_values(entries)
    hosts = expert_hosts(E, layout)
    for rank in range(layout.world):
        got = materialise_through_buckets(plan, rank, values)
        w13, w2 = expected_moe(values, hosts[rank], layout.rank_in_expert_group(rank), layout.expert_group_size)
        assert torch.equal(got["model.layers.0.experts.w13_weight"], w13)
        assert torch.equal(got["model.layers.0.experts.w2_weight"], w2)
    assert_each_byte_read_once(plan)
    assert_rows_stay_on_their_node(plan)
    readers = {c.source: layout.node(b.reader) for b in plan.buckets for c in b.chunks}
    for e in range(E):
        group_nodes = {layout.node(r) for r in range(layout.world) if e in hosts[r]}
        assert len(group_nodes) == 2 and readers[f"model.layers.0.experts.{e}.w2.weight"] in group_nodes


def test_items_on_a_mixed_bucket(ckpt):
    """A non-broadcast bucket with several sources: each rank's items are contiguous and add up."""
    entries, config, rules, _ = ckpt("phi3")
    plan = build_plan(entries, config, rules, Layout(world=4, tp=4))
    multi = [b for b in plan.buckets if not b.broadcast and len({c.source for c in b.chunks}) > 1]
    assert multi
    for b in multi:
        for rank in range(4):
            items = plan.items(b, rank)
            assert sum(it.nbytes for it in items) == b.recv_bytes[rank]
            assert [it.offset for it in items] == [sum(x.nbytes for x in items[:i]) for i in range(len(items))]


def test_deterministic(ckpt):
    entries, config, rules, _ = ckpt("qwen2")
    layout = Layout(world=4, tp=4, readers=(0, 2))
    a = build_plan(entries, config, rules, layout, staging_bytes=2048)
    b = build_plan(entries, config, rules, layout, staging_bytes=2048)
    c = build_plan(dict(reversed(list(entries.items()))), dict(config), rules, layout, staging_bytes=2048)
    assert a == b == c
    assert a.buckets == c.buckets and list(a.sources) == list(c.sources)


# ----------------------------------------------------------------------------------------------------
# Synthetic rules: shapes the shipped families do not have


def test_row_layer_1d_bias_is_replicated(tmp_path):
    rules = toy_rules(tmp_path, """\
        [params."o.weight"]
        style = "row"
        [params."o.bias"]
        style = "row"
        """)
    entries = one_file_entries({"o.weight": (6, 8), "o.bias": (6,)})
    values = arange_values(entries)
    plan = build_plan(entries, {}, rules, Layout(world=4, tp=4))
    assert plan.sources["o.bias"].broadcast
    for rank in range(4):
        assert plan.specs[rank]["o.bias"].local_shape == (6,)
        assert plan.specs[rank]["o.weight"].local_shape == (6, 2)
        got = materialise_through_buckets(plan, rank, values)
        assert torch.equal(got["o.bias"], values["o.bias"])
        assert torch.equal(got["o.weight"], values["o.weight"][:, rank * 2:(rank + 1) * 2])


def test_column_3d_local_shape(tmp_path):
    rules = toy_rules(tmp_path, """\
        [params."conv.weight"]
        style = "column"
        """)
    entries = one_file_entries({"conv.weight": (4, 6, 8)})
    plan = build_plan(entries, {}, rules, Layout(world=2, tp=2))
    for rank in range(2):
        spec = plan.specs[rank]["conv.weight"]
        assert spec.local_shape == (2, 6, 8)


MOE_CONFIG = {"num_hidden_layers": 1, "num_local_experts": 4, "intermediate_size": 8}
H, I, E = 6, 8, 4


def moe_entries():
    shapes = {"model.layers.0.gate.weight": (E, H)}
    for e in range(E):
        shapes[f"model.layers.0.experts.{e}.w1.weight"] = (I, H)
        shapes[f"model.layers.0.experts.{e}.w2.weight"] = (H, I)
        shapes[f"model.layers.0.experts.{e}.w3.weight"] = (I, H)
    return one_file_entries(shapes)


def expected_moe(values, ids, t, g):
    def rows(x):
        n = x.shape[0] // g
        return x[t * n:(t + 1) * n]
    w13 = torch.stack([torch.cat([rows(values[f"model.layers.0.experts.{e}.w1.weight"]),
                                  rows(values[f"model.layers.0.experts.{e}.w3.weight"])]) for e in ids])
    w2 = torch.stack([values[f"model.layers.0.experts.{e}.w2.weight"][:, t * I // g:(t + 1) * I // g] for e in ids])
    return w13, w2


@pytest.mark.parametrize("layout", [
    Layout(world=4, tp=4, ep=1),
    Layout(world=4, tp=4, ep=2),
    Layout(world=4, tp=4, ep=4),
    Layout(world=4, tp=4, ep=2, expert_placement="round_robin"),
    Layout(world=4, tp=4, ep=4, expert_map=((0, 1), (2,), (3, 1), (1,))),
], ids=["ep1", "ep2-linear", "ep4", "ep2-round-robin", "eplb"])
def test_toy_moe_plan(tmp_path, layout):
    rules = toy_rules(tmp_path, TOY_MOE_RULES)
    entries = moe_entries()
    values = arange_values(entries)
    plan = build_plan(entries, MOE_CONFIG, rules, layout)
    hosts = expert_hosts(E, layout)
    g = layout.expert_group_size
    for rank in range(layout.world):
        spec13 = plan.specs[rank]["model.layers.0.experts.w13_weight"]
        spec2 = plan.specs[rank]["model.layers.0.experts.w2_weight"]
        assert spec13.experts == spec2.experts == hosts[rank]
        assert spec13.global_shape == (E, 2 * I, H) and spec2.global_shape == (E, H, I)
        w13, w2 = expected_moe(values, hosts[rank], layout.rank_in_expert_group(rank), g)
        assert spec13.local_shape == tuple(w13.shape) and spec2.local_shape == tuple(w2.shape)
        assert_coverage(plan, rank)
        for how in (materialise_from_deliveries, materialise_through_buckets):
            got = how(plan, rank, values)
            assert torch.equal(got["model.layers.0.experts.w13_weight"], w13)
            assert torch.equal(got["model.layers.0.experts.w2_weight"], w2)
            assert torch.equal(got["model.layers.0.gate.weight"], values["model.layers.0.gate.weight"])
    # Experts go only to their hosts.
    for src in plan.sources.values():
        m = re.search(r"experts\.(\d+)\.", src.name)
        if m:
            assert {d.rank for d in src.deliveries} == {r for r in range(layout.world) if int(m.group(1)) in hosts[r]}
    assert sum(b.read_bytes for b in plan.buckets) == sum(e.nbytes for e in entries.values())
    assert_each_byte_read_once(plan)
    assert_items_consistent(plan)


def test_toy_moe_eplb_rank0_hosts_nothing(tmp_path):
    rules = toy_rules(tmp_path, TOY_MOE_RULES)
    plan = build_plan(moe_entries(), MOE_CONFIG, rules, Layout(world=2, tp=2, ep=2, expert_map=((), (0, 1, 2, 3))))
    for rank in range(2):
        assert plan.specs[rank]["model.layers.0.experts.w2_weight"].global_shape == (E, H, I)


# ----------------------------------------------------------------------------------------------------
# Experts: who hosts what


def test_expert_hosts_linear():
    assert expert_hosts(4, Layout(world=4, tp=4, ep=2)) == [(0, 1), (0, 1), (2, 3), (2, 3)]
    assert expert_hosts(8, Layout(world=4, tp=4, ep=4)) == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert expert_hosts(4, Layout(world=2, tp=2, ep=1)) == [(0, 1, 2, 3)] * 2


def test_expert_hosts_round_robin():
    lay = Layout(world=4, tp=4, ep=2, expert_placement="round_robin")
    assert expert_hosts(4, lay) == [(0, 2), (0, 2), (1, 3), (1, 3)]
    lay = Layout(world=4, tp=4, ep=4, expert_placement="round_robin")
    assert expert_hosts(8, lay) == [(0, 4), (1, 5), (2, 6), (3, 7)]


def test_expert_hosts_ep_must_divide_experts():
    with pytest.raises(PlanError, match=r"num_experts=6, ep=4.*try --ep 1, 2\)"):
        expert_hosts(6, Layout(world=4, tp=4, ep=4))


def test_expert_hosts_eplb_with_a_replicated_expert():
    # Expert 1 is hot: three ranks host it. Ids come back sorted per rank.
    lay = Layout(world=4, tp=4, ep=4, expert_map=((1, 0), (2,), (3, 1), (1,)))
    assert expert_hosts(4, lay) == [(0, 1), (2,), (1, 3), (1,)]
    # ep 2: both ranks of a group host the same ids (each TP-split 2 ways); expert 2 is in both groups.
    lay = Layout(world=4, tp=4, ep=2, expert_map=((0, 1, 2), (2, 1, 0), (2, 3), (3, 2)))
    assert expert_hosts(4, lay) == [(0, 1, 2), (0, 1, 2), (2, 3), (2, 3)]


@pytest.mark.parametrize("ep,emap,needle", [
    (4, ((0, 1), (2, 3)), "has 2 rank entries; the world size is 4"),
    (4, ((0,), (1,), (2,), (4,)), r"names experts \[4\] outside 0..3"),
    (4, ((0,), (1,), (2,), (-1, 3)), r"names experts \[-1\] outside 0..3"),
    (4, ((0,), (1,), (2,), (2,)), r"hosts no rank for experts \[3\]"),
    (2, ((0, 1), (0, 2), (2, 3), (2, 3)), "ranks 0 and 1 are in one expert group"),
    (2, ((0, 0, 1), (0, 0, 1), (2, 3), (2, 3)), "rank 0 lists an expert twice"),
])
def test_expert_hosts_invalid_maps(ep, emap, needle):
    with pytest.raises(PlanError, match=needle):
        expert_hosts(4, Layout(world=4, tp=4, ep=ep, expert_map=emap))


_PLAN_DIGEST = """
import hashlib, sys
from distload.checkpoint import discover
from distload.plan import build_plan
from distload.rules import rules_for
from distload.topology import Layout
idx = discover(sys.argv[1])
plan = build_plan(idx.tensors, idx.config, rules_for(idx.config),
                  Layout(world=4, tp=4, ep=int(sys.argv[2]), readers=(0, 2), local_world=2), staging_bytes=50000)
print(hashlib.sha256(repr((plan.specs, plan.sources, plan.buckets)).encode()).hexdigest())
"""


def test_plan_is_identical_across_processes_with_different_hash_seeds(dense_checkpoints, tmp_path):
    """Ranks are separate processes with their own PYTHONHASHSEED: any set-ordered iteration in planning
    would give ranks different plans, and a hang in the transfer. The plan must not depend on it."""
    import os
    import subprocess
    import sys

    from hf_models import save_checkpoint

    moe = save_checkpoint("qwen2_moe", tmp_path / "moe")
    for path, ep in ((dense_checkpoints["qwen3"], 1), (str(moe), 2)):
        digests = {subprocess.run([sys.executable, "-c", _PLAN_DIGEST, path, str(ep)], capture_output=True, text=True,
                                  env={**os.environ, "PYTHONHASHSEED": str(seed)}, check=True).stdout.strip()
                   for seed in (1, 2, 3)}
        assert len(digests) == 1, (path, digests)


def test_config_intermediate_size_contradicting_gate_up_is_refused(ckpt):
    for fam in ("llama", "phi3"):
        entries, config, _, _ = ckpt(fam)
        config = {**config, "intermediate_size": config["intermediate_size"] * 2}
        with pytest.raises(PlanError, match="config.json and the checkpoint disagree") as err:
            build_plan(entries, config, rules_for(config), Layout(world=2, tp=2))
        assert "gate" in str(err.value) and "intermediate" in str(err.value)


@pytest.mark.parametrize("family", DENSE)
def test_metadata_checkpoints_are_what_transformers_saves(ckpt, dense_checkpoints, family):
    """The metadata the pure tests plan is what hf_models' transformers model saves: the same tensors
    (name, file, dtype, shape) and the same numbers for every dim the family's rules read."""
    entries, config, rules, total = ckpt(family)
    index = discover(dense_checkpoints[family])
    saved = {n: (e.file, e.dtype, tuple(e.shape)) for n, e in index.tensors.items()}
    assert {n: (e.file, e.dtype, e.shape) for n, e in entries.items()} == saved
    assert total == index.total_bytes
    assert rules_for(index.config).name == rules.name
    assert {d: rules.dim(config, d) for d in rules.dims} == {d: rules.dim(index.config, d) for d in rules.dims}
    assert bool(config["tie_word_embeddings"]) == bool(index.config.get("tie_word_embeddings"))


def test_plan_digest_is_of_the_inputs(ckpt):
    """Ranks agree on a plan by the digest of its inputs: equal for equal inputs, different when any differs."""
    from distload.transfer.agreement import plan_digest

    entries, config, rules, _ = ckpt("llama")
    layout = Layout(world=4, tp=2)
    a, b = build_plan(entries, config, rules, layout), build_plan(dict(entries), dict(config), rules, layout)
    assert a.digest and a.digest == b.digest and plan_digest(a) == plan_digest(b)
    others = [build_plan(entries, config, rules, Layout(world=4, tp=4)),
              build_plan(entries, config, rules, layout, staging_bytes=1 << 20),
              build_plan(entries, {**config, "rms_norm_eps": 1e-3}, rules, layout)]
    first = next(iter(entries))
    moved = {**entries, first: replace(entries[first], offset=entries[first].offset + 2)}
    others.append(build_plan(moved, config, rules, layout, strict=False))
    assert len({a.digest} | {o.digest for o in others}) == 1 + len(others)


def test_rank_groups_name_their_members_and_the_one_nearest_a_reader():
    from distload.plan import Ranks, RankValues

    g = Ranks(3, 8, 4)                                   # tp rank 3 of 4 replicas at tp 8
    assert list(g.members()) == [3, 11, 19, 27] and g.last == 27
    assert all((r in g) == (r in (3, 11, 19, 27)) for r in range(40))
    assert [g.nearest(r) for r in (0, 3, 8, 17, 31, 99)] == [3, 3, 11, 19, 27, 27]   # the member in r's block
    assert [g.on_node(n, 8) for n in range(5)] == [1, 1, 1, 1, 0] and g.on_node(0, 0) == 4
    assert Ranks(0, 1, 16).nearest(9) == 9 and Ranks.one(5).nearest(9) == 5
    values = RankValues(["a", "b"], 6)
    assert list(values) == ["a", "b"] * 3 and values.group(1) == Ranks(1, 2, 3)


def test_replicas_plan_like_one_replica(ckpt):
    """Data-parallel replicas change no rank's shard and no bucket boundary: ranks tp apart hold the same,
    and the plan at 4 replicas has the buckets of one replica's (each read once, sized by bytes read)."""
    entries, config, rules, total = ckpt("llama")
    one = build_plan(entries, config, rules, Layout(world=2, tp=2), staging_bytes=4096)
    four = build_plan(entries, config, rules, Layout(world=8, tp=2), staging_bytes=4096)
    assert all(dict(four.specs[r]) == dict(one.specs[r % 2]) for r in range(8))
    assert [(b.reader, b.chunks, b.read_bytes) for b in four.buckets] == [(b.reader, b.chunks, b.read_bytes)
                                                                       for b in one.buckets]
    assert sum(b.read_bytes for b in four.buckets) == total
