"""How each architecture differs from Llama, as data: one `Family` row per model_type (gpt-fast tp.py style).

The reference forward (forward.py) runs one decoder loop for every row; a row says where the serving params
live (`Names`, the layout configs/<family>.toml delivers), which norm and activation the blocks use, where the
norms sit around attention and MLP, and which scalars of config.json scale embeddings, scores and logits.
A flag is a constant or (config key, default when absent).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from distload.errors import DistloadError

Flag = bool | tuple[str, bool]


@dataclass(frozen=True)
class Names:
    """Serving param names (DESIGN §4.2); `layer` takes the layer index. A norm name is its prefix (weight,
    bias under it); a norm slot that is None is not there (OLMo2 has no pre-attention norm)."""

    embed: str = "model.embed_tokens.weight"
    positions: str | None = None             # learned position embeddings (GPT-2's wpe); None: RoPE
    final_norm: str = "model.norm"
    lm_head: str = "lm_head.weight"
    layer: str = "model.layers.{}."
    attn: str = "self_attn."
    qkv: str = "qkv_proj"
    o: str = "o_proj"
    mlp: str = "mlp."
    mlp_in: str = "gate_up_proj"             # gated: cat[gate_r, up_r]; plain: the up projection
    mlp_out: str = "down_proj"
    pre_attn_norm: str | None = "input_layernorm"
    post_attn_norm: str | None = None        # on the attention output, before the residual add (Gemma, OLMo2)
    pre_mlp_norm: str | None = "post_attention_layernorm"
    post_mlp_norm: str | None = None


GPT_NAMES = Names(embed="transformer.wte.weight", positions="transformer.wpe.weight", final_norm="transformer.ln_f",
                  layer="transformer.h.{}.", attn="attn.", qkv="c_attn", o="c_proj", mlp_in="c_fc", mlp_out="c_proj",
                  pre_attn_norm="ln_1", pre_mlp_norm="ln_2")
# GPTBigCode as vLLM 0.32's Transformers backend names it (configs/gpt_bigcode.toml): `transformer.` as `model.`.
BIGCODE_NAMES = Names(embed="model.wte.weight", positions="model.wpe.weight", final_norm="model.ln_f",
                      layer="model.h.{}.", attn="attn.", qkv="c_attn", o="c_proj", mlp_in="c_fc", mlp_out="c_proj",
                      pre_attn_norm="ln_1", pre_mlp_norm="ln_2")
SANDWICH_NAMES = Names(post_attn_norm="post_attention_layernorm", pre_mlp_norm="pre_feedforward_layernorm",
                       post_mlp_norm="post_feedforward_layernorm")
INTERNLM2_NAMES = Names(embed="model.tok_embeddings.weight", lm_head="output.weight", attn="attention.", qkv="wqkv",
                        o="wo", mlp="feed_forward.", mlp_out="w2", pre_attn_norm="attention_norm",
                        pre_mlp_norm="ffn_norm")
# GPT-2's config.json keys for the dims every forward reads.
GPT_KEYS = (("hidden_size", "n_embd"), ("num_attention_heads", "n_head"), ("num_hidden_layers", "n_layer"),
            ("num_key_value_heads", "n_head"))


@dataclass(frozen=True)
class Family:
    """How one architecture differs from Llama."""

    architecture: str
    names: Names = field(default_factory=Names)
    norm: str = "rms"                        # blocks.NORMS: rms, rms_f32, rms_unit_offset, layer, layer_no_bias
    eps_key: str = "rms_norm_eps"
    act_key: str = "hidden_act"              # config key naming the activation (blocks.ACTIVATIONS)
    gated_mlp: bool = True                   # down(act(gate) * up); else c_proj(act(c_fc))
    qkv_bias: Flag = False
    o_bias: Flag = False                     # row-parallel biases are whole on every rank, added once
    mlp_bias: Flag = False
    mlp_whole: bool = False                  # the MLP whole on every rank, not split (GPTBigCode in vLLM 0.32)
    qk_norm: Flag = False                    # a norm over q and k before RoPE ...
    qk_norm_over: str = "head"               # ... each head ("head") or the whole projection (OLMo2)
    parallel_block: bool = False             # Cohere: x + attn(norm(x)) + mlp(norm(x))
    rope_interleaved: bool = False           # Cohere: rotate pairs (2i, 2i+1), not halves
    scaled_embedding: bool = False           # Gemma: embeddings times sqrt(hidden_size)
    attn_scale: tuple[str, float] | None = None  # scores times config[key] ** power (default head_dim ** -0.5)
    softcap: bool = False                    # Gemma 2: attn_logit_softcapping / final_logit_softcapping
    multipliers: bool = False                # Granite: embedding/residual/attention multipliers, logits_scaling
    logit_scale: bool = False                # Cohere: logits times logit_scale
    config_keys: tuple[tuple[str, str], ...] = ()  # standard key <- this family's key (GPT-2's n_embd, ...)
    multi_query: bool = False                # GPTBigCode: one kv head when config multi_query
    moe_prefix: str | None = None            # where a sparse layer's MoE block lives, after the layer prefix
    norm_topk: Flag = False                  # renormalise the top-k router weights to sum to 1
    shared_expert: bool = False              # Qwen2-MoE: a sigmoid-gated dense expert next to the routed ones
    rope_aliases: tuple[tuple[str, str], ...] = ()  # legacy rope type names


_GPT = dict(names=GPT_NAMES, norm="layer", eps_key="layer_norm_epsilon", act_key="activation_function",
            gated_mlp=False, qkv_bias=True, o_bias=True, mlp_bias=True, config_keys=GPT_KEYS)
_GEMMA = dict(names=SANDWICH_NAMES, norm="rms_unit_offset", act_key="hidden_activation", scaled_embedding=True,
              attn_scale=("query_pre_attn_scalar", -0.5), softcap=True)

# model_type -> Family: the one place that knows architectures.
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
    "gpt2": Family("GPT2LMHeadModel", **_GPT),
    "gpt_bigcode": Family("GPTBigCodeForCausalLM", **{**_GPT, "names": BIGCODE_NAMES}, multi_query=True, mlp_whole=True),
    "starcoder2": Family("Starcoder2ForCausalLM", names=Names(mlp_in="c_fc", mlp_out="c_proj"), norm="layer",
                         eps_key="norm_epsilon", gated_mlp=False, qkv_bias=("use_bias", True),
                         o_bias=("use_bias", True), mlp_bias=("use_bias", True)),
    "gemma2": Family("Gemma2ForCausalLM", **_GEMMA),
    "gemma3_text": Family("Gemma3ForCausalLM", **_GEMMA, qk_norm=True),
    "olmo2": Family("Olmo2ForCausalLM", names=Names(pre_attn_norm=None, post_attn_norm="post_attention_layernorm",
                                                    pre_mlp_norm=None, post_mlp_norm="post_feedforward_layernorm"),
                    norm="rms_f32", qk_norm=True, qk_norm_over="projection"),
    "cohere": Family("CohereForCausalLM", names=Names(pre_mlp_norm=None), norm="layer_no_bias",
                     eps_key="layer_norm_eps", qk_norm=("use_qk_norm", False), parallel_block=True,
                     rope_interleaved=True, logit_scale=True),
    "granite": Family("GraniteForCausalLM", multipliers=True),
    "internlm2": Family("InternLM2ForCausalLM", names=INTERNLM2_NAMES, qkv_bias=("bias", False),
                        o_bias=("bias", False)),
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


def flag(config: dict, value: Flag) -> bool:
    """A Family flag's value for this config.json."""
    return value if isinstance(value, bool) else bool(config.get(value[0], value[1]))


def standard_config(config: dict, family: Family) -> dict:
    """config.json with the standard dim keys filled from the family's own (GPT-2's n_embd -> hidden_size)."""
    out = dict(config)
    for standard, own in family.config_keys:
        out[standard] = config[own]
    if family.multi_query:
        if not config.get("multi_query", True):
            raise DistloadError("gpt_bigcode with multi_query=false packs c_attn per head; the reference forward (like "
                                "vLLM) runs multi-query checkpoints only")
        out["num_key_value_heads"] = 1
    return out
