"""Test-side oracle for the families of issue 38: one rank's params as vLLM 0.32 lays them out (its model files, or
its Transformers backend's fused layers and tensor-parallel plans), sliced from a Hugging Face state dict.

Written plainly from vLLM's load_weights (bloom.py's _repack_qkv, falcon.py's per-kv-group narrow, llama4.py's
permute_qk_weight_for_rotary, jamba's A = -exp(A_log), ernie45_moe.py's squeeze, granitemoe's chunked
input_linear), independently of distload's rules and plan. One function per family, by config.json model_type;
layout_oracle.py's slicing where the layout is a family it already knows. MoE: ep groups of p / ep ranks, group k
hosting experts [k * n / ep, (k + 1) * n / ep), each expert cut g = p / ep ways inside its group.
"""

from __future__ import annotations

import torch

from layout_oracle import cols, kv_rows, rows, serving_shards as llama_like_shards, vocab_rows


def shards(hf: dict[str, torch.Tensor], config: dict, r: int, p: int, ep: int = 1) -> dict[str, torch.Tensor]:
    """Rank r's params (of tp p, ep ep), by vLLM's names; a tied lm_head is the embedding tensor itself."""
    kind = config["model_type"]
    out = FAMILIES[kind](hf, config, r, p, ep) if kind in FAMILIES else llama_like_shards(hf, config, r, p, ep)
    out = {n: t.clone(memory_format=torch.contiguous_format) for n, t in out.items()}
    embedding = {"gpt_neox": "model.embed_in.weight", "bloom": "transformer.word_embeddings.weight",
                 "falcon": "transformer.word_embeddings.weight", "gptj": "transformer.wte.weight"}
    if config.get("tie_word_embeddings"):
        out["lm_head.weight"] = out[embedding.get(kind, "model.embed_tokens.weight")]
    return out


def _qkv(q, k, v, r, p, n_kv, d):
    return torch.cat([rows(q, r, p), kv_rows(k, r, p, n_kv, d), kv_rows(v, r, p, n_kv, d)])


def _whole(hf: dict, out: dict, names, src: str = "", dst: str = "") -> None:
    for n in names:
        if src + n in hf:
            out[dst + n] = hf[src + n]


