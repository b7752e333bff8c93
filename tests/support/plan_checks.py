"""Checks on plans without processes: arange-filled checkpoints (a misplaced element tells where it came from),
a rank's params materialised from a pure plan (through its buckets, or its deliveries), and the comparisons with
the layout oracle that the plan, family, pipeline and shard tests share."""

from __future__ import annotations

import math

import torch
from hf_metadata import one_file_entries
from layout_oracle import serving_shards

from distload.dtypes import torch_dtype
from distload.plan.shard import LocalLayout, view2d
from distload.postprocess import OPS


def arange_values(entries: dict) -> dict[str, torch.Tensor]:
    """Every tensor: arange(numel) + (elements of all tensors before it in file order); all values unique."""
    out, at = {}, 0
    for name in sorted(entries, key=lambda n: (entries[n].file, entries[n].offset)):
        e = entries[name]
        n = math.prod(e.shape)
        out[name] = (torch.arange(n, dtype=torch.float64) + at).to(torch_dtype(e.dtype)).reshape(e.shape)
        at += n
    assert at < 2 ** 24  # exact in float32
    return out


def local_buffers(plan, rank: int) -> dict[str, torch.Tensor]:
    return {n: torch.zeros(view2d(s.local_shape), dtype=torch_dtype(s.dtype))
            for n, s in plan.specs[rank].items() if s.alias_of is None}


