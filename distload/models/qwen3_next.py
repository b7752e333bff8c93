"""Qwen3-Next reference forward over the serving layout configs/qwen3_next.toml delivers (vLLM's qwen3_next.py).

A hybrid by `layer_types`: gated full attention and Gated DeltaNet linear attention, each over a Qwen2-MoE-style
sparse block (softmax router, routed experts under EP, a sigmoid-gated shared expert). Every RMSNorm of the
decoder (and q_norm / k_norm) scales by 1 + weight.
- Full attention: qkv_proj's q part holds, per local head, [q | gate] (2 * head_dim rows); the attention output
  is multiplied by sigmoid(gate) before the row-parallel o_proj.
- Linear attention: in_proj_qkvz / in_proj_ba hold whole key-head groups ([q, k, v.., z..] and [b.., a..] per
  key head), conv1d the local [q; k; v] channels, A_log / dt_bias the local value heads, out_proj is row-parallel.
  Everything inside is per head, so a rank runs the delta rule over its own heads only. The rule is computed
  token by token (transformers' torch_recurrent_gated_delta_rule), equal to the chunked form up to rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from distload.errors import DistloadError
from distload.models.decoder import check_silu, decoder_logits, masked_softmax_attention
from distload.models.forward import Family, causal_mask, dense_mlp, is_sparse, local_heads
from distload.models.moe import expert_placement, sparse_moe
from distload.models.rope import apply_rope, rope_cos_sin
from distload.transfer import all_reduce_sum

FAMILY = Family("Qwen3NextForCausalLM", moe_prefix="mlp.", shared_expert=True)


def offset_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3-Next's RMSNorm: in float32, scaled by (1 + weight), then back to x's dtype."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (x32 * (1.0 + weight.float())).to(x.dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm(x) * weight, then times silu(gate) in float32 (transformers' Qwen3NextRMSNormGated)."""
    x32 = x.float()
    normed = weight.to(x.dtype) * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (normed * F.silu(gate.float())).to(x.dtype)


def gated_attention(params: dict, prefix: str, x: torch.Tensor, config: dict, tp_size: int, cos: torch.Tensor,
                    sin: torch.Tensor, mask: torch.Tensor, group=None) -> torch.Tensor:
    """Column-parallel qkv ([q | gate] per head), q/k norms, GQA, sigmoid(gate), row-parallel o_proj + all-reduce."""
    n_q, n_kv, d = local_heads(config, tp_size)
    T, eps = x.shape[0], config["rms_norm_eps"]
    w = params[prefix + "qkv_proj.weight"]
    if w.shape[0] != (2 * n_q + 2 * n_kv) * d:
        raise DistloadError(f"{prefix}qkv_proj.weight has {w.shape[0]} rows; tp={tp_size} expects ({n_q} q heads x "
                            f"[q, gate] + 2 * {n_kv} kv heads) * head_dim {d} = {(2 * n_q + 2 * n_kv) * d}")
    bias = params.get(prefix + "qkv_proj.bias")
    qg, k, v = F.linear(x, w.to(x.dtype), None if bias is None else bias.to(x.dtype)).split(
        [2 * n_q * d, n_kv * d, n_kv * d], dim=-1)
    q, gate = qg.view(T, n_q, 2 * d).chunk(2, dim=-1)
    q = offset_rms_norm(q, params[prefix + "q_norm.weight"], eps).transpose(0, 1)
    k = offset_rms_norm(k.view(T, n_kv, d), params[prefix + "k_norm.weight"], eps).transpose(0, 1)
    v = v.view(T, n_kv, d).transpose(0, 1)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    k, v = k.repeat_interleave(n_q // n_kv, dim=0), v.repeat_interleave(n_q // n_kv, dim=0)
    out = masked_softmax_attention(q, k, v, mask, d ** -0.5) * torch.sigmoid(gate.reshape(T, n_q * d))
    return all_reduce_sum(F.linear(out, params[prefix + "o_proj.weight"].to(x.dtype)).contiguous(), group)


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor,
                     beta: torch.Tensor) -> torch.Tensor:
    """The gated delta rule over `[T, heads, d]` inputs (q, k by key head, v by value head; decay, beta
    `[T, value heads]`), in float32, one token at a time; returns `[T, value heads, d_v]` in v's dtype."""
    per_key = v.shape[1] // k.shape[1]  # each key head serves this many consecutive value heads
    q, k = (l2_normalize(t.repeat_interleave(per_key, dim=1).float()) for t in (q, k))
    q = q / (q.shape[-1] ** 0.5)
    values, decay, beta = v.float(), decay.float(), beta.float()
    state = torch.zeros(v.shape[1], k.shape[-1], v.shape[-1], dtype=torch.float32, device=v.device)
    out = []
    for t in range(v.shape[0]):
        state = state * decay[t].exp()[:, None, None]
        remembered = (state * k[t][:, :, None]).sum(dim=-2)
        delta = (values[t] - remembered) * beta[t][:, None]
        state = state + k[t][:, :, None] * delta[:, None, :]
        out.append((state * q[t][:, :, None]).sum(dim=-2))
    return torch.stack(out).to(v.dtype)


