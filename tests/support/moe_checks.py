"""Mixture-of-experts expectations shared by the MoE, DeepSeek, MTP and expert-group tests: which ranks host
which experts, each rank's expected expert shards, stacked experts, and shards materialised from a saved load."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from distload.plan.shard import view2d


def stack_experts(src: Path, out: Path) -> Path:
    """Rewrite a per-expert checkpoint with its experts stacked on disk the way transformers (>= 5) holds them:
    `model.layers.{l}.mlp.experts.gate_up_proj` [E, 2*I, H] (per expert cat[gate rows, up rows]) and
    `...mlp.experts.down_proj` [E, H, I]; Mixtral's `block_sparse_moe` becomes `mlp`, as in transformers."""
    from hf_models import checkpoint_tensors
    from safetensors.torch import save_file

    tensors = checkpoint_tensors(src)
    per_expert = re.compile(r"(model\.layers\.\d+)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(\w+)\.weight")
    kind = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up", "w2": "down", "down_proj": "down"}
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    out_tensors = {}
    for name, t in tensors.items():
        m = per_expert.fullmatch(name)
        if m:
            experts.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[kind[m.group(3)]] = t
        else:
            out_tensors[name.replace(".block_sparse_moe.", ".mlp.")] = t
    for layer, by_id in experts.items():
        ids = sorted(by_id)
        assert ids == list(range(len(ids)))
        out_tensors[f"{layer}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([by_id[e]["gate"], by_id[e]["up"]]) for e in ids])
        out_tensors[f"{layer}.mlp.experts.down_proj"] = torch.stack([by_id[e]["down"] for e in ids])
    out.mkdir(parents=True)
    names = sorted(out_tensors)
    files = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for fname, members in files.items():
        save_file({n: out_tensors[n].contiguous() for n in members}, str(out / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in members})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (out / "config.json").write_text((src / "config.json").read_text())
    return out


def expected_hosts(n: int, world: int, ep: int, placement: str = "linear", expert_map=None) -> list[list[int]]:
    if expert_map is not None:
        return [sorted(ids) for ids in expert_map]
    g, per = world // ep, n // ep
    if placement == "linear":
        return [list(range((r // g) * per, (r // g + 1) * per)) for r in range(world)]
    return [[e for e in range(n) if e % ep == r // g] for r in range(world)]


def num_experts(config: dict) -> int:
    return config.get("num_local_experts") or config["num_experts"]


def expected_shards(hf: dict, config: dict, rank: int, world: int, ep: int, ids: list[int]) -> dict:
    """The oracle's shards; a rank hosting no expert (EPLB) holds [0, ...] expert params (the oracle cannot
    stack nothing, so it slices one expert's shard down to zero)."""
    from layout_oracle import serving_shards

    want = serving_shards(hf, config, rank, world, ep_size=ep, local_expert_ids=ids or [0])
    if not ids:
        want = {n: t[:0] if n.endswith(("experts.w13_weight", "experts.w2_weight")) else t for n, t in want.items()}
    return want


def materialise(plan, rank: int, values: dict) -> dict[str, torch.Tensor]:
    """Fill rank's params from the plan's deliveries alone (what the wire would carry)."""
    from distload.dtypes import torch_dtype

    out = {n: torch.zeros(s.local_shape, dtype=torch_dtype(s.dtype)) for n, s in plan.specs[rank].items()
           if not s.alias_of}
    for src in plan.sources.values():
        v = values[src.name].reshape(view2d(src.shape))
        for d in src.deliveries:
            if d.rank == rank:
                p = d.piece
                dst = out[d.param].view(view2d(out[d.param].shape))
                dst[p.dst_row:p.dst_row + p.rows[1] - p.rows[0], p.dst_col:p.dst_col + p.cols[1] - p.cols[0]] = \
                    v[p.rows[0]:p.rows[1], p.cols[0]:p.cols[1]]
    return out