def finish(plan, rank: int, bufs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {n: t.reshape(plan.specs[rank][n].local_shape) for n, t in bufs.items()}
    for n, s in plan.specs[rank].items():
        if s.alias_of is not None:
            out[n] = out[s.alias_of]
    return out


def put(dst: torch.Tensor, piece, block: torch.Tensor) -> None:
    nr, nc = piece.rows[1] - piece.rows[0], piece.cols[1] - piece.cols[0]
    dst[piece.dst_row:piece.dst_row + nr, piece.dst_col:piece.dst_col + nc] = block


def materialise_from_deliveries(plan, rank: int, values) -> dict[str, torch.Tensor]:
    bufs = local_buffers(plan, rank)
    for src in plan.sources.values():
        v = values[src.name].reshape(view2d(src.shape))
        for d in src.deliveries:
            if d.rank == rank:
                pc = d.piece
                put(bufs[d.param], pc, v[pc.rows[0]:pc.rows[1], pc.cols[0]:pc.cols[1]])
    return finish(plan, rank, bufs)


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def materialise_through_buckets(plan, rank: int, values) -> dict[str, torch.Tensor]:
    """Simulate the wire: the reader lays out bytes as items() says, the receiver unpacks by items()."""
    bufs = local_buffers(plan, rank)
    for bucket in plan.buckets:
        items = plan.items(bucket, rank)
        if bucket.broadcast:
            wire = torch.cat([raw(values[c.source].reshape(view2d(plan.sources[c.source].shape))[c.rows[0]:c.rows[1]])
                              for c in bucket.chunks])
            assert wire.numel() == bucket.read_bytes == bucket.recv_bytes[rank]
        else:
            # What the reader packs for `rank`: each item's clipped piece, in items() order, at its offset.
            wire = torch.zeros(bucket.recv_bytes[rank], dtype=torch.uint8)
            for it in items:
                v = values[it.chunk.source].reshape(view2d(plan.sources[it.chunk.source].shape))
                pc = it.piece
                wire[it.offset:it.offset + it.nbytes] = raw(v[pc.rows[0]:pc.rows[1], pc.cols[0]:pc.cols[1]])
        for it in items:
            src = plan.sources[it.chunk.source]
            dtype = torch_dtype(src.dtype)
            pc = it.piece
            assert it.chunk.rows[0] <= pc.rows[0] < pc.rows[1] <= it.chunk.rows[1]
            block = wire[it.offset:it.offset + it.nbytes].view(dtype)
            if bucket.broadcast:  # the item is the whole chunk; the piece picks rows and columns from it
                block = block.reshape(it.chunk.rows[1] - it.chunk.rows[0], -1)
                block = block[pc.rows[0] - it.chunk.rows[0]:pc.rows[1] - it.chunk.rows[0], pc.cols[0]:pc.cols[1]]
            else:
                block = block.reshape(pc.rows[1] - pc.rows[0], pc.cols[1] - pc.cols[0])
            put(bufs[it.param], pc, block)
    return finish(plan, rank, bufs)


def assert_coverage(plan, rank: int) -> None:
    """Every element of every local param is written exactly once, padding never."""
    for name, spec in plan.specs[rank].items():
        if spec.alias_of is not None:
            continue
        count = torch.zeros(view2d(spec.local_shape), dtype=torch.int64)
        for src in plan.sources.values():
            for d in src.deliveries:
                if d.rank == rank and d.param == name:
                    pc = d.piece
                    count[pc.dst_row:pc.dst_row + pc.rows[1] - pc.rows[0],
                          pc.dst_col:pc.dst_col + pc.cols[1] - pc.cols[0]] += 1
        for r0, r1, c0, c1 in spec.padding:
            assert not count[r0:r1, c0:c1].any(), f"{name}: padding is written"
            count[r0:r1, c0:c1] += 1
        assert torch.equal(count, torch.ones_like(count)), f"rank {rank} {name}: not covered exactly once"


def assert_matches_oracle(plan, values, config) -> None:
    layout = plan.layout
    for rank in range(layout.world):
        want = serving_shards(values, config, layout.tp_rank(rank), layout.tp)
        specs = plan.specs[rank]
        assert set(specs) == set(want), f"rank {rank}: params differ: {set(specs) ^ set(want)}"
        for name, t in want.items():
            assert specs[name].local_shape == tuple(t.shape), f"rank {rank} {name}"
        assert_coverage(plan, rank)
        for how in (materialise_from_deliveries, materialise_through_buckets):
            got = how(plan, rank, values)
            for name, t in want.items():
                assert torch.equal(got[name], t), f"{how.__name__}: rank {rank} {name} differs from the oracle"


def chunks_by_source(plan) -> dict[str, list]:
    out = {}
    for b in plan.buckets:
        for c in b.chunks:
            out.setdefault(c.source, []).append((b, c))
    return out


def assert_each_byte_read_once(plan) -> None:
    by_source = chunks_by_source(plan)
    assert set(by_source) == set(plan.sources)
    for name, src in plan.sources.items():
        rows = sorted(c.rows for _, c in by_source[name])
        at = 0
        for a, b in rows:
            assert a == at and b > a, f"{name}: chunks {rows} do not tile rows 0..{src.rows}"
            at = b
        assert at == src.rows
        if plan.layout.one_node:  # one node splits sources between readers at tensor boundaries only
            assert len({b.reader for b, _ in by_source[name]}) == 1, f"{name}: read by two readers"
    for b in plan.buckets:
        assert b.read_bytes == sum((c.rows[1] - c.rows[0]) * plan.sources[c.source].row_bytes for c in b.chunks)
        assert all(plan.sources[c.source].broadcast == b.broadcast for c in b.chunks)
    assert sum(b.read_bytes for b in plan.buckets) == plan.checkpoint_bytes


def staged_shards(plan, rank: int, values: dict) -> dict:
    """Rank's params from the pure plan of a load with post-load steps: every staged element delivered exactly once
    (padding: never, and zero), then the plan's steps run (transposes; the rules' permutes and transforms)."""
    got = staged_from_deliveries(plan, rank, values)
    for step in plan.post[rank]:   # by the loader's own post-load ops (transposes, permutes, value transforms)
        finals = [plan.specs[rank][n] for n in step.outputs]
        got.update(zip(step.outputs, OPS[step.op](step, finals, *(got[n] for n in step.inputs))))
    for n, s in plan.specs[rank].items():
        if s.alias_of is not None:
            got[n] = got[s.alias_of]
        assert tuple(got[n].shape) == s.local_shape, n
    return got


OFFSET = 10_000


def arange_sources(shapes: dict[str, tuple[int, int]]) -> dict[str, torch.Tensor]:
    """Source i holds OFFSET * (i + 1) + arange(numel) in its 2-D view."""
    out = {}
    for i, (name, (rows, cols)) in enumerate(shapes.items()):
        assert rows * cols < OFFSET
        out[name] = (torch.arange(rows * cols, dtype=torch.float64) + OFFSET * (i + 1)).reshape(rows, cols)
    return out


def materialise(layout: LocalLayout, sources: dict[str, torch.Tensor]) -> torch.Tensor:
    """Rank-local tensor: zeros (padding stays zero), then every piece copied into place."""
    local = torch.zeros(layout.rows, layout.cols, dtype=torch.float64)
    for pc in layout.pieces:
        nr, nc = pc.rows[1] - pc.rows[0], pc.cols[1] - pc.cols[0]
        local[pc.dst_row:pc.dst_row + nr, pc.dst_col:pc.dst_col + nc] = \
            sources[pc.source][pc.rows[0]:pc.rows[1], pc.cols[0]:pc.cols[1]]
    return local


H, I, V, LAYERS, HEADS, KV_HEADS, EXPERTS = 512, 1024, 1024, 2, 8, 4, 4   # decoder()'s sizes


def decoder(moe: bool) -> tuple[dict, dict]:
    """(entries, config) of a small Llama (or Mixtral, moe) whose large pieces travel as direct messages."""
    hd = H // HEADS
    config = {"architectures": ["MixtralForCausalLM" if moe else "LlamaForCausalLM"], "hidden_size": H,
              "intermediate_size": I, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
              "num_hidden_layers": LAYERS, "vocab_size": V, "tie_word_embeddings": False}
    shapes = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,), "lm_head.weight": (V, H)}
    for layer in range(LAYERS):
        p = f"model.layers.{layer}."
        shapes.update({p + "self_attn.q_proj.weight": (H, H), p + "self_attn.k_proj.weight": (KV_HEADS * hd, H),
                       p + "self_attn.v_proj.weight": (KV_HEADS * hd, H), p + "self_attn.o_proj.weight": (H, H),
                       p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,)})
        if moe:
            config["num_local_experts"] = EXPERTS
            shapes[p + "block_sparse_moe.gate.weight"] = (EXPERTS, H)
            for e in range(EXPERTS):
                q = f"{p}block_sparse_moe.experts.{e}."
                shapes.update({q + "w1.weight": (I, H), q + "w2.weight": (H, I), q + "w3.weight": (I, H)})
        else:
            shapes.update({p + "mlp.gate_proj.weight": (I, H), p + "mlp.up_proj.weight": (I, H),
                           p + "mlp.down_proj.weight": (H, I)})
    return one_file_entries(shapes), config


