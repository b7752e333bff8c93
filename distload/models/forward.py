"""Reference tensor-parallel forward over the serving layout (DESIGN §4.2), for verification.

A loaded shard set is right when this forward, run on every rank, gives transformers' logits. It is plain
eager torch (one sequence, no KV cache, no batching) and reads nothing but the local params and the
config.json dict. Collectives go through distload.transfer only: one all-reduce after each row-parallel
layer (o_proj, down_proj, the MoE block) and after the vocab-parallel embedding, one all-gather of the
logits. It runs unchanged on CPU/gloo and CUDA/NCCL: everything lives on the device of the params.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from distload.errors import DistloadError
from distload.models.moe import counted_experts, default_expert_ids, sparse_moe, swiglu
from distload.models.rope import apply_rope, rope_cos_sin
from distload.transfer import all_gather_cat, all_reduce_sum


@dataclass(frozen=True)
class Family:
    """How one architecture differs from Llama. A flag is a constant or (config key, default when absent)."""

    architecture: str
    qkv_bias: bool | tuple[str, bool] = False
    qk_norm: bool = False  # Qwen3: RMSNorm over each q and k head before RoPE
    moe_prefix: str | None = None  # where a sparse layer's MoE block lives, after "model.layers.{i}."
    norm_topk: bool | tuple[str, bool] = False  # renormalise the top-k router weights to sum to 1
    shared_expert: bool = False  # Qwen2-MoE: a sigmoid-gated dense expert next to the routed ones
    rope_aliases: tuple[tuple[str, str], ...] = ()  # legacy rope type names


# model_type -> Family: the one place that knows architectures (gpt-fast tp.py style: a row, not a class).
FAMILIES: dict[str, Family] = {
    "llama": Family("LlamaForCausalLM"),
    "mistral": Family("MistralForCausalLM"),
    "phi3": Family("Phi3ForCausalLM", rope_aliases=(("su", "longrope"), ("yarn", "longrope"))),
    "qwen2": Family("Qwen2ForCausalLM", qkv_bias=True),
    "qwen3": Family("Qwen3ForCausalLM", qk_norm=True),
    "mixtral": Family("MixtralForCausalLM", moe_prefix="block_sparse_moe.", norm_topk=True),
    "qwen2_moe": Family("Qwen2MoeForCausalLM", qkv_bias=("qkv_bias", True), moe_prefix="mlp.",
                        norm_topk=("norm_topk_prob", False), shared_expert=True),
    "qwen3_moe": Family("Qwen3MoeForCausalLM", qk_norm=True, moe_prefix="mlp.", norm_topk=("norm_topk_prob", False)),
}


def family_of(config: dict) -> Family:
    """The table row for this config.json: by model_type, else by its architectures entry."""
    if config.get("model_type") in FAMILIES:
        return FAMILIES[config["model_type"]]
    for family in FAMILIES.values():
        if family.architecture in (config.get("architectures") or ()):
            return family
    raise DistloadError(f"model_type {config.get('model_type')!r} / architectures {config.get('architectures')} "
                        f"is not supported by the reference forward (supported: {', '.join(sorted(FAMILIES))})")


def _flag(config: dict, flag: bool | tuple[str, bool]) -> bool:
    return flag if isinstance(flag, bool) else bool(config.get(flag[0], flag[1]))


def _check_supported(config: dict) -> None:
    """Config switches this forward does not implement: refuse rather than return wrong logits."""
    if config.get("hidden_act", "silu") != "silu":
        raise DistloadError(f"hidden_act={config['hidden_act']!r}: the reference forward implements SwiGLU (silu) only")
    for key in ("attention_bias", "mlp_bias"):  # Llama's switches: they add o_proj / MLP biases too
        if config.get(key):
            raise DistloadError(f"{key}=true is not supported by the reference forward")


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
    where present (Qwen2/3); otherwise one window for every layer (Mistral, Mixtral, Phi-3), off when
    sliding_window is null or use_sliding_window is false."""
    if config.get("layer_types"):
        return config.get("sliding_window") if config["layer_types"][layer] == "sliding_attention" else None
    return config.get("sliding_window") if config.get("use_sliding_window", True) else None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in float32, then back to x's dtype before the weight (as transformers)."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight.to(x.dtype) * x32.to(x.dtype)


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


