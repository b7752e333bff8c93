"""The pieces of the reference forward's decoder block, over one rank's serving-layout shards.

Each piece mirrors the transformers module it stands for (float32 where transformers upcasts, same operation
order), so a mismatch in verify points at the weights. Collectives go through distload.transfer only: one
all-reduce after each row-parallel layer, and after the vocab-parallel embedding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from distload.errors import DistloadError
from distload.models.family import FAMILIES, Family, flag
from distload.models.rope import apply_rope
from distload.transfer import all_reduce_sum


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in float32, then back to x's dtype before the weight (Llama)."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight.to(x.dtype) * x32.to(x.dtype)


def rms_norm_f32(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm with the weight applied in float32 (OLMo2)."""
    x32 = x.float()
    return (weight.float() * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps))).to(x.dtype)


def rms_norm_unit_offset(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm: the stored weight is an offset from 1."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.float())).to(x.dtype)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, bias: torch.Tensor | None = None) -> torch.Tensor:
    """LayerNorm over the last dim in float32; the weight may carry a leading head dim (Cohere's q/k norms)."""
    x32 = x.float()
    mean = x32.mean(-1, keepdim=True)
    x32 = (x32 - mean) * torch.rsqrt((x32 - mean).pow(2).mean(-1, keepdim=True) + eps)
    out = weight.float() * x32
    return (out + bias.float() if bias is not None else out).to(x.dtype)


# norm kind -> (function, has a bias param)
NORMS = {"rms": (rms_norm, False), "rms_f32": (rms_norm_f32, False), "rms_unit_offset": (rms_norm_unit_offset, False),
         "layer": (layer_norm, True), "layer_no_bias": (layer_norm, False)}

# config activation name -> function (the tanh GELUs of transformers' ACT2FN are one formula)
ACTIVATIONS = {"silu": F.silu, "swish": F.silu, "relu": F.relu, "gelu": F.gelu,
               "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
               "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
               "gelu_fast": lambda x: F.gelu(x, approximate="tanh")}


def norm(kind: str, x: torch.Tensor, params: dict, name: str, eps: float) -> torch.Tensor:
    """Apply the norm whose params live under `name` (name.weight, and name.bias for biased kinds)."""
    fn, biased = NORMS[kind]
    if biased:
        return fn(x, params[name + ".weight"], eps, params[name + ".bias"])
    return fn(x, params[name + ".weight"], eps)


def activation(config: dict, family: Family):
    name = config.get(family.act_key, "silu")
    if name not in ACTIVATIONS:
        raise DistloadError(f"{family.act_key}={name!r} is not supported by the reference forward "
                            f"(supported: {', '.join(sorted(ACTIVATIONS))})")
    return ACTIVATIONS[name]


def local_heads(config: dict, tp_size: int) -> tuple[int, int, int]:
    """(q heads, kv heads, head_dim) on one rank. kv heads: Hkv/tp, or one replicated head when tp > Hkv."""
    n_heads = config["num_attention_heads"]
    n_kv = config.get("num_key_value_heads") or n_heads
    head_dim = config.get("head_dim") or config["hidden_size"] // n_heads
    if n_heads % tp_size or (n_kv % tp_size if tp_size <= n_kv else tp_size % n_kv):
        raise DistloadError(f"num_attention_heads={n_heads}, num_key_value_heads={n_kv}, tp={tp_size}: tp must "
                            "divide the heads, and divide the kv heads or be a multiple of them")
    return n_heads // tp_size, max(n_kv // tp_size, 1), head_dim


def sliding_window(config: dict, layer: int) -> int | None:
    """The layer's attention window, as transformers decides it: `layer_types` names the sliding layers
    where present (Qwen2/3, Gemma); otherwise one window for every layer (Mistral, Mixtral, Phi-3), off when
    sliding_window is null or use_sliding_window is false."""
    if config.get("layer_types"):
        return config.get("sliding_window") if config["layer_types"][layer] == "sliding_attention" else None
    return config.get("sliding_window") if config.get("use_sliding_window", True) else None


def embed(weight: torch.Tensor, ids: torch.Tensor, tp_rank: int, dtype, group=None) -> torch.Tensor:
    """Vocab-parallel lookup: a rank holds rows [r*n, (r+1)*n); it looks up the ids it owns, zeros the
    others, and the sum over ranks is the full lookup."""
    rows = weight.shape[0]
    local = ids - tp_rank * rows
    mine = (local >= 0) & (local < rows)
    x = weight[local.clamp(0, rows - 1)].to(dtype) * mine[:, None].to(dtype)
    return all_reduce_sum(x.contiguous(), group)


def causal_mask(seq_len: int, window: int | None, device) -> torch.Tensor:
    """True where query i may attend key j: j <= i, and i - j < window for sliding layers."""
    i = torch.arange(seq_len, device=device)[:, None]
    j = torch.arange(seq_len, device=device)[None, :]
    return (j <= i) & (j > i - window) if window is not None else j <= i


def row_parallel(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, group=None) -> torch.Tensor:
    """A row-parallel linear: partial products summed over the group, the (whole) bias added once."""
    out = all_reduce_sum(F.linear(x, weight.to(x.dtype)).contiguous(), group)
    return out + bias.to(x.dtype) if bias is not None else out


def projection_rms(x: torch.Tensor, weight: torch.Tensor, eps: float, width: int, replicas: int,
                   group=None) -> torch.Tensor:
    """OLMo2's RMSNorm over a whole q or k projection `[T, width]` of which this rank holds a slice: the sum of
    squares is summed over the group (each kv head counted `replicas` times when tp > kv heads)."""
    x32 = x.float()
    squares = all_reduce_sum(x32.pow(2).sum(-1, keepdim=True).contiguous(), group)
    x32 = x32 * torch.rsqrt(squares / (width * replicas) + eps)
    return (weight.float() * x32).to(x.dtype)


def rank_projection_norms(params: dict, config: dict, family: Family, tp_rank: int, tp_size: int) -> dict:
    """params with OLMo 2's whole q/k norms (served whole, as vLLM keeps them: it gathers q and k before the norm)
    cut to this rank's heads: the forward normalises its own heads against the squares summed over the group."""
    if family.qk_norm_over != "projection" or tp_size == 1:
        return params
    n_q, n_kv_local, d = local_heads(config, tp_size)
    n_kv = config.get("num_key_value_heads") or config["num_attention_heads"]
    first_kv = tp_rank * n_kv_local if tp_size <= n_kv else tp_rank // (tp_size // n_kv)
    out = dict(params)
    for name, t in params.items():
        if name.endswith("self_attn.q_norm.weight") and t.numel() == n_q * d * tp_size:
            out[name] = t[tp_rank * n_q * d:(tp_rank + 1) * n_q * d]
        elif name.endswith("self_attn.k_norm.weight") and t.numel() == n_kv * d:
            out[name] = t[first_kv * d:(first_kv + n_kv_local) * d]
    return out


def _qk_norms(params: dict, prefix: str, q: torch.Tensor, k: torch.Tensor, config: dict, family: Family,
              tp_size: int, group) -> tuple[torch.Tensor, torch.Tensor]:
    """q `[T, n_q, d]`, k `[T, n_kv, d]` after the family's q/k norm (per head, or over the projection)."""
    eps = config[family.eps_key]
    if family.qk_norm_over == "head":
        return (norm(family.norm, q, params, prefix + "q_norm", eps),
                norm(family.norm, k, params, prefix + "k_norm", eps))
    n_heads = config["num_attention_heads"]
    n_kv = config.get("num_key_value_heads") or n_heads
    T, _, d = q.shape
    q = projection_rms(q.reshape(T, -1), params[prefix + "q_norm.weight"], eps, n_heads * d, 1, group)
    k = projection_rms(k.reshape(T, -1), params[prefix + "k_norm.weight"], eps, n_kv * d, max(tp_size // n_kv, 1),
                       group)
    return q.view(T, -1, d), k.view(T, -1, d)


def attention(params: dict, prefix: str, x: torch.Tensor, config: dict, family: Family, tp_size: int,
              cos: torch.Tensor | None, sin: torch.Tensor | None, mask: torch.Tensor, group=None) -> torch.Tensor:
    """Column-parallel qkv (this rank's heads), local causal GQA, row-parallel o_proj + all-reduce.

    cos/sin None: no RoPE (learned positions). Collective over `group`."""
    names = family.names
    n_q, n_kv, d = local_heads(config, tp_size)
    T = x.shape[0]
    w = params[prefix + names.qkv + ".weight"]
    if w.shape[0] != (n_q + 2 * n_kv) * d:
        raise DistloadError(f"{prefix}{names.qkv}.weight has {w.shape[0]} rows; tp={tp_size} expects "
                            f"({n_q} q + 2 * {n_kv} kv heads) * head_dim {d} = {(n_q + 2 * n_kv) * d}")
    bias = params[prefix + names.qkv + ".bias"].to(x.dtype) if flag(config, family.qkv_bias) else None
    q, k, v = F.linear(x, w.to(x.dtype), bias).split([n_q * d, n_kv * d, n_kv * d], dim=-1)
    q, k, v = (t.view(T, -1, d) for t in (q, k, v))  # [T, heads, d]
    if flag(config, family.qk_norm):
        q, k = _qk_norms(params, prefix, q, k, config, family, tp_size, group)
    q, k, v = (t.transpose(0, 1) for t in (q, k, v))  # [heads, T, d]
    if cos is not None:
        q = apply_rope(q, cos, sin, interleaved=family.rope_interleaved)
        k = apply_rope(k, cos, sin, interleaved=family.rope_interleaved)
    # Local q heads are consecutive and share kv heads in order, so repeating each kv head n_q/n_kv times
    # lines them up (also when the single local kv head is a replica).
    k, v = k.repeat_interleave(n_q // n_kv, dim=0), v.repeat_interleave(n_q // n_kv, dim=0)
    scores = (q @ k.transpose(-1, -2)) * attention_scale(config, family, d)
    cap = config.get("attn_logit_softcapping") if family.softcap else None
    if cap:
        scores = torch.tanh(scores / cap) * cap
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    out = (probs @ v).transpose(0, 1).reshape(T, n_q * d)
    o_bias = params[prefix + names.o + ".bias"] if flag(config, family.o_bias) else None
    return row_parallel(out, params[prefix + names.o + ".weight"], o_bias, group)


def attention_scale(config: dict, family: Family, head_dim: int) -> float:
    """What the scores q.k are multiplied by before the softmax."""
    if family.multipliers:
        return config["attention_multiplier"]
    if family.attn_scale is not None:
        key, power = family.attn_scale
        return config[key] ** power
    return head_dim ** -0.5


def dense_mlp(params: dict, prefix: str, x: torch.Tensor, group=None, family: Family | None = None,
              config: dict | None = None) -> torch.Tensor:
    """Column-parallel up (merged gate_up when gated), row-parallel down + all-reduce (default: Llama's SwiGLU)."""
    family, config = family or FAMILIES["llama"], config or {}
    w_in, w_out = prefix + family.names.mlp_in, prefix + family.names.mlp_out
    biased = flag(config, family.mlp_bias)
    h = F.linear(x, params[w_in + ".weight"].to(x.dtype), params[w_in + ".bias"].to(x.dtype) if biased else None)
    act = activation(config, family)
    if family.gated_mlp:
        gate, up = h.chunk(2, dim=-1)
        h = act(gate) * up
    else:
        h = act(h)
    if family.mlp_whole:   # every rank computes the whole MLP: nothing to reduce
        return F.linear(h, params[w_out + ".weight"].to(h.dtype), params[w_out + ".bias"].to(h.dtype) if biased else None)
    return row_parallel(h, params[w_out + ".weight"], params[w_out + ".bias"] if biased else None, group)
