"""GLM-4.5 / GLM-4.6 MoE reference forward over the serving layout configs/glm4_moe.toml delivers.

Attention is the Llama-like one of forward.attention (qkv_proj with bias when attention_bias, per-head q/k
RMSNorm when use_qk_norm, partial rotary by partial_rotary_factor); the MLPs are DeepSeek's: dense layers
below first_k_dense_replace, then the sigmoid + correction-bias grouped router, routed experts under EP and
the shared experts (deepseek.moe_mlp).
"""

from __future__ import annotations

import torch

from distload.models.decoder import check_silu, decoder_logits
from distload.models.deepseek import moe_mlp
from distload.models.forward import Family, attention as gqa_attention, causal_mask, local_heads
from distload.models.rope import rope_cos_sin


def forward(params: dict[str, torch.Tensor], config: dict, input_ids: torch.Tensor, *, tp_rank: int, tp_size: int,
            local_expert_ids: list[int] | None = None, ep_size: int = 1, dtype=torch.float32,
            group=None) -> torch.Tensor:
    """GLM-4.5-MoE logits float32 `[T, vocab_size]`, identical on every rank (arguments as forward.forward)."""
    check_silu(config)
    family = Family("Glm4MoeForCausalLM", qkv_bias=("attention_bias", False), qk_norm=bool(config.get("use_qk_norm")))
    device = params["model.embed_tokens.weight"].device
    T = input_ids.shape[0]
    _, _, head_dim = local_heads(config, tp_size)
    cos, sin = rope_cos_sin(config, head_dim, T, device, dtype)
    mask = causal_mask(T, None, device)

    def attention(i: int, h: torch.Tensor) -> torch.Tensor:
        return gqa_attention(params, f"model.layers.{i}.self_attn.", h, config, family, tp_size, cos, sin, mask, group)

    mlp = moe_mlp(params, config, tp_rank=tp_rank, tp_size=tp_size, local_expert_ids=local_expert_ids,
                  ep_size=ep_size, device=device, group=group)
    return decoder_logits(params, config, input_ids, tp_rank=tp_rank, dtype=dtype, group=group, attention=attention,
                          mlp=mlp)
