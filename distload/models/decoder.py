"""The decoder skeleton the family forwards of distload.models share (DeepSeek, GPT-OSS, GLM-4.5-MoE).

A family supplies only what differs, its attention and its MLP / MoE block; the skeleton does what every
pre-norm decoder does the same way as forward.forward: the vocab-parallel embedding, `x + attn(norm(x))` and
`x + mlp(norm(x))` per layer, the final norm and the vocab-parallel lm_head gathered over the group.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from distload.errors import DistloadError
from distload.models.forward import causal_mask, embed, rms_norm
from distload.transfer import all_gather_cat

FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)
# (layer index, normed hidden [T, H]) -> this block's output [T, H], already reduced over the group
Block = Callable[[int, torch.Tensor], torch.Tensor]


def check_silu(config: dict) -> None:
    """The families here gate their MLPs with SiLU; refuse another activation rather than return wrong logits."""
    if config.get("hidden_act", "silu") != "silu":
        raise DistloadError(f"hidden_act={config['hidden_act']!r}: the reference forward implements SwiGLU (silu) only")


def check_unquantized(params: dict[str, torch.Tensor]) -> None:
    """Quantized weights (block FP8 with weight_scale_inv, other scales) would be used as plain numbers: refuse."""
    scaled = sorted(name for name, t in params.items()
                    if name.endswith(("weight_scale_inv", "weight_scale")) or t.dtype in FLOAT8)
    if scaled:
        raise DistloadError(f"{scaled[0]} (and {len(scaled) - 1} more): the loaded weights are quantized; the reference "
                            "forward computes with unquantized (bf16 / fp32) weights only: verify the checkpoint "
                            "before quantization")


def decoder_logits(params: dict[str, torch.Tensor], config: dict, input_ids: torch.Tensor, *, tp_rank: int, dtype,
                   group, attention: Block, mlp: Block, embed_name: str = "model.embed_tokens.weight",
                   norm=rms_norm) -> torch.Tensor:
    """Logits float32 `[T, vocab_size]`, identical on every rank of `group` (collective).
    norm(x, weight, eps): the decoder's RMSNorm (Qwen3-Next scales by 1 + weight)."""
    check_unquantized(params)
    eps = config["rms_norm_eps"]
    embed_weight = params[embed_name]
    x = embed(embed_weight, input_ids.to(embed_weight.device), tp_rank, dtype, group)
    for i in range(config["num_hidden_layers"]):
        layer = f"model.layers.{i}."
        x = x + attention(i, norm(x, params[layer + "input_layernorm.weight"], eps))
        x = x + mlp(i, norm(x, params[layer + "post_attention_layernorm.weight"], eps))
    x = norm(x, params["model.norm.weight"], eps)
    # Tied: lm_head is the embedding (a loader may alias it or leave it out).
    lm_head = (params.get("lm_head.weight", embed_weight) if config.get("tie_word_embeddings")
               else params["lm_head.weight"])
    logits = all_gather_cat(F.linear(x, lm_head.to(dtype)).float().contiguous(), dim=1, group=group)
    return logits[:, : config["vocab_size"]]  # drop the zero rows that pad the vocab to a multiple of lcm(64, tp)


def masked_softmax_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scaling: float,
                             sinks: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q k^T * scaling) v over `[heads, T, d]` (k, v with as many heads as q), as `[T, heads * d_v]`.

    sinks `[heads]` (GPT-OSS): one extra logit per head that takes a share of the softmax and no value, as
    transformers' eager attention computes it (max-subtracted, then dropped).
    """
    scores = (q @ k.transpose(-1, -2)) * scaling
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    else:
        heads, tokens = q.shape[0], q.shape[1]
        combined = torch.cat([scores, sinks.to(scores.dtype).view(heads, 1, 1).expand(heads, tokens, 1)], dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        probs = torch.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1].to(v.dtype)
    return (probs @ v).transpose(0, 1).reshape(q.shape[1], -1)


def masks_by_window(seq_len: int, windows: list[int | None], device) -> list[torch.Tensor]:
    """One causal mask per layer, built once per distinct window."""
    built: dict[int | None, torch.Tensor] = {}
    for window in windows:
        if window not in built:
            built[window] = causal_mask(seq_len, window, device)
    return [built[w] for w in windows]
