"""DeepSeek-V2 / V3 / R1 / Kimi-K2 reference forward over the serving layout configs/deepseek_v3.toml delivers.

Multi-head latent attention, plain (the latent kv is expanded per head, not absorbed into q): the low-rank down
projections are replicated (`fused_qkv_a_proj` = [q_a rows; kv_a_proj_with_mqa rows], or q_proj by heads and
kv_a_proj_with_mqa whole without q_lora_rank), the up projections q_b_proj / kv_b_proj hold this rank's whole
heads, o_proj is row-parallel. Each head's query and key are [nope | rope]: the rope part of the key is one
head shared by all (k_rot of kv_a), rotated by DeepSeek's interleaved-pair RoPE when rope_interleave (as
transformers applies it). The MoE block (also GLM-4.5's): a sigmoid router with e_score_correction_bias and
grouped top-k, routed experts under EP, shared experts as one dense MLP over the group; layers below
first_k_dense_replace (and off the moe_layer_freq grid) keep a dense MLP. DeepSeek-V2 differs only in its
router: softmax scores, greedy or group-limited top-k, no correction bias.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from distload.errors import DistloadError
from distload.models.decoder import check_silu, decoder_logits, masked_softmax_attention
from distload.models.forward import causal_mask, dense_mlp, rms_norm
from distload.models.moe import (expert_placement, grouped_topk_route, local_experts, routed_experts,
                                 softmax_topk_route, swiglu)
from distload.models.rope import apply_rope, rope_cos_sin, rope_parameters
from distload.transfer import all_reduce_sum

# transformers builds q_a_layernorm / kv_a_layernorm with RMSNorm's default eps, not config.json's rms_norm_eps.
LATENT_NORM_EPS = 1e-6


def heads_per_rank(config: dict, tp_size: int) -> int:
    n_heads = config["num_attention_heads"]
    if n_heads % tp_size:
        raise DistloadError(f"num_attention_heads={n_heads}, tp={tp_size}: tp must divide the heads (MLA's q_b_proj "
                            "and kv_b_proj are cut by whole heads)")
    return n_heads // tp_size


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """DeepSeek's pairs (x0, x1), (x2, x3), ... each rotated by one frequency; the output holds the rotated even
    features then the odd ones, as transformers' apply_rotary_pos_emb_interleave (the same for q and k, so
    their dot products are those of the pairwise rotation)."""
    half = cos.shape[-1] // 2
    c, s = cos[..., :half], sin[..., :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def softmax_scale(config: dict) -> float:
    """qk_head_dim^-0.5, times mscale^2 under yarn with mscale_all_dim (transformers' yarn_apply_mscale)."""
    scale = (config["qk_nope_head_dim"] + config["qk_rope_head_dim"]) ** -0.5
    rp = rope_parameters(config)
    if rp["rope_type"] != "default" and rp.get("mscale_all_dim"):
        factor = rp.get("factor") or config["max_position_embeddings"] / rp["original_max_position_embeddings"]
        mscale = 1.0 if factor <= 1 else 0.1 * rp["mscale_all_dim"] * math.log(factor) + 1.0
        scale *= mscale * mscale
    return scale


def latent_projections(params: dict, prefix: str, x: torch.Tensor, config: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(q of this rank's heads [T, h * qk_head_dim], the replicated kv latent [T, kv_lora_rank + rope])."""
    if config.get("q_lora_rank"):
        q_lora = config["q_lora_rank"]
        fused = params[prefix + "fused_qkv_a_proj.weight"]
        q_a, kv_a = F.linear(x, fused.to(x.dtype)).split([q_lora, fused.shape[0] - q_lora], dim=-1)
        q_a = rms_norm(q_a, params[prefix + "q_a_layernorm.weight"], LATENT_NORM_EPS)
        return F.linear(q_a, params[prefix + "q_b_proj.weight"].to(x.dtype)), kv_a
    q = F.linear(x, params[prefix + "q_proj.weight"].to(x.dtype))
    return q, F.linear(x, params[prefix + "kv_a_proj_with_mqa.weight"].to(x.dtype))


def mla_attention(params: dict, prefix: str, x: torch.Tensor, config: dict, tp_size: int, cos: torch.Tensor,
                  sin: torch.Tensor, mask: torch.Tensor, group=None) -> torch.Tensor:
    """Plain MLA over this rank's heads, row-parallel o_proj + all-reduce."""
    h, T = heads_per_rank(config, tp_size), x.shape[0]
    nope, rope, v_dim = config["qk_nope_head_dim"], config["qk_rope_head_dim"], config["v_head_dim"]
    kv_lora = config["kv_lora_rank"]
    q, kv_a = latent_projections(params, prefix, x, config)
    if q.shape[-1] != h * (nope + rope):
        raise DistloadError(f"{prefix}q_b_proj / q_proj gives {q.shape[-1]} features; tp={tp_size} expects {h} heads "
                            f"x (qk_nope_head_dim {nope} + qk_rope_head_dim {rope})")
    q_pass, q_rot = q.view(T, h, nope + rope).transpose(0, 1).split([nope, rope], dim=-1)  # [h, T, .]
    kv_nope, k_rot = kv_a.split([kv_lora, rope], dim=-1)
    kv_nope = rms_norm(kv_nope, params[prefix + "kv_a_layernorm.weight"], LATENT_NORM_EPS)
    rotate = apply_rope_interleaved if config.get("rope_interleave", True) else apply_rope
    q_rot, k_rot = rotate(q_rot, cos, sin), rotate(k_rot[None], cos, sin)
    kv = F.linear(kv_nope, params[prefix + "kv_b_proj.weight"].to(x.dtype)).view(T, h, nope + v_dim).transpose(0, 1)
    k_nope, v = kv.split([nope, v_dim], dim=-1)
    query = torch.cat([q_pass, q_rot], dim=-1)
    key = torch.cat([k_nope, k_rot.expand(h, T, rope)], dim=-1)
    out = masked_softmax_attention(query, key, v, mask, softmax_scale(config))
    return all_reduce_sum(F.linear(out, params[prefix + "o_proj.weight"].to(x.dtype)).contiguous(), group)


def is_moe_layer(config: dict, layer: int) -> bool:
    """DeepSeek / GLM-4.5 (as vLLM): sparse iff layer >= first_k_dense_replace and on the moe_layer_freq grid."""
    return layer >= config.get("first_k_dense_replace", 0) and layer % config.get("moe_layer_freq", 1) == 0


def grouped_moe(params: dict, prefix: str, x: torch.Tensor, config: dict, *, local_expert_ids: list[int],
                counted: list[bool], group=None) -> torch.Tensor:
    """The DeepSeek MoE block (router, routed experts, shared experts); its output summed over the group."""
    if config.get("model_type") == "deepseek_v2":  # softmax scores, no correction bias
        weights, chosen = softmax_topk_route(
            x, params[prefix + "gate.weight"], top_k=config["num_experts_per_tok"],
            method=config.get("topk_method") or "greedy", n_group=config.get("n_group") or 1,
            topk_group=config.get("topk_group") or 1, scaling=config.get("routed_scaling_factor", 1.0))
    else:
        weights, chosen = grouped_topk_route(
            x, params[prefix + "gate.weight"], params[prefix + "gate.e_score_correction_bias"],
            top_k=config["num_experts_per_tok"], n_group=config.get("n_group") or 1,
            topk_group=config.get("topk_group") or 1, norm_topk=bool(config.get("norm_topk_prob", True)),
            scaling=config.get("routed_scaling_factor", 1.0))
    w13, w2 = local_experts(params, prefix, local_expert_ids)
    out = routed_experts(x, chosen, weights, local_expert_ids, counted,
                         lambda slot, tokens: swiglu(tokens, w13[slot], w2[slot]))
    if config.get("n_shared_experts"):
        # Split over the whole group like a dense MLP: its partial sums join the routed ones in one reduction.
        out = out + swiglu(x, params[prefix + "shared_experts.gate_up_proj.weight"],
                           params[prefix + "shared_experts.down_proj.weight"])
    return all_reduce_sum(out.contiguous(), group)


def moe_mlp(params: dict, config: dict, *, tp_rank: int, tp_size: int, local_expert_ids: list[int] | None,
            ep_size: int, device, group=None):
    """The MLP of each layer as a decoder Block: dense below the MoE layers, the grouped MoE block on them."""
    placement = None
    if any(is_moe_layer(config, i) for i in range(config["num_hidden_layers"])):
        placement = expert_placement(local_expert_ids, config["n_routed_experts"], tp_rank=tp_rank, tp_size=tp_size,
                                     ep_size=ep_size, device=device, group=group)

    def mlp(i: int, h: torch.Tensor) -> torch.Tensor:
        layer = f"model.layers.{i}.mlp."
        if not is_moe_layer(config, i):
            return dense_mlp(params, layer, h, group)
        return grouped_moe(params, layer, h, config, local_expert_ids=placement[0], counted=placement[1], group=group)
    return mlp


def forward(params: dict[str, torch.Tensor], config: dict, input_ids: torch.Tensor, *, tp_rank: int, tp_size: int,
            local_expert_ids: list[int] | None = None, ep_size: int = 1, dtype=torch.float32,
            group=None) -> torch.Tensor:
    """DeepSeek-V3 logits float32 `[T, vocab_size]`, identical on every rank (arguments as forward.forward)."""
    check_silu(config)
    device = params["model.embed_tokens.weight"].device
    T = input_ids.shape[0]
    cos, sin = rope_cos_sin(config, config["qk_rope_head_dim"], T, device, dtype)
    mask = causal_mask(T, None, device)

    def attention(i: int, h: torch.Tensor) -> torch.Tensor:
        return mla_attention(params, f"model.layers.{i}.self_attn.", h, config, tp_size, cos, sin, mask, group)

    mlp = moe_mlp(params, config, tp_rank=tp_rank, tp_size=tp_size, local_expert_ids=local_expert_ids,
                  ep_size=ep_size, device=device, group=group)
    return decoder_logits(params, config, input_ids, tp_rank=tp_rank, dtype=dtype, group=group, attention=attention,
                          mlp=mlp)