def attention(params: dict, prefix: str, x: torch.Tensor, config: dict, family: Family, tp_size: int,
              cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor, group=None) -> torch.Tensor:
    """Column-parallel qkv (this rank's heads), local causal GQA, row-parallel o_proj + all-reduce."""
    n_q, n_kv, d = local_heads(config, tp_size)
    T = x.shape[0]
    w = params[prefix + "qkv_proj.weight"]
    if w.shape[0] != (n_q + 2 * n_kv) * d:
        raise DistloadError(f"{prefix}qkv_proj.weight has {w.shape[0]} rows; tp={tp_size} expects "
                            f"({n_q} q + 2 * {n_kv} kv heads) * head_dim {d} = {(n_q + 2 * n_kv) * d}")
    bias = params[prefix + "qkv_proj.bias"].to(x.dtype) if _flag(config, family.qkv_bias) else None
    q, k, v = F.linear(x, w.to(x.dtype), bias).split([n_q * d, n_kv * d, n_kv * d], dim=-1)
    q, k, v = (t.view(T, -1, d).transpose(0, 1) for t in (q, k, v))  # [heads, T, d]
    if family.qk_norm:
        q = rms_norm(q, params[prefix + "q_norm.weight"], config["rms_norm_eps"])
        k = rms_norm(k, params[prefix + "k_norm.weight"], config["rms_norm_eps"])
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    # Local q heads are consecutive and share kv heads in order, so repeating each kv head n_q/n_kv times
    # lines them up (also when the single local kv head is a replica).
    k, v = k.repeat_interleave(n_q // n_kv, dim=0), v.repeat_interleave(n_q // n_kv, dim=0)
    scores = (q @ k.transpose(-1, -2)) * (d ** -0.5)
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    out = (probs @ v).transpose(0, 1).reshape(T, n_q * d)
    return all_reduce_sum(F.linear(out, params[prefix + "o_proj.weight"].to(x.dtype)).contiguous(), group)


def dense_mlp(params: dict, prefix: str, x: torch.Tensor, group=None) -> torch.Tensor:
    """Merged column-parallel gate_up, row-parallel down + all-reduce."""
    partial = swiglu(x, params[prefix + "gate_up_proj.weight"], params[prefix + "down_proj.weight"])
    return all_reduce_sum(partial.contiguous(), group)


def is_sparse(config: dict, family: Family, layer: int) -> bool:
    """Sparse (MoE) layer? Qwen-MoE can keep dense layers: mlp_only_layers and decoder_sparse_step."""
    return (family.moe_prefix is not None and layer not in config.get("mlp_only_layers", ())
            and (layer + 1) % config.get("decoder_sparse_step", 1) == 0)


def forward(params: dict[str, torch.Tensor], config: dict, input_ids: torch.Tensor, *, tp_rank: int, tp_size: int,
            local_expert_ids: list[int] | None = None, ep_size: int = 1, dtype=torch.float32,
            group=None) -> torch.Tensor:
    """Logits float32 `[T, vocab_size]` of one sequence `input_ids [T]`, identical on every rank.

    params: this rank's serving-layout tensors (name -> local tensor); config: the config.json dict.
    tp_size is the size of `group` (default: the world); attention and dense MLPs are TP-split over all of
    it, MoE experts over `ep_size` groups of tp_size/ep_size ranks. local_expert_ids: the global ids this
    rank hosts, ascending, the same for every layer (default: the contiguous placement); an expert hosted
    by several groups (EPLB replica) is counted once, by the first group hosting it. Collective: every
    rank of the group must call it.
    """
    family = family_of(config)
    _check_supported(config)
    eps = config["rms_norm_eps"]
    embed_weight = params["model.embed_tokens.weight"]
    device = embed_weight.device
    ids = input_ids.to(device)
    T = ids.shape[0]

    x = embed(embed_weight, ids, tp_rank, dtype, group)
    _, _, head_dim = local_heads(config, tp_size)
    cos, sin = rope_cos_sin(config, head_dim, T, device, dtype, dict(family.rope_aliases))
    masks = {}  # window -> mask, built once per distinct window

    moe = None
    if any(is_sparse(config, family, i) for i in range(config["num_hidden_layers"])):
        n_experts = config.get("num_local_experts") or config["num_experts"]
        if local_expert_ids is None:
            local_expert_ids = default_expert_ids(n_experts, tp_rank, tp_size, ep_size)
        if list(local_expert_ids) != sorted(set(local_expert_ids)):
            raise DistloadError(f"local_expert_ids {local_expert_ids} must be ascending and distinct: "
                                "w13_weight/w2_weight hold the local experts in ascending global id")
        moe = dict(local_expert_ids=local_expert_ids, top_k=config["num_experts_per_tok"],
                   norm_topk=_flag(config, family.norm_topk), shared_expert=family.shared_expert,
                   counted=counted_experts(local_expert_ids, n_experts, tp_rank=tp_rank, tp_size=tp_size,
                                           ep_size=ep_size, device=device, group=group))

    for i in range(config["num_hidden_layers"]):
        layer = f"model.layers.{i}."
        window = sliding_window(config, i)
        if window not in masks:
            masks[window] = causal_mask(T, window, device)
        h = rms_norm(x, params[layer + "input_layernorm.weight"], eps)
        x = x + attention(params, layer + "self_attn.", h, config, family, tp_size, cos, sin, masks[window], group)
        h = rms_norm(x, params[layer + "post_attention_layernorm.weight"], eps)
        if is_sparse(config, family, i):
            # Routed experts and the shared expert are all partial sums: one all-reduce for the block.
            x = x + all_reduce_sum(sparse_moe(params, layer + family.moe_prefix, h, **moe).contiguous(), group)
        else:
            x = x + dense_mlp(params, layer + "mlp.", h, group)

    x = rms_norm(x, params["model.norm.weight"], eps)
    # Tied: lm_head is the embedding (a loader may alias it or leave it out).
    lm_head = (params.get("lm_head.weight", embed_weight) if config.get("tie_word_embeddings")
               else params["lm_head.weight"])
    logits = all_gather_cat(F.linear(x, lm_head.to(dtype)).float().contiguous(), dim=1, group=group)
    return logits[:, : config["vocab_size"]]  # drop the zero rows that pad the vocab to a multiple of lcm(64, tp)
