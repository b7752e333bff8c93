"""The checkpoints of tests/hf_models.py as metadata only: what the pure plan tests plan, without transformers.

decoder_config(family) is the config.json that hf_models' `family` model saves, as far as the rules and
tests/layout_oracle.py read it; decoder_shapes(config) its tensors in transformers' state_dict order;
sharded_entries(shapes) the TensorEntry of each, in the files save_pretrained(max_shard_size="100KB")
writes. test_plan.py's test_metadata_checkpoints_are_what_transformers_saves holds them to the real thing.
"""

from __future__ import annotations

import math

from distload.checkpoint.header import TensorEntry
from distload.dtypes import itemsize
from hf_models import COMMON, FAMILIES

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM"}
SHARD_BYTES = 100_000            # hf_models.save_checkpoint's max_shard_size "100KB"


def decoder_config(family: str, **overrides) -> dict:
    """config.json of hf_models' `family` model, as far as the rules and the oracle read it."""
    kw = {**COMMON, **FAMILIES[family], **overrides}
    kw.setdefault("head_dim", kw["hidden_size"] // kw["num_attention_heads"])
    kw.setdefault("tie_word_embeddings", False)
    return {**kw, "architectures": [ARCHITECTURES[kw["model_type"]]]}


def decoder_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """The tensors transformers saves for a Llama-shaped `config`, in its state_dict order."""
    h, i, d = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q, kv, kind = config["num_attention_heads"] * d, config["num_key_value_heads"] * d, config["model_type"]
    shapes = {"model.embed_tokens.weight": (config["vocab_size"], h)}
    for n in range(config["num_hidden_layers"]):
        a = f"model.layers.{n}."
        if kind == "phi3":  # Phi-3's attention declares o_proj first
            shapes.update({a + "self_attn.o_proj.weight": (h, q), a + "self_attn.qkv_proj.weight": (q + 2 * kv, h)})
        else:
            shapes.update({a + f"self_attn.{x}_proj.weight": (rows, h) for x, rows in zip("qkv", (q, kv, kv))})
        if kind == "qwen2":
            shapes.update({a + f"self_attn.{x}_proj.bias": (rows,) for x, rows in zip("qkv", (q, kv, kv))})
        shapes[a + "self_attn.o_proj.weight"] = (h, q)
        if kind == "qwen3":
            shapes.update({a + "self_attn.q_norm.weight": (d,), a + "self_attn.k_norm.weight": (d,)})
        if kind == "phi3":
            shapes[a + "mlp.gate_up_proj.weight"] = (2 * i, h)
        else:
            shapes.update({a + "mlp.gate_proj.weight": (i, h), a + "mlp.up_proj.weight": (i, h)})
        shapes[a + "mlp.down_proj.weight"] = (h, i)
        shapes.update({a + "input_layernorm.weight": (h,), a + "post_attention_layernorm.weight": (h,)})
    shapes["model.norm.weight"] = (h,)
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (config["vocab_size"], h)
    return shapes


def sharded_entries(shapes: dict[str, tuple[int, ...]], dtype: str = "F32") -> dict[str, TensorEntry]:
    """Entries laid out as save_pretrained shards them: files filled in order up to SHARD_BYTES."""
    files, size = [[]], 0
    for name, shape in shapes.items():
        nbytes = math.prod(shape) * itemsize(dtype)
        if files[-1] and size + nbytes > SHARD_BYTES:
            files.append([])
            size = 0
        files[-1].append(name)
        size += nbytes
    return laid_out({name: (f"model-{k + 1:05d}-of-{len(files):05d}.safetensors", dtype, shapes[name])
                     for k, members in enumerate(files) for name in members})


def laid_out(tensors: dict[str, tuple[str, str, tuple[int, ...]]]) -> dict[str, TensorEntry]:
    """Entries of tensors {name: (file, dtype, shape)}, each file's tensors by name (as safetensors writes them)."""
    out, at = {}, {}
    for name in sorted(tensors):
        file, dtype, shape = tensors[name]
        nbytes = math.prod(shape) * itemsize(dtype)
        out[name] = TensorEntry(name, file, dtype, tuple(shape), at.get(file, 8), nbytes)
        at[file] = at.get(file, 8) + nbytes
    return out


def one_file_entries(shapes: dict[str, tuple[int, ...]], dtype: str = "F32") -> dict[str, TensorEntry]:
    """Entries of tensors {name: shape} in one model.safetensors, laid out in the given order."""
    out, at = {}, 8
    for name, shape in shapes.items():
        nbytes = math.prod(shape) * itemsize(dtype)
        out[name] = TensorEntry(name, "model.safetensors", dtype, tuple(shape), at, nbytes)
        at += nbytes
    return out
