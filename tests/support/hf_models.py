"""Tiny random Hugging Face models, built offline from a config, saved as real multi-file checkpoints.

These are the reference for correctness: distload must lay out exactly what `transformers` saved.
Sizes are chosen so that tp 1, 2 and 4 divide every head / intermediate size and tp 3 does not.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=250, max_position_embeddings=256, pad_token_id=0,
              bos_token_id=1, eos_token_id=2)

FAMILIES: dict[str, dict] = {
    "llama": dict(model_type="llama"),  # GQA 4 q heads / 2 kv heads, untied
    "llama_mqa_tied": dict(model_type="llama", num_key_value_heads=1, tie_word_embeddings=True),
    "qwen2": dict(model_type="qwen2"),  # q/k/v bias
    "qwen3": dict(model_type="qwen3", head_dim=32),  # q_norm/k_norm, explicit head_dim != hidden/heads
    "mistral": dict(model_type="mistral"),
    "phi3": dict(model_type="phi3"),  # qkv_proj and gate_up_proj fused on disk
    "mixtral": dict(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(model_type="qwen2_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=64, decoder_sparse_step=1, mlp_only_layers=[]),
    "qwen3_moe": dict(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      head_dim=16, decoder_sparse_step=1, mlp_only_layers=[]),
}
DEEPSEEK_V3 = dict(model_type="deepseek_v3", num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1,
                   moe_intermediate_size=32, first_k_dense_replace=1, num_experts_per_tok=2, n_group=2, topk_group=1,
                   q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16)
# Families whose layout is shipped (configs/*.toml) and checked against layout_oracle.py; their reference
# forwards are tested in tests/test_verify_families.py / test_verify_moe_families.py, not with DENSE / MOE.
LAYOUT_FAMILIES: dict[str, dict] = {
    "gemma2": dict(model_type="gemma2", head_dim=16),
    "gemma3": dict(model_type="gemma3_text", head_dim=16),
    "olmo2": dict(model_type="olmo2"),  # q_norm / k_norm over the whole projection
    "olmo2_mqa": dict(model_type="olmo2", num_key_value_heads=1),  # k_norm replicated at tp > 1
    "granite": dict(model_type="granite"),
    "starcoder2": dict(model_type="starcoder2"),  # biases everywhere, c_fc / c_proj MLP, tied
    "cohere": dict(model_type="cohere"),  # no post_attention_layernorm, tied
    "cohere_qk_norm": dict(model_type="cohere", use_qk_norm=True),  # per-head q/k norms [heads, head_dim]
    "gpt2": dict(model_type="gpt2", num_key_value_heads=4),  # Conv1D weights stored [in, out]; learned positions
    "gpt_bigcode": dict(model_type="gpt_bigcode", multi_query=True, num_key_value_heads=1),  # c_attn with one kv head
    # GLM-4.5: dense layer 0, then 8 routed experts + 1 shared, sigmoid router with e_score_correction_bias
    "glm4_moe": dict(model_type="glm4_moe", n_routed_experts=8, n_shared_experts=1, moe_intermediate_size=32,
                     first_k_dense_replace=1, num_experts_per_tok=2, n_group=2, topk_group=1, head_dim=16,
                     use_qk_norm=True, attention_bias=True),
    # Qwen3-Next: a linear-attention layer then a gated full-attention one, each over an MoE block with a shared expert
    "qwen3_next": dict(model_type="qwen3_next", layer_types=["linear_attention", "full_attention"], num_experts=4,
                       num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64,
                       decoder_sparse_step=1, mlp_only_layers=[], head_dim=16, linear_num_key_heads=4,
                       linear_num_value_heads=8, linear_key_head_dim=16, linear_value_head_dim=8,
                       linear_conv_kernel_dim=4),
    # DeepSeek-V3: MLA (q_lora, kv_lora, rope/nope split), dense layer 0, 8 routed experts in 2 groups + 1 shared
    "deepseek_v3": DEEPSEEK_V3,
    "deepseek_v3_no_q_lora": {**DEEPSEEK_V3, "q_lora_rank": None},   # V2-Lite style: q_proj, kv_a replicated
    # DeepSeek-V2: V3's layout without the router's correction bias; softmax router, group-limited top-k
    "deepseek_v2": {**DEEPSEEK_V3, "model_type": "deepseek_v2", "topk_method": "group_limited_greedy"},
    # GPT-OSS (BF16 experts): stacked [E, H, 2I] interleaved gate/up, biases, sinks, a sliding and a full layer
    "gpt_oss": dict(model_type="gpt_oss", num_local_experts=4, num_experts_per_tok=2, head_dim=16,
                    layer_types=["sliding_attention", "full_attention"], sliding_window=8),
}
# The families of issue 38, in vLLM 0.32's layout (native model or its Transformers backend; served_layouts.py is
# their oracle). Falcon in its three attention layouts; Ernie with a dense layer after its MoE layers (the upper
# bound of its MoE layer range); Jamba with attention on odd layers and experts on even ones.
_FALCON = dict(model_type="falcon", parallel_attn=True, bias=False)
SERVED_FAMILIES: dict[str, dict] = {
    "llama4": dict(model_type="llama4_text", num_local_experts=4, num_experts_per_tok=1, intermediate_size=32,
                   intermediate_size_mlp=128, interleave_moe_layer_step=2, head_dim=16),
    "gpt_neox": dict(model_type="gpt_neox"),
    "bloom": dict(model_type="bloom", n_head=4, n_layer=2),
    "falcon": {**_FALCON, "new_decoder_architecture": True, "num_kv_heads": 2},           # Falcon-40B
    "falcon_mqa": {**_FALCON, "new_decoder_architecture": False, "multi_query": True},   # Falcon-7B
    "falcon_rw": {**_FALCON, "new_decoder_architecture": False, "multi_query": False, "parallel_attn": False,
                  "bias": True, "alibi": True},                                           # Falcon-RW
    "gptj": dict(model_type="gptj", n_embd=64, n_head=4, n_layer=2, rotary_dim=8),
    "phi": dict(model_type="phi"),
    "stablelm": dict(model_type="stablelm", use_qkv_bias=True),
    "olmoe": dict(model_type="olmoe", num_experts=4, num_experts_per_tok=2, intermediate_size=32),
    "phimoe": dict(model_type="phimoe", num_local_experts=4, num_experts_per_tok=2, attention_bias=True,
                   lm_head_bias=True),
    "granitemoe": dict(model_type="granitemoe", num_local_experts=4, num_experts_per_tok=2, intermediate_size=32),
    "granitemoeshared": dict(model_type="granitemoeshared", num_local_experts=4, num_experts_per_tok=2,
                             intermediate_size=32, shared_intermediate_size=64),
    "ernie4_5_moe": dict(model_type="ernie4_5_moe", num_hidden_layers=3, moe_num_experts=4, moe_k=2,
                         moe_intermediate_size=32, moe_num_shared_experts=1, moe_layer_start_index=1,
                         moe_layer_end_index=1),
    "exaone4": dict(model_type="exaone4"),
    "smollm3": dict(model_type="smollm3"),
    "jamba": dict(model_type="jamba", num_experts=4, num_experts_per_tok=2, attn_layer_period=2, attn_layer_offset=1,
                  expert_layer_period=2, expert_layer_offset=0, mamba_d_state=8, mamba_expand=2, mamba_dt_rank=8),
}
# config.json architectures as the released checkpoints name them (transformers saves its own class name).
SERVED_ARCHITECTURES = {"phimoe": "PhiMoEForCausalLM"}
DENSE = ["llama", "llama_mqa_tied", "qwen2", "qwen3", "mistral", "phi3"]
MOE = ["mixtral", "qwen2_moe", "qwen3_moe"]


def build_config(family: str, **overrides):
    from transformers import AutoConfig

    kw = {**COMMON, **(FAMILIES.get(family) or LAYOUT_FAMILIES.get(family) or SERVED_FAMILIES[family]), **overrides}
    model_type = kw.pop("model_type")
    return AutoConfig.for_model(model_type, **kw)


def build_model(family: str, seed: int = 0, **overrides):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(build_config(family, **overrides)).eval()
    # from_config leaves norms at 1.0 and biases at 0: randomise every param so a misplaced shard shows.
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.1 + (1.0 if p.dim() == 1 else 0.0))
    return model


def save_checkpoint(family: str, out_dir: str | Path, seed: int = 0, dtype=torch.float32,
                    max_shard_size: str = "100KB", **overrides) -> Path:
    """Build a tiny `family` model and save it (several .safetensors files + index). Returns the directory."""
    out = Path(out_dir)
    model = build_model(family, seed=seed, **overrides).to(dtype)
    model.save_pretrained(out, max_shard_size=max_shard_size)
    if family in SERVED_ARCHITECTURES:
        config = read_config(out)
        (out / "config.json").write_text(json.dumps({**config, "architectures": [SERVED_ARCHITECTURES[family]]}))
    return out


def checkpoint_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a saved checkpoint, read independently of distload (with `safetensors`)."""
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        out.update(load_file(f))
    return out


