"""GPT-OSS reference forward over the serving layout configs/gpt_oss.toml delivers (vLLM's gpt_oss.py names).

Attention under `attn.`: qkv_proj with its bias (this rank's q heads, its kv heads or a replica), one learned
sink logit per head (`sinks`, cut like q), sliding-window layers by `layer_types`, o_proj row-parallel with its
bias whole on every rank (added once, after the reduction). MoE: the router (weight + bias, replicated) takes
the top-k logits and softmaxes over those k; each expert's w13 rows are gate and up *interleaved* (even rows
gate, odd rows up: a TP cut keeps whole pairs), with its w13_bias cut the same way; the clamped SwiGLU
(gate <= limit, |up| <= limit, (up + 1) * gate * sigmoid(alpha * gate)); w2_bias is whole on rank 0 of each
expert group and zero on the others, so adding it on every rank adds it once to the group's sum.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from distload.errors import DistloadError
from distload.models.decoder import decoder_logits, masked_softmax_attention, masks_by_window
from distload.models.forward import local_heads, sliding_window
from distload.models.moe import expert_placement, local_experts, routed_experts
from distload.models.rope import apply_rope, rope_cos_sin
from distload.transfer import all_reduce_sum


def sink_attention(params: dict, prefix: str, x: torch.Tensor, config: dict, tp_size: int, cos: torch.Tensor,
                   sin: torch.Tensor, mask: torch.Tensor, group=None) -> torch.Tensor:
    """Column-parallel qkv (+ bias), GQA with per-head sinks, row-parallel o_proj + all-reduce, then its bias."""
    n_q, n_kv, d = local_heads(config, tp_size)
    T = x.shape[0]
    w = params[prefix + "qkv_proj.weight"]
    if w.shape[0] != (n_q + 2 * n_kv) * d:
        raise DistloadError(f"{prefix}qkv_proj.weight has {w.shape[0]} rows; tp={tp_size} expects "
                            f"({n_q} q + 2 * {n_kv} kv heads) * head_dim {d} = {(n_q + 2 * n_kv) * d}")
    bias = params.get(prefix + "qkv_proj.bias")
    qkv = F.linear(x, w.to(x.dtype), None if bias is None else bias.to(x.dtype))
    q, k, v = (t.view(T, -1, d).transpose(0, 1) for t in qkv.split([n_q * d, n_kv * d, n_kv * d], dim=-1))
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    # Local q heads share the local kv heads in order (also a single replicated kv head).
    k, v = k.repeat_interleave(n_q // n_kv, dim=0), v.repeat_interleave(n_q // n_kv, dim=0)
    out = masked_softmax_attention(q, k, v, mask, d ** -0.5, sinks=params[prefix + "sinks"])
    out = all_reduce_sum(F.linear(out, params[prefix + "o_proj.weight"].to(x.dtype)).contiguous(), group)
    o_bias = params.get(prefix + "o_proj.bias")
    return out if o_bias is None else out + o_bias.to(x.dtype)


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """GPT-OSS's activation over interleaved [gate, up] features (transformers' GptOssExperts._apply_gate)."""
    gate, up = gate_up[..., ::2], gate_up[..., 1::2]
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def router_moe(params: dict, prefix: str, x: torch.Tensor, config: dict, *, local_expert_ids: list[int],
               counted: list[bool], group=None) -> torch.Tensor:
    """The GPT-OSS MoE block; its output summed over the group."""
    logits = F.linear(x, params[prefix + "router.weight"].to(x.dtype), params[prefix + "router.bias"].to(x.dtype))
    top, chosen = torch.topk(logits, config["num_experts_per_tok"], dim=-1)
    weights = torch.softmax(top, dim=-1, dtype=top.dtype)
    w13, w2 = local_experts(params, prefix, local_expert_ids)
    b13, b2 = params[prefix + "experts.w13_bias"], params[prefix + "experts.w2_bias"]
    alpha, limit = config.get("swiglu_alpha", 1.702), config.get("swiglu_limit", 7.0)

    def expert(slot: int, tokens: torch.Tensor) -> torch.Tensor:
        gate_up = F.linear(tokens, w13[slot].to(x.dtype), b13[slot].to(x.dtype))
        return F.linear(clamped_swiglu(gate_up, alpha, limit), w2[slot].to(x.dtype), b2[slot].to(x.dtype))

    out = routed_experts(x, chosen, weights, local_expert_ids, counted, expert)
    return all_reduce_sum(out.contiguous(), group)


def forward(params: dict[str, torch.Tensor], config: dict, input_ids: torch.Tensor, *, tp_rank: int, tp_size: int,
            local_expert_ids: list[int] | None = None, ep_size: int = 1, dtype=torch.float32,
            group=None) -> torch.Tensor:
    """GPT-OSS logits float32 `[T, vocab_size]`, identical on every rank (arguments as forward.forward)."""
    device = params["model.embedding.weight"].device
    T = input_ids.shape[0]
    _, _, head_dim = local_heads(config, tp_size)
    cos, sin = rope_cos_sin(config, head_dim, T, device, dtype)
    masks = masks_by_window(T, [sliding_window(config, i) for i in range(config["num_hidden_layers"])], device)
    ids, counted = expert_placement(local_expert_ids, config["num_local_experts"], tp_rank=tp_rank, tp_size=tp_size,
                                    ep_size=ep_size, device=device, group=group)

    def attention(i: int, h: torch.Tensor) -> torch.Tensor:
        return sink_attention(params, f"model.layers.{i}.attn.", h, config, tp_size, cos, sin, masks[i], group)

    def mlp(i: int, h: torch.Tensor) -> torch.Tensor:
        return router_moe(params, f"model.layers.{i}.mlp.", h, config, local_expert_ids=ids, counted=counted,
                          group=group)

    return decoder_logits(params, config, input_ids, tp_rank=tp_rank, dtype=dtype, group=group, attention=attention,
                          mlp=mlp, embed_name="model.embedding.weight")
