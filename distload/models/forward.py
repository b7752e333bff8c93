"""Reference tensor-parallel forward over the serving layout (DESIGN §4.2), for verification.

A loaded shard set is right when this forward, run on every rank, gives transformers' logits. It is plain
eager torch (one sequence, no KV cache, no batching) and reads nothing but the local params and the
config.json dict. One decoder loop serves every family: what differs is the family's row (family.py), the
pieces are blocks.py's. Collectives go through distload.transfer only: one all-reduce after each
row-parallel layer (o_proj, down_proj, the MoE block) and after the vocab-parallel embedding, one all-gather
of the logits; with pipeline stages, one send of the hidden states from each stage to the next.
It runs unchanged on CPU/gloo and CUDA/NCCL: everything lives on the device of the params.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from distload.errors import DistloadError
from distload.models.blocks import (attention, causal_mask, dense_mlp, embed, local_heads, norm, rank_projection_norms,
                                    rms_norm, sliding_window)
from distload.models.family import FAMILIES, Family, family_of, flag, standard_config
from distload.models.moe import counted_experts, default_expert_ids, sparse_moe
from distload.models.rope import apply_rope, rope_cos_sin
from distload.transfer import all_gather_cat, all_reduce_sum
from distload.transfer.stage_links import recv_tensor, send_tensor

# The pieces are re-exported: the other forwards (models.FORWARDS) build on them from here.
__all__ = ["FAMILIES", "Family", "apply_rope", "attention", "causal_mask", "dense_mlp", "embed", "family_of",
           "forward", "is_sparse", "local_heads", "rms_norm", "rope_cos_sin", "sliding_window"]

# config switches this forward does not implement: (key, the value that needs what is missing)
UNSUPPORTED = (("attention_bias", True), ("mlp_bias", True), ("use_bidirectional_attention", True),
               ("scale_attn_by_inverse_layer_idx", True), ("scale_attn_weights", False),
               ("add_cross_attention", True))


def _check_supported(config: dict) -> None:
    """Refuse rather than return wrong logits."""
    for key, value in UNSUPPORTED:
        if key in config and bool(config[key]) == value:
            raise DistloadError(f"{key}={str(value).lower()} is not supported by the reference forward")


def is_sparse(config: dict, family: Family, layer: int) -> bool:
    """Sparse (MoE) layer? Qwen-MoE can keep dense layers: mlp_only_layers and decoder_sparse_step."""
    return (family.moe_prefix is not None and layer not in config.get("mlp_only_layers", ())
            and (layer + 1) % config.get("decoder_sparse_step", 1) == 0)


def _moe_setup(config: dict, family: Family, local_expert_ids, tp_rank: int, tp_size: int, ep_size: int, device,
               group) -> dict | None:
    """sparse_moe's keyword arguments (collective: every rank of the group calls it), or None without MoE."""
    if not any(is_sparse(config, family, i) for i in range(config["num_hidden_layers"])):
        return None
    n_experts = config.get("num_local_experts") or config["num_experts"]
    if local_expert_ids is None:
        local_expert_ids = default_expert_ids(n_experts, tp_rank, tp_size, ep_size)
    if list(local_expert_ids) != sorted(set(local_expert_ids)):
        raise DistloadError(f"local_expert_ids {local_expert_ids} must be ascending and distinct: "
                            "w13_weight/w2_weight hold the local experts in ascending global id")
    return dict(local_expert_ids=local_expert_ids, top_k=config["num_experts_per_tok"],
                norm_topk=flag(config, family.norm_topk), shared_expert=family.shared_expert,
                counted=counted_experts(local_expert_ids, n_experts, tp_rank=tp_rank, tp_size=tp_size,
                                        ep_size=ep_size, device=device, group=group))


def decoder_layer(params: dict, i: int, x: torch.Tensor, config: dict, family: Family, tp_size: int, rope: dict,
                  mask: torch.Tensor, moe: dict | None, group=None) -> torch.Tensor:
    """Layer i on the residual stream x `[T, H]` (replicated on every rank of the group)."""
    names, eps = family.names, config[family.eps_key]
    layer = names.layer.format(i)
    cos, sin = rope.get(config["layer_types"][i] if config.get("layer_types") else None, (None, None))

    def normed(slot: str | None, h: torch.Tensor) -> torch.Tensor:
        return norm(family.norm, h, params, layer + slot, eps) if slot else h

    def mlp(h: torch.Tensor) -> torch.Tensor:
        if is_sparse(config, family, i):
            # Routed experts and the shared expert are all partial sums: one all-reduce for the block.
            return all_reduce_sum(sparse_moe(params, layer + family.moe_prefix, h, **moe).contiguous(), group)
        return dense_mlp(params, layer + names.mlp, h, group, family, config)

    scale = config["residual_multiplier"] if family.multipliers else None
    h = normed(names.pre_attn_norm, x)
    a = attention(params, layer + names.attn, h, config, family, tp_size, cos, sin, mask, group)
    if family.parallel_block:
        return x + a + mlp(h)
    a = normed(names.post_attn_norm, a)
    x = x + (a * scale if scale is not None else a)
    m = normed(names.post_mlp_norm, mlp(normed(names.pre_mlp_norm, x)))
    return x + (m * scale if scale is not None else m)