def linear_attention(params: dict, prefix: str, x: torch.Tensor, config: dict, tp_size: int,
                     group=None) -> torch.Tensor:
    """Gated DeltaNet over this rank's key-head groups, row-parallel out_proj + all-reduce."""
    n_k, n_v = config["linear_num_key_heads"], config["linear_num_value_heads"]
    if n_k % tp_size:
        raise DistloadError(f"linear_num_key_heads={n_k}, tp={tp_size}: tp must divide the key heads (in_proj_qkvz "
                            "holds whole key-head groups)")
    n_k, n_v = n_k // tp_size, n_v // tp_size
    d_k, d_v, per_key = config["linear_key_head_dim"], config["linear_value_head_dim"], n_v // n_k
    T = x.shape[0]
    qkvz = F.linear(x, params[prefix + "in_proj_qkvz.weight"].to(x.dtype)).view(T, n_k, -1)
    q, k, v, z = qkvz.split([d_k, d_k, per_key * d_v, per_key * d_v], dim=-1)
    b, a = F.linear(x, params[prefix + "in_proj_ba.weight"].to(x.dtype)).view(T, n_k, -1).split(per_key, dim=-1)
    mixed = torch.cat([q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)], dim=-1)
    conv = params[prefix + "conv1d.weight"].to(x.dtype)  # [channels, 1, kernel], one filter per channel
    mixed = F.silu(F.conv1d(mixed.t()[None], conv, padding=conv.shape[-1] - 1, groups=conv.shape[0])[0, :, :T]).t()
    q, k, v = mixed.split([n_k * d_k, n_k * d_k, n_v * d_v], dim=-1)
    a, b = a.reshape(T, n_v), b.reshape(T, n_v)
    decay = -params[prefix + "A_log"].float().exp() * F.softplus(a.float() + params[prefix + "dt_bias"].float())
    core = gated_delta_rule(q.view(T, n_k, d_k), k.view(T, n_k, d_k), v.view(T, n_v, d_v), decay, b.sigmoid())
    core = gated_rms_norm(core, z.reshape(T, n_v, d_v), params[prefix + "norm.weight"], config["rms_norm_eps"])
    return all_reduce_sum(F.linear(core.reshape(T, n_v * d_v), params[prefix + "out_proj.weight"].to(x.dtype))
                          .contiguous(), group)


def forward(params: dict[str, torch.Tensor], config: dict, input_ids: torch.Tensor, *, tp_rank: int, tp_size: int,
            local_expert_ids: list[int] | None = None, ep_size: int = 1, dtype=torch.float32,
            group=None) -> torch.Tensor:
    """Qwen3-Next logits float32 `[T, vocab_size]`, identical on every rank (arguments as forward.forward)."""
    check_silu(config)
    device = params["model.embed_tokens.weight"].device
    T = input_ids.shape[0]
    _, _, head_dim = local_heads(config, tp_size)
    cos, sin = rope_cos_sin(config, head_dim, T, device, dtype)
    mask = causal_mask(T, None, device)
    layers = range(config["num_hidden_layers"])
    moe = None
    if any(is_sparse(config, FAMILY, i) for i in layers):
        ids, counted = expert_placement(local_expert_ids, config["num_experts"], tp_rank=tp_rank, tp_size=tp_size,
                                        ep_size=ep_size, device=device, group=group)
        moe = dict(local_expert_ids=ids, counted=counted, top_k=config["num_experts_per_tok"],
                   norm_topk=bool(config.get("norm_topk_prob", True)), shared_expert=True)

    def attention(i: int, h: torch.Tensor) -> torch.Tensor:
        if config["layer_types"][i] == "linear_attention":
            return linear_attention(params, f"model.layers.{i}.linear_attn.", h, config, tp_size, group)
        return gated_attention(params, f"model.layers.{i}.self_attn.", h, config, tp_size, cos, sin, mask, group)

    def mlp(i: int, h: torch.Tensor) -> torch.Tensor:
        if is_sparse(config, FAMILY, i):
            return all_reduce_sum(sparse_moe(params, f"model.layers.{i}.mlp.", h, **moe).contiguous(), group)
        return dense_mlp(params, f"model.layers.{i}.mlp.", h, group)

    return decoder_logits(params, config, input_ids, tp_rank=tp_rank, dtype=dtype, group=group, attention=attention,
                          mlp=mlp, norm=offset_rms_norm)