def _experts(gates, ups, downs, r: int, p: int, ep: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(w13, w2) of rank r: its group's experts, each cat[gate rows, up rows] / down columns cut g ways."""
    g = p // ep
    group, t = r // g, r % g
    n = len(gates)
    ids = range(group * n // ep, (group + 1) * n // ep)
    return (torch.stack([torch.cat([rows(gates[e], t, g), rows(ups[e], t, g)]) for e in ids]),
            torch.stack([cols(downs[e], t, g) for e in ids]))


def gpt_neox(hf, c, r, p, ep):
    """Transformers backend: HF names (gpt_neox. -> model., embed_out -> lm_head), colwise / rowwise by rows."""
    out = {"model.embed_in.weight": vocab_rows(hf["gpt_neox.embed_in.weight"], r, p),
           "lm_head.weight": vocab_rows(hf["embed_out.weight"], r, p)}
    _whole(hf, out, ("final_layer_norm.weight", "final_layer_norm.bias"), "gpt_neox.", "model.")
    for i in range(c["num_hidden_layers"]):
        a, b = f"gpt_neox.layers.{i}.", f"model.layers.{i}."
        _whole(hf, out, ("input_layernorm.weight", "input_layernorm.bias", "post_attention_layernorm.weight",
                         "post_attention_layernorm.bias", "attention.dense.bias", "mlp.dense_4h_to_h.bias"), a, b)
        for n in ("attention.query_key_value.weight", "attention.query_key_value.bias", "mlp.dense_h_to_4h.weight",
                  "mlp.dense_h_to_4h.bias"):
            out[b + n] = rows(hf[a + n], r, p)
        for n in ("attention.dense.weight", "mlp.dense_4h_to_h.weight"):
            out[b + n] = cols(hf[a + n], r, p)
    return out


def phi(hf, c, r, p, ep):
    """Transformers backend: q/k/v fused into qkv_proj, fc1 colwise, dense / fc2 rowwise, lm_head with a bias."""
    n_kv, d = c.get("num_key_value_heads") or c["num_attention_heads"], c["hidden_size"] // c["num_attention_heads"]
    out = {"model.embed_tokens.weight": vocab_rows(hf["model.embed_tokens.weight"], r, p),
           "lm_head.weight": vocab_rows(hf["lm_head.weight"], r, p), "lm_head.bias": vocab_rows(hf["lm_head.bias"], r, p)}
    _whole(hf, out, ("model.final_layernorm.weight", "model.final_layernorm.bias"))
    for i in range(c["num_hidden_layers"]):
        a = f"model.layers.{i}."
        _whole(hf, out, ("input_layernorm.weight", "input_layernorm.bias", "self_attn.dense.bias", "mlp.fc2.bias"), a, a)
        for kind in ("weight", "bias"):
            out[a + f"self_attn.qkv_proj.{kind}"] = _qkv(*(hf[a + f"self_attn.{x}_proj.{kind}"] for x in "qkv"),
                                                         r, p, n_kv, d)
            out[a + f"mlp.fc1.{kind}"] = rows(hf[a + f"mlp.fc1.{kind}"], r, p)
        out[a + "self_attn.dense.weight"] = cols(hf[a + "self_attn.dense.weight"], r, p)
        out[a + "mlp.fc2.weight"] = cols(hf[a + "mlp.fc2.weight"], r, p)
    return out


def _unpacked(t: torch.Tensor, n_kv: int, per_group: int) -> tuple[torch.Tensor, ...]:
    """q, k, v of a projection packed per kv head ([its q heads, k, v] for each), as falcon.py narrows them."""
    packed = t.reshape(n_kv, per_group + 2, -1, *t.shape[1:])
    return tuple(x.reshape(-1, *t.shape[1:]) for x in packed.split([per_group, 1, 1], dim=1))


def _packed_attention(hf, out, a: str, r: int, p: int, heads: int, n_kv: int, d: int) -> None:
    for kind in ("weight", "bias"):
        name = a + f"self_attention.query_key_value.{kind}"
        if name in hf:
            out[name] = _qkv(*_unpacked(hf[name], n_kv, heads // n_kv), r, p, n_kv, d)
    out[a + "self_attention.dense.weight"] = cols(hf[a + "self_attention.dense.weight"], r, p)
    out[a + "mlp.dense_h_to_4h.weight"] = rows(hf[a + "mlp.dense_h_to_4h.weight"], r, p)
    out[a + "mlp.dense_4h_to_h.weight"] = cols(hf[a + "mlp.dense_4h_to_h.weight"], r, p)
    if a + "mlp.dense_h_to_4h.bias" in hf:
        out[a + "mlp.dense_h_to_4h.bias"] = rows(hf[a + "mlp.dense_h_to_4h.bias"], r, p)
    _whole(hf, out, ("self_attention.dense.bias", "mlp.dense_4h_to_h.bias", "input_layernorm.weight",
                     "input_layernorm.bias", "post_attention_layernorm.weight", "post_attention_layernorm.bias",
                     "ln_attn.weight", "ln_attn.bias", "ln_mlp.weight", "ln_mlp.bias"), a, a)


def bloom(hf, c, r, p, ep):
    """bloom.py: query_key_value per head [q, k, v] (one kv head per head), unpacked, then cut as qkv."""
    heads = c["n_head"]
    out = {"transformer.word_embeddings.weight": vocab_rows(hf["transformer.word_embeddings.weight"], r, p)}
    _whole(hf, out, ("transformer.word_embeddings_layernorm.weight", "transformer.word_embeddings_layernorm.bias",
                     "transformer.ln_f.weight", "transformer.ln_f.bias"))
    for i in range(c["n_layer"]):
        _packed_attention(hf, out, f"transformer.h.{i}.", r, p, heads, heads, c["hidden_size"] // heads)
    return out


def falcon(hf, c, r, p, ep):
    """falcon.py: kv heads num_kv_heads (new decoder), 1 (multi-query) or one per head; packed per kv group."""
    heads = c["num_attention_heads"]
    n_kv = c["num_kv_heads"] if c["new_decoder_architecture"] else 1 if c["multi_query"] else heads
    out = {"transformer.word_embeddings.weight": vocab_rows(hf["transformer.word_embeddings.weight"], r, p)}
    if not c.get("tie_word_embeddings"):
        out["lm_head.weight"] = vocab_rows(hf["lm_head.weight"], r, p)
    _whole(hf, out, ("transformer.ln_f.weight", "transformer.ln_f.bias"))
    for i in range(c["num_hidden_layers"]):
        _packed_attention(hf, out, f"transformer.h.{i}.", r, p, heads, n_kv, c["hidden_size"] // heads)
    return out


def gptj(hf, c, r, p, ep):
    """gpt_j.py: q/k/v into qkv_proj, lm_head weight and bias vocab-parallel."""
    heads, d = c["n_head"], c["n_embd"] // c["n_head"]
    out = {"transformer.wte.weight": vocab_rows(hf["transformer.wte.weight"], r, p),
           "lm_head.weight": vocab_rows(hf["lm_head.weight"], r, p), "lm_head.bias": vocab_rows(hf["lm_head.bias"], r, p)}
    _whole(hf, out, ("transformer.ln_f.weight", "transformer.ln_f.bias"))
    for i in range(c["n_layer"]):
        a = f"transformer.h.{i}."
        _whole(hf, out, ("ln_1.weight", "ln_1.bias", "mlp.fc_out.bias"), a, a)
        out[a + "attn.qkv_proj.weight"] = _qkv(*(hf[a + f"attn.{x}_proj.weight"] for x in "qkv"), r, p, heads, d)
        out[a + "attn.out_proj.weight"] = cols(hf[a + "attn.out_proj.weight"], r, p)
        out[a + "mlp.fc_in.weight"], out[a + "mlp.fc_in.bias"] = (rows(hf[a + f"mlp.fc_in.{x}"], r, p)
                                                                  for x in ("weight", "bias"))
        out[a + "mlp.fc_out.weight"] = cols(hf[a + "mlp.fc_out.weight"], r, p)
    return out


def phimoe(hf, c, r, p, ep):
    """phimoe.py: Mixtral's block with attention biases and an lm_head bias (vocab-parallel)."""
    out = llama_like_shards(hf, c, r, p, ep)
    out["lm_head.bias"] = vocab_rows(hf["lm_head.bias"], r, p)
    return out


def _attention(hf, out, a: str, c: dict, r: int, p: int, qkv: str, o: str, permute: bool = False) -> None:
    """Llama attention of prefix a into qkv / o (names), q and k permuted inside each head (Llama-4) if asked."""
    heads = c["num_attention_heads"]
    n_kv = c.get("num_key_value_heads") or heads
    d = c.get("head_dim") or c["hidden_size"] // heads
    q, k, v = (hf[a + f"self_attn.{x}_proj.weight"] for x in "qkv")
    if permute:  # llama4.py permute_qk_weight_for_rotary: per head, rows (2j, 2j + 1) -> (j, d/2 + j)
        q, k = (t.view(n, d // 2, 2, t.shape[1]).transpose(1, 2).reshape(t.shape) for t, n in ((q, heads), (k, n_kv)))
    out[qkv] = _qkv(q, k, v, r, p, n_kv, d)
    out[o] = cols(hf[a + "self_attn.o_proj.weight"], r, p)


def _head_and_norm(hf, out, c, r, p, norm: str = "model.norm.weight") -> None:
    out["model.embed_tokens.weight"] = vocab_rows(hf["model.embed_tokens.weight"], r, p)
    if not c.get("tie_word_embeddings"):
        out["lm_head.weight"] = vocab_rows(hf["lm_head.weight"], r, p)
    out[norm] = hf[norm]


def _granite_moe(hf, out, a: str, c, r, p, ep) -> None:
    m = a + "block_sparse_moe."
    stacked, inter = hf[m + "input_linear.weight"], c["intermediate_size"]
    out[m + "gate.weight"] = hf[m + "router.layer.weight"]
    out[m + "experts.w13_weight"], out[m + "experts.w2_weight"] = _experts(
        stacked[:, :inter], stacked[:, inter:], hf[m + "output_linear.weight"], r, p, ep)
    if a + "shared_mlp.input_linear.weight" in hf:  # granitemoeshared.py: a MergedColumnParallelLinear
        gate, up = hf[a + "shared_mlp.input_linear.weight"].chunk(2)
        out[a + "shared_mlp.input_linear.weight"] = torch.cat([rows(gate, r, p), rows(up, r, p)])
        out[a + "shared_mlp.output_linear.weight"] = cols(hf[a + "shared_mlp.output_linear.weight"], r, p)


def granitemoe(hf, c, r, p, ep):
    """granitemoe.py (and granitemoeshared.py): input_linear [E, 2I, H] chunked into gate and up."""
    out = {}
    _head_and_norm(hf, out, c, r, p)
    for i in range(c["num_hidden_layers"]):
        a = f"model.layers.{i}."
        _whole(hf, out, ("input_layernorm.weight", "post_attention_layernorm.weight"), a, a)
        _attention(hf, out, a, c, r, p, a + "self_attn.qkv_proj.weight", a + "self_attn.o_proj.weight")
        _granite_moe(hf, out, a, c, r, p, ep)
    return out


def _dense_mlp(hf, out, m: str, r: int, p: int) -> None:
    out[m + "gate_up_proj.weight"] = torch.cat([rows(hf[m + "gate_proj.weight"], r, p), rows(hf[m + "up_proj.weight"], r, p)])
    out[m + "down_proj.weight"] = cols(hf[m + "down_proj.weight"], r, p)


def _per_expert(hf, m: str, n: int, r: int, p: int, ep: int):
    return _experts(*([hf[m + f"experts.{e}.{x}.weight"] for e in range(n)] for x in ("gate_proj", "up_proj", "down_proj")),
                    r, p, ep)


def ernie4_5_moe(hf, c, r, p, ep):
    """ernie45_moe.py: router and its correction bias in float32, the bias stored [1, E] under moe_statics."""
    out = {}
    _head_and_norm(hf, out, c, r, p)
    n_kv, d = c["num_key_value_heads"], c["hidden_size"] // c["num_attention_heads"]
    for i in range(c["num_hidden_layers"]):
        a, m = f"model.layers.{i}.", f"model.layers.{i}.mlp."
        _whole(hf, out, ("input_layernorm.weight", "post_attention_layernorm.weight"), a, a)
        _attention(hf, out, a, c, r, p, a + "self_attn.qkv_proj.weight", a + "self_attn.o_proj.weight")
        if a + "self_attn.q_proj.bias" in hf:
            out[a + "self_attn.qkv_proj.bias"] = _qkv(*(hf[a + f"self_attn.{x}_proj.bias"] for x in "qkv"), r, p, n_kv, d)
        if m + "gate.weight" not in hf:
            _dense_mlp(hf, out, m, r, p)
            continue
        out[m + "gate.weight"] = hf[m + "gate.weight"].float()
        out[m + "gate.e_score_correction_bias"] = hf[m + "moe_statics.e_score_correction_bias"].squeeze(0).float()
        out[m + "experts.w13_weight"], out[m + "experts.w2_weight"] = _per_expert(hf, m, c["moe_num_experts"], r, p, ep)
        if m + "shared_experts.gate_proj.weight" in hf:
            _dense_mlp(hf, out, m + "shared_experts.", r, p)
    return out


def llama4(hf, c, r, p, ep):
    """llama4.py: q/k permuted for the rotary; sparse layers' experts stacked [E, H, 2I] / [E, I, H], transposed."""
    out = {}
    _head_and_norm(hf, out, c, r, p)
    for i in range(c["num_hidden_layers"]):
        a, f = f"model.layers.{i}.", f"model.layers.{i}.feed_forward."
        _whole(hf, out, ("input_layernorm.weight", "post_attention_layernorm.weight"), a, a)
        _attention(hf, out, a, c, r, p, a + "self_attn.qkv_proj.weight", a + "self_attn.o_proj.weight", permute=True)
        if f + "router.weight" not in hf:
            _dense_mlp(hf, out, f, r, p)
            continue
        out[f + "router.weight"] = hf[f + "router.weight"]
        _dense_mlp(hf, out, f + "shared_expert.", r, p)
        gate, up = hf[f + "experts.gate_up_proj"].transpose(-1, -2).chunk(2, dim=-2)
        out[f + "experts.w13_weight"], out[f + "experts.w2_weight"] = _experts(
            gate, up, hf[f + "experts.down_proj"].transpose(-1, -2), r, p, ep)
    return out


def _mamba(hf, out, m: str, r: int, p: int) -> None:
    x, z = hf[m + "in_proj.weight"].chunk(2)
    out[m + "in_proj.weight"] = torch.cat([rows(x, r, p), rows(z, r, p)])
    for n in ("conv1d.weight", "conv1d.bias", "dt_proj.weight", "dt_proj.bias", "D"):
        if m + n in hf:
            out[m + n] = rows(hf[m + n], r, p)
    out[m + "A"] = rows(-torch.exp(hf[m + "A_log"].float()), r, p)   # jamba.py's A_weight_loader
    out[m + "x_proj.weight"] = cols(hf[m + "x_proj.weight"], r, p)
    out[m + "out_proj.weight"] = cols(hf[m + "out_proj.weight"], r, p)
    _whole(hf, out, ("dt_layernorm.weight", "b_layernorm.weight", "c_layernorm.weight"), m, m)


def jamba(hf, c, r, p, ep):
    """jamba.py: attention layers without `self_attn.`, Mamba mixers, experts on the expert-period layers."""
    out = {}
    _head_and_norm(hf, out, c, r, p, norm="model.final_layernorm.weight")
    for i in range(c["num_hidden_layers"]):
        a, f = f"model.layers.{i}.", f"model.layers.{i}.feed_forward."
        _whole(hf, out, ("input_layernorm.weight", "pre_ff_layernorm.weight"), a, a)
        if a + "self_attn.q_proj.weight" in hf:
            _attention(hf, out, a, c, r, p, a + "qkv_proj.weight", a + "o_proj.weight")
        else:
            _mamba(hf, out, a + "mamba.", r, p)
        if f + "router.weight" not in hf:
            _dense_mlp(hf, out, f, r, p)
            continue
        out[f + "router.weight"] = hf[f + "router.weight"]
        out[f + "experts.w13_weight"], out[f + "experts.w2_weight"] = _per_expert(hf, f, c["num_experts"], r, p, ep)
    return out


FAMILIES = {"gpt_neox": gpt_neox, "phi": phi, "bloom": bloom, "falcon": falcon, "gptj": gptj, "phimoe": phimoe,
            "granitemoe": granitemoe, "granitemoeshared": granitemoe, "ernie4_5_moe": ernie4_5_moe,
            "llama4_text": llama4, "jamba": jamba}
# Served like a family layout_oracle.py knows: smollm3 and stablelm (Llama), exaone4 (per-head q/k norms, no
# input_layernorm), olmo2 and olmoe (q/k norms over the projection, whole on every rank).