def _embeddings(params: dict, ids: torch.Tensor, config: dict, family: Family, tp_rank: int, dtype,
                group) -> torch.Tensor:
    """The first stage's input to layer 0: token (+ learned position) embeddings, scaled as the family does."""
    x = embed(params[family.names.embed], ids, tp_rank, dtype, group)
    if family.names.positions:
        x = x + params[family.names.positions][: ids.shape[0]].to(dtype)
    if family.scaled_embedding:
        x = x * torch.tensor(config["hidden_size"] ** 0.5, dtype=dtype)
    if family.multipliers:
        x = x * config["embedding_multiplier"]
    return x


def _logits(params: dict, x: torch.Tensor, config: dict, family: Family, dtype, group) -> torch.Tensor:
    """The last stage's head on the final-normed x: vocab-parallel lm_head, gathered, family's logit scaling."""
    # Tied: lm_head is the embedding (a loader may alias it or leave it out).
    lm_head = (params.get(family.names.lm_head, params.get(family.names.embed)) if config.get("tie_word_embeddings")
               else params[family.names.lm_head])
    logits = all_gather_cat(F.linear(x, lm_head.to(dtype)).float().contiguous(), dim=1, group=group)
    logits = logits[:, : config["vocab_size"]]  # drop the zero rows that pad the vocab to a multiple of lcm(64, tp)
    if family.multipliers:
        logits = logits / config["logits_scaling"]
    if family.logit_scale:
        logits = logits * config["logit_scale"]
    cap = config.get("final_logit_softcapping") if family.softcap else None
    return torch.tanh(logits / cap) * cap if cap else logits


def forward(params: dict[str, torch.Tensor], config: dict, input_ids: torch.Tensor, *, tp_rank: int, tp_size: int,
            local_expert_ids: list[int] | None = None, ep_size: int = 1, dtype=torch.float32, group=None,
            layers: range | None = None, prev_rank: int | None = None, next_rank: int | None = None,
            hidden_states: dict | None = None) -> torch.Tensor | None:
    """Logits float32 `[T, vocab_size]` of one sequence `input_ids [T]`, identical on every rank.

    params: this rank's serving-layout tensors (name -> local tensor); config: the config.json dict.
    tp_size is the size of `group` (default: the world); attention and dense MLPs are TP-split over all of
    it, MoE experts over `ep_size` groups of tp_size/ep_size ranks. local_expert_ids: the global ids this
    rank hosts, ascending, the same for every layer (default: the contiguous placement); an expert hosted
    by several groups (EPLB replica) is counted once, by the first group hosting it. Collective: every
    rank of the group must call it.

    Pipeline stages: `layers` (default all) are the ones this stage runs; a stage that does not start at
    layer 0 receives its input `[T, H]` from global rank `prev_rank`, one that does not end at the last layer
    sends its output to `next_rank` and returns None (only the last stage norms and computes logits); `group`
    is then the stage's TP group (the default, the world, would mix the stages' reductions).
    hidden_states: when a dict, filled as transformers' output_hidden_states numbers them: key 0 the
    embeddings, key i + 1 layer i's output, key num_hidden_layers the final-normed output (this stage's only).
    """
    family = family_of(config)
    config = standard_config(config, family)
    _check_supported(config)
    params = rank_projection_norms(params, config, family, tp_rank, tp_size)
    n_layers = config["num_hidden_layers"]
    layers = range(n_layers) if layers is None else layers
    device = next(iter(params.values())).device
    ids = input_ids.to(device)
    T = ids.shape[0]
    record = hidden_states if hidden_states is not None else {}

    _, _, head_dim = local_heads(config, tp_size)
    rope = {}  # layer type (None: one for all layers) -> cos, sin
    if not family.names.positions:
        for kind in sorted(set(config.get("layer_types") or [None]), key=str):
            rope[kind] = rope_cos_sin(config, head_dim, T, device, dtype, dict(family.rope_aliases), kind,
                                      family.rope_interleaved)
    masks = {}  # window -> mask, built once per distinct window
    moe = _moe_setup(config, family, local_expert_ids, tp_rank, tp_size, ep_size, device, group)

    if layers.start == 0:
        x = _embeddings(params, ids, config, family, tp_rank, dtype, group)
        record[0] = x
    else:
        x = recv_tensor((T, config["hidden_size"]), dtype, device, prev_rank)
    for i in layers:
        window = sliding_window(config, i)
        if window not in masks:
            masks[window] = causal_mask(T, window, device)
        x = decoder_layer(params, i, x, config, family, tp_size, rope, masks[window], moe, group)
        if i + 1 < n_layers:
            record[i + 1] = x
    if layers.stop < n_layers:
        send_tensor(x.contiguous(), next_rank)
        return None
    x = norm(family.norm, x, params, family.names.final_norm, config[family.eps_key])
    record[n_layers] = x
    return _logits(params, x, config, family, dtype, group)
