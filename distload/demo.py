"""`distload demo`: make a small Llama-shaped checkpoint (several safetensors files + index) and load it.

No download and no `transformers` needed: the checkpoint is written here with `safetensors`, laid out as
Hugging Face saves Llama, so the README's first command shows the whole pipeline on any machine.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

DEMO_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256, "intermediate_size": 768,
    "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 1000,
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 512, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "hidden_act": "silu",
}


def demo_tensors(cfg: dict = DEMO_CONFIG, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    d = h // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * d

    def w(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    out = {"model.embed_tokens.weight": w(v, h), "model.norm.weight": torch.ones(h, dtype=torch.bfloat16),
           "lm_head.weight": w(v, h)}
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        out.update({p + "input_layernorm.weight": 1 + w(h), p + "post_attention_layernorm.weight": 1 + w(h),
                    p + "self_attn.q_proj.weight": w(h, h), p + "self_attn.k_proj.weight": w(kv, h),
                    p + "self_attn.v_proj.weight": w(kv, h), p + "self_attn.o_proj.weight": w(h, h),
                    p + "mlp.gate_proj.weight": w(i, h), p + "mlp.up_proj.weight": w(i, h),
                    p + "mlp.down_proj.weight": w(h, i)})
    return out


def make_demo_checkpoint(path: str | Path, files: int = 3, seed: int = 0) -> Path:
    """Write the demo checkpoint as `files` safetensors shards + model.safetensors.index.json + config.json."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = demo_tensors(seed=seed)
    names = sorted(tensors)
    weight_map, per = {}, -(-len(names) // files)
    for k in range(files):
        fname = f"model-{k + 1:05d}-of-{files:05d}.safetensors"
        part = {n: tensors[n] for n in names[k * per:(k + 1) * per]}
        save_file(part, str(path / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    (path / "config.json").write_text(json.dumps(DEMO_CONFIG, indent=1))
    return path
