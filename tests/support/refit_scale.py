"""Refit planning at real shapes without processes or bytes: what tests/pure/test_refit_plan_scale.py asserts and
scripts/refit_plan_scale.py times.

A Llama-3-8B-shaped checkpoint's metadata (hf_metadata), held by T trainer ranks as FSDP2 holds it (Shard(0):
torch.chunk's rows, ceil(n / T) each) in `distload.refit.Piece`s over meta tensors, described by holdings.describe
as a trainer rank describes them each step; one serving rank of a tp S job (its params meta tensors in the
layout a load gives it), planned by ServingSide.plan_for as the link's first step plans it.
"""

from __future__ import annotations

import torch

from distload.dtypes import torch_dtype
from distload.plan import DEFAULT_STAGING_BYTES
from distload.refit import Piece
from distload.refit.holdings import describe
from distload.refit.one_source import update_plan
from distload.refit.routes import holdings_digest
from distload.refit.serving import ServingSide
from distload.rules import rules_for
from distload.topology import Layout
from hf_metadata import decoder_config, decoder_shapes

DTYPE = "BF16"
LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=8192,
                rope_theta=500000.0, torch_dtype="bfloat16")


def llama_8b() -> tuple[dict, dict[str, tuple[int, ...]]]:
    """(config.json, checkpoint shapes) of a Llama-3-8B-shaped model."""
    config = decoder_config("llama", **LLAMA_8B)
    return config, decoder_shapes(config)


def shard0_rows(n: int, rank: int, world: int) -> tuple[int, int]:
    """FSDP2's Shard(0) of n rows: ceil(n / world) each, the last ranks fewer or none."""
    per = -(-n // world)
    return min(n, rank * per), min(n, (rank + 1) * per)


def shard0_pieces(shapes: dict, rank: int, world: int, dtype: str = DTYPE) -> dict[str, Piece]:
    """Trainer `rank`'s Shard(0) Pieces of every tensor, over meta tensors (no bytes)."""
    out = {}
    for name, shape in shapes.items():
        a, b = shard0_rows(shape[0], rank, world)
        local = torch.empty((b - a, *shape[1:]), dtype=torch_dtype(dtype), device="meta")
        out[name] = Piece(local, (a,) + (0,) * (len(shape) - 1), tuple(shape))
    return out


def trainer_holdings(shapes: dict, world: int) -> list[dict]:
    """Every trainer rank's holdings (name -> holdings.Held), as each describes its own."""
    return [describe(shard0_pieces(shapes, t, world)) for t in range(world)]


def digest_sum(holdings: list[dict]) -> int:
    """What the step's metadata all-reduce sums: each trainer rank's holdings digest."""
    return sum(holdings_digest(t, held) for t, held in enumerate(holdings))


def serving_side(config: dict, shapes: dict, servings: int, rank: int, staging_bytes: int = DEFAULT_STAGING_BYTES):
    """Serving rank `rank` of a tp `servings` job, its params the meta tensors of the layout a load gives it."""
    family = rules_for(config)
    layout = Layout(world=servings, tp=servings)
    meta = {n: (DTYPE, s) for n, s in shapes.items()}
    plan = update_plan(meta, config, family, layout, staging_bytes, None, False, False)
    params = {n: torch.empty(s.local_shape, dtype=torch_dtype(s.dtype), device="meta")
              for n, s in plan.specs[rank].items()}
    return ServingSide(params, None, layout, config, family, rank, quantize=None, dequantize=False, staged=True,
                       staging_mib=staging_bytes >> 20, partial=False)