def staged_from_deliveries(plan, rank: int, values) -> dict[str, torch.Tensor]:
    """Rank's staging params (what the transfer writes, before post-load steps) from the plan's deliveries, each
    element written exactly once (zero padding never)."""
    staging = plan.staging_specs(rank)
    bufs = {n: torch.zeros(view2d(s.local_shape), dtype=torch_dtype(s.dtype))
            for n, s in staging.items() if s.alias_of is None}
    count = {n: torch.zeros(b.shape, dtype=torch.int64) for n, b in bufs.items()}
    for src in plan.sources.values():
        v = values[src.name].reshape(view2d(src.shape))
        for d in (d for d in src.deliveries if d.rank == rank):
            pc = d.piece
            put(bufs[d.param], pc, v[pc.rows[0]:pc.rows[1], pc.cols[0]:pc.cols[1]])
            nr, nc = pc.rows[1] - pc.rows[0], pc.cols[1] - pc.cols[0]
            count[d.param][pc.dst_row:pc.dst_row + nr, pc.dst_col:pc.dst_col + nc] += 1
    for n, c in count.items():
        for r0, r1, c0, c1 in staging[n].padding:
            assert not c[r0:r1, c0:c1].any(), f"rank {rank} {n}: padding is written"
            c[r0:r1, c0:c1] += 1
        assert torch.equal(c, torch.ones_like(c)), f"rank {rank} {n}: not covered exactly once"
    out = {n: b.reshape(staging[n].local_shape) for n, b in bufs.items()}
    for n, s in staging.items():
        if s.alias_of is not None:
            out[n] = out[s.alias_of]
    return out