def read_config(path: str | Path) -> dict:
    return json.loads((Path(path) / "config.json").read_text())


def with_mtp_layer(src: str, out: Path) -> tuple[str, list[str]]:
    """A copy of a DeepSeek-style checkpoint with a multi-token-prediction layer `model.layers.{N}` appended in
    its own file (as GLM-4.5 and DeepSeek-V3 ship it), and the names added."""
    import shutil

    from safetensors.torch import save_file

    shutil.copytree(src, out)
    config = json.loads((out / "config.json").read_text())
    n, hidden = config["num_hidden_layers"], config["hidden_size"]
    extra = {f"model.layers.{n}.eh_proj.weight": torch.ones(hidden, 2 * hidden),
             f"model.layers.{n}.enorm.weight": torch.ones(hidden),
             f"model.layers.{n}.self_attn.q_proj.weight": torch.ones(hidden, hidden),
             f"model.layers.{n}.shared_head.norm.weight": torch.ones(hidden)}
    save_file(extra, out / "model-mtp.safetensors")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    index["weight_map"].update({name: "model-mtp.safetensors" for name in extra})
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    return str(out), sorted(extra)


def save_internlm2_checkpoint(out_dir: str | Path, seed: int = 0, **overrides) -> Path:
    """An InternLM2-layout checkpoint (transformers builds no InternLM2 offline: its checkpoints ship remote code):
    a tiny Llama's weights renamed as InternLM2 names them, q/k/v packed into wqkv per kv-head group (for each kv
    head its q heads, then k, then v), config.json as InternLM2's."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True)
    config = build_config("llama", **overrides)
    sd = build_model("llama", seed=seed, **overrides).state_dict()
    heads, kv, hidden = config.num_attention_heads, config.num_key_value_heads, config.hidden_size
    hd = hidden // heads
    tensors = {"model.tok_embeddings.weight": sd["model.embed_tokens.weight"], "output.weight": sd["lm_head.weight"],
               "model.norm.weight": sd["model.norm.weight"]}
    for i in range(config.num_hidden_layers):
        a, b = f"model.layers.{i}.", f"model.layers.{i}."
        q, k, v = (sd[a + f"self_attn.{x}_proj.weight"].reshape(-1, hd, hidden) for x in "qkv")
        groups = [torch.cat([q[g * (heads // kv):(g + 1) * (heads // kv)], k[g:g + 1], v[g:g + 1]]) for g in range(kv)]
        tensors[b + "attention.wqkv.weight"] = torch.cat(groups).reshape(-1, hidden)
        renames = {"self_attn.o_proj": "attention.wo", "mlp.gate_proj": "feed_forward.w1",
                   "mlp.up_proj": "feed_forward.w3", "mlp.down_proj": "feed_forward.w2",
                   "input_layernorm": "attention_norm", "post_attention_layernorm": "ffn_norm"}
        for old, new in renames.items():
            tensors[b + new + ".weight"] = sd[a + old + ".weight"]
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps({
        "architectures": ["InternLM2ForCausalLM"], "model_type": "internlm2", "hidden_size": hidden,
        "num_attention_heads": heads, "num_key_value_heads": kv, "num_hidden_layers": config.num_hidden_layers,
        "intermediate_size": config.intermediate_size, "vocab_size": config.vocab_size, "bias": False,
        "tie_word_embeddings": False, "rms_norm_eps": config.rms_norm_eps}))
    return out


def with_whole_mtp_layer(src: Path, out: Path) -> Path:
    """A copy of a DeepSeek-V3 checkpoint with num_nextn_predict_layers 1 and a whole MTP layer N (random values, the
    checkpoint's dtypes): the last decoder layer's tensors renamed to N, and the MTP-only tensors, in a file of their
    own."""
    from safetensors.torch import save_file

    shutil.copytree(src, out)
    config = json.loads((out / "config.json").read_text())
    n, hidden, vocab = config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]
    gen = torch.Generator().manual_seed(7)
    last, tensors = f"model.layers.{n - 1}.", checkpoint_tensors(src)
    extra = {f"model.layers.{n}." + name[len(last):]: torch.randn(t.shape, generator=gen).to(t.dtype)
             for name, t in tensors.items() if name.startswith(last)}
    shapes = {"enorm.weight": [hidden], "hnorm.weight": [hidden], "eh_proj.weight": [hidden, 2 * hidden],
              "shared_head.norm.weight": [hidden], "shared_head.head.weight": [vocab, hidden],
              "embed_tokens.weight": [vocab, hidden]}
    dtype = tensors["model.embed_tokens.weight"].dtype
    extra.update({f"model.layers.{n}.{k}": torch.randn(shape, generator=gen).to(dtype) for k, shape in shapes.items()})
    save_file(extra, out / "model-mtp.safetensors")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    index["weight_map"].update({name: "model-mtp.safetensors" for name in extra})
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    (out / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    return out


def save_sized_llama(out_dir: str | Path, hidden: int = 1024, layers: int = 8, vocab: int = 32000,
                     dtype=torch.bfloat16) -> Path:
    """A Llama checkpoint of real size without building the model (~0.4 GB at the defaults): transformers'
    names and shapes (from a model on the meta device), random values, two safetensors files and the index."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True)
    config = build_config("llama", hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                          num_attention_heads=16, num_key_value_heads=8, vocab_size=vocab)
    with torch.device("meta"):
        shapes = {n: p.shape for n, p in AutoModelForCausalLM.from_config(config).state_dict().items()}
    gen = torch.Generator().manual_seed(0)
    names = sorted(shapes)
    files = {name: f"model-0000{1 + i * 2 // len(names)}-of-00002.safetensors" for i, name in enumerate(names)}
    for file in sorted(set(files.values())):
        save_file({n: torch.randn(shapes[n], generator=gen).to(dtype) for n in names if files[n] == file},
                  str(out / file))
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": files}))
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(out)
    return out
