"""Test-side oracle: slice a Hugging Face state dict into one rank's serving layout (DESIGN §4.2).

Written plainly and independently of distload's rules, plan and forward (it finds the family from the
names on disk, not from a table), so that tests can compare distload's shards with it and run the
reference forward on it. Every shard is a fresh contiguous copy, except that a tied lm_head is the
embedding tensor itself.
"""

from __future__ import annotations

import math

import torch


def rows(t: torch.Tensor, r: int, p: int) -> torch.Tensor:
    """Block r of p along dim 0."""
    n = t.shape[0] // p
    return t[r * n:(r + 1) * n]


def cols(t: torch.Tensor, r: int, p: int) -> torch.Tensor:
    """Block r of p along dim 1."""
    n = t.shape[1] // p
    return t[:, r * n:(r + 1) * n]


def padded_vocab(vocab: int, p: int) -> int:
    """vocab rounded up to a multiple of lcm(64, p)."""
    m = math.lcm(64, p)
    return (vocab + m - 1) // m * m


def vocab_rows(t: torch.Tensor, r: int, p: int) -> torch.Tensor:
    padding = torch.zeros(padded_vocab(t.shape[0], p) - t.shape[0], *t.shape[1:], dtype=t.dtype)
    return rows(torch.cat([t, padding]), r, p)


def kv_rows(t: torch.Tensor, r: int, p: int, n_kv: int, head_dim: int) -> torch.Tensor:
    """k or v (weight or bias) for rank r: kv heads split p ways, or head r // (p / n_kv) when p > n_kv."""
    if p <= n_kv:
        return rows(t, r, p)
    head = r // (p // n_kv)
    return t[head * head_dim:(head + 1) * head_dim]


def serving_shards(hf: dict[str, torch.Tensor], config: dict, tp_rank: int, tp_size: int, ep_size: int = 1,
                   local_expert_ids: list[int] | None = None) -> dict[str, torch.Tensor]:
    """Rank tp_rank's tensors, serving names. MoE: ep_size contiguous groups of tp_size/ep_size ranks;
    local_expert_ids defaults to group k hosting experts [k*n/ep_size, (k+1)*n/ep_size)."""
    if "transformer.wte.weight" in hf:
        return gpt_shards(hf, config, tp_rank, tp_size)
    if "model.tok_embeddings.weight" in hf:
        return internlm2_shards(hf, config, tp_rank, tp_size)
    if "model.layers.0.self_attn.sinks" in hf:
        return gpt_oss_shards(hf, config, tp_rank, tp_size, ep_size, local_expert_ids)
    r, p = tp_rank, tp_size
    out: dict[str, torch.Tensor] = {}
    out["model.embed_tokens.weight"] = vocab_rows(hf["model.embed_tokens.weight"], r, p)
    if not config.get("tie_word_embeddings"):
        out["lm_head.weight"] = vocab_rows(hf["lm_head.weight"], r, p)
    out["model.norm.weight"] = hf["model.norm.weight"]
    if "model.norm.bias" in hf:
        out["model.norm.bias"] = hf["model.norm.bias"]

    for i in range(config["num_hidden_layers"]):
        a = f"model.layers.{i}."
        for name in ("input_layernorm.weight", "post_attention_layernorm.weight", "input_layernorm.bias",
                     "post_attention_layernorm.bias", "pre_feedforward_layernorm.weight",
                     "post_feedforward_layernorm.weight", "self_attn.o_proj.bias"):
            if a + name in hf:
                out[a + name] = hf[a + name]
        out.update(attention_shards(hf, config, a, r, p))

        if a + "block_sparse_moe.gate.weight" in hf:  # Mixtral: experts.{e}.w1 (gate), w3 (up), w2 (down)
            moe, parts = a + "block_sparse_moe.", ("w1", "w3", "w2")
        elif a + "mlp.gate.weight" in hf:  # Qwen-MoE
            moe, parts = a + "mlp.", ("gate_proj", "up_proj", "down_proj")
        else:
            moe = None

        if a + "mlp.c_fc.weight" in hf:  # StarCoder2: c_fc column-, c_proj row-parallel, its bias whole
            out[a + "mlp.c_fc.weight"], out[a + "mlp.c_fc.bias"] = (rows(hf[a + f"mlp.c_fc.{x}"], r, p)
                                                                  for x in ("weight", "bias"))
            out[a + "mlp.c_proj.weight"] = cols(hf[a + "mlp.c_proj.weight"], r, p)
            out[a + "mlp.c_proj.bias"] = hf[a + "mlp.c_proj.bias"]
            continue
        if moe is None:  # dense MLP, split p ways
            if a + "mlp.gate_up_proj.weight" in hf:  # Phi-3: fused on disk as [gate; up]
                gate, up = hf[a + "mlp.gate_up_proj.weight"].chunk(2)
            else:
                gate, up = hf[a + "mlp.gate_proj.weight"], hf[a + "mlp.up_proj.weight"]
            out[a + "mlp.gate_up_proj.weight"] = torch.cat([rows(gate, r, p), rows(up, r, p)])
            out[a + "mlp.down_proj.weight"] = cols(hf[a + "mlp.down_proj.weight"], r, p)
            continue

        out.update(moe_shards(hf, moe, parts, r, p, ep_size, local_expert_ids))

    shards = {name: v.clone(memory_format=torch.contiguous_format) for name, v in out.items()}
    if config.get("tie_word_embeddings"):
        shards["lm_head.weight"] = shards["model.embed_tokens.weight"]  # aliased, as the loader does
    return shards


def attention_shards(hf: dict[str, torch.Tensor], config: dict, a: str, r: int, p: int) -> dict[str, torch.Tensor]:
    """One layer's attention (prefix `a`): q/k norms, q/k/v (separate or fused) into qkv_proj, o_proj; MLA and
    linear attention by their own functions."""
    n_heads = config["num_attention_heads"]
    n_kv = config.get("num_key_value_heads") or n_heads
    d = config.get("head_dim") or config["hidden_size"] // n_heads
    out: dict[str, torch.Tensor] = {}
    q_norm, k_norm = hf.get(a + "self_attn.q_norm.weight"), hf.get(a + "self_attn.k_norm.weight")
    if q_norm is not None and q_norm.dim() == 1:
        # Qwen3, Gemma3: one [head_dim] norm for all heads; OLMo2 / OLMoE [heads * d] over the whole projection,
        # which vLLM keeps whole on every rank (it gathers q and k before the norm)
        out[a + "self_attn.q_norm.weight"], out[a + "self_attn.k_norm.weight"] = q_norm, k_norm
    elif q_norm is not None:  # Cohere [heads, d]: each rank its heads, like q and k
        per_head = k_norm.shape[0] // n_kv
        out[a + "self_attn.q_norm.weight"] = rows(q_norm, r, p)
        out[a + "self_attn.k_norm.weight"] = kv_rows(k_norm, r, p, n_kv, per_head)

    if a + "self_attn.kv_a_proj_with_mqa.weight" in hf:
        out.update(mla_shards(hf, a + "self_attn.", r, p))
    for kind in ("weight", "bias"):
        if a + f"self_attn.qkv_proj.{kind}" in hf:  # Phi-3: fused on disk as [q; k; v]
            q, k, v = hf[a + f"self_attn.qkv_proj.{kind}"].split([n_heads * d, n_kv * d, n_kv * d])
        elif a + f"self_attn.k_proj.{kind}" in hf:
            q, k, v = (hf[a + f"self_attn.{x}_proj.{kind}"] for x in "qkv")
        else:
            continue
        out[a + f"self_attn.qkv_proj.{kind}"] = torch.cat(
            [rows(q, r, p), kv_rows(k, r, p, n_kv, d), kv_rows(v, r, p, n_kv, d)])
    if a + "self_attn.o_proj.weight" in hf:
        out[a + "self_attn.o_proj.weight"] = cols(hf[a + "self_attn.o_proj.weight"], r, p)
    else:  # Qwen3-Next's linear-attention layers
        out.update(linear_attention_shards(hf, config, a + "linear_attn.", r, p))
    return out


def moe_shards(hf: dict[str, torch.Tensor], moe: str, parts: tuple[str, str, str], r: int, p: int, ep_size: int,
               local_expert_ids: list[int] | None) -> dict[str, torch.Tensor]:
    """One sparse block (prefix `moe`): router, experts of this rank's EP group TP-split inside it, shared experts."""
    g = p // ep_size  # ranks per EP group; each expert is TP-split g ways inside its group
    group, t = r // g, r % g
    out: dict[str, torch.Tensor] = {}
    out[moe + "gate.weight"] = hf[moe + "gate.weight"]
    n_experts = hf[moe + "gate.weight"].shape[0]
    ids = local_expert_ids
    if ids is None:
        per_group = n_experts // ep_size
        ids = list(range(group * per_group, (group + 1) * per_group))
    w13, w2 = [], []
    for e in sorted(ids):
        gate, up, down = (hf[moe + f"experts.{e}.{x}.weight"] for x in parts)
        w13.append(torch.cat([rows(gate, t, g), rows(up, t, g)]))
        w2.append(cols(down, t, g))
    out[moe + "experts.w13_weight"] = torch.stack(w13)
    out[moe + "experts.w2_weight"] = torch.stack(w2)

    if moe + "gate.e_score_correction_bias" in hf:  # DeepSeek-style router bias, replicated
        out[moe + "gate.e_score_correction_bias"] = hf[moe + "gate.e_score_correction_bias"]
    if moe + "shared_experts.gate_proj.weight" in hf:  # GLM-4.5 / DeepSeek: shared experts as a dense MLP
        s = moe + "shared_experts."
        out[s + "gate_up_proj.weight"] = torch.cat([rows(hf[s + "gate_proj.weight"], r, p),
                                                    rows(hf[s + "up_proj.weight"], r, p)])
        out[s + "down_proj.weight"] = cols(hf[s + "down_proj.weight"], r, p)
    if moe + "shared_expert_gate.weight" in hf:  # Qwen2-MoE: shared expert split p ways like a dense MLP
        s = moe + "shared_expert."
        out[moe + "shared_expert_gate.weight"] = hf[moe + "shared_expert_gate.weight"]
        out[s + "gate_up_proj.weight"] = torch.cat([rows(hf[s + "gate_proj.weight"], r, p),
                                                    rows(hf[s + "up_proj.weight"], r, p)])
        out[s + "down_proj.weight"] = cols(hf[s + "down_proj.weight"], r, p)
    return out


def gpt_shards(hf: dict[str, torch.Tensor], config: dict, r: int, p: int) -> dict[str, torch.Tensor]:
    """GPT-2 (vLLM gpt2.py): Conv1D weights [in, out] on disk, [out, in] in serving; c_attn = [q; k; v]. GPTBigCode
    as vLLM 0.32's Transformers backend serves it: `transformer.` as `model.`, c_attn one kv head on every rank,
    the MLP whole on every rank (its tensor-parallel plan leaves it out)."""
    conv1d = config["model_type"] == "gpt2"
    n_heads, hidden = config["n_head"], config["n_embd"]
    d = hidden // n_heads
    n_kv = 1 if config.get("multi_query") else n_heads
    top = "transformer." if conv1d else "model."
    out = {top + "wte.weight": vocab_rows(hf["transformer.wte.weight"], r, p)}
    for name in ("wpe.weight", "ln_f.weight", "ln_f.bias"):
        out[top + name] = hf["transformer." + name]
    for i in range(config["n_layer"]):
        a, b = f"transformer.h.{i}.", f"{top}h.{i}."
        w = {k[len(a):]: (v.t() if conv1d and k.endswith(".weight") and ".c_" in k else v)
             for k, v in hf.items() if k.startswith(a)}
        for name in ("ln_1.weight", "ln_1.bias", "ln_2.weight", "ln_2.bias", "attn.c_proj.bias", "mlp.c_proj.bias"):
            out[b + name] = w[name]
        for kind in ("weight", "bias"):
            q, k, v = w[f"attn.c_attn.{kind}"].split([hidden, n_kv * d, n_kv * d])
            out[b + f"attn.c_attn.{kind}"] = torch.cat([rows(q, r, p), kv_rows(k, r, p, n_kv, d),
                                                       kv_rows(v, r, p, n_kv, d)])
        out[b + "attn.c_proj.weight"] = cols(w["attn.c_proj.weight"], r, p)
        if conv1d:
            out[b + "mlp.c_fc.weight"], out[b + "mlp.c_fc.bias"] = (rows(w[f"mlp.c_fc.{x}"], r, p)
                                                                    for x in ("weight", "bias"))
            out[b + "mlp.c_proj.weight"] = cols(w["mlp.c_proj.weight"], r, p)
        else:
            for name in ("mlp.c_fc.weight", "mlp.c_fc.bias", "mlp.c_proj.weight"):
                out[b + name] = w[name]
    shards = {name: v.clone(memory_format=torch.contiguous_format) for name, v in out.items()}
    shards["lm_head.weight"] = shards[top + "wte.weight"]  # tied, aliased as the loader does
    return shards


def linear_attention_shards(hf: dict[str, torch.Tensor], config: dict, a: str, r: int, p: int) -> dict:
    """Qwen3-Next Gated DeltaNet (vLLM qwen3_next.py): projections packed per key-head group, cut by rows; the
    conv over [q; k; v] cut per segment; per value head A_log / dt_bias; the gated norm whole."""
    key_dim = config["linear_num_key_heads"] * config["linear_key_head_dim"]
    value_dim = config["linear_num_value_heads"] * config["linear_value_head_dim"]
    conv = hf[a + "conv1d.weight"].split([key_dim, key_dim, value_dim])
    return {a + "in_proj_qkvz.weight": rows(hf[a + "in_proj_qkvz.weight"], r, p),
            a + "in_proj_ba.weight": rows(hf[a + "in_proj_ba.weight"], r, p),
            a + "conv1d.weight": torch.cat([rows(c, r, p) for c in conv]),
            a + "A_log": rows(hf[a + "A_log"], r, p), a + "dt_bias": rows(hf[a + "dt_bias"], r, p),
            a + "norm.weight": hf[a + "norm.weight"], a + "out_proj.weight": cols(hf[a + "out_proj.weight"], r, p)}


def mla_shards(hf: dict[str, torch.Tensor], s: str, r: int, p: int) -> dict:
    """DeepSeek multi-head latent attention (vLLM deepseek_v2.py): the low-rank down projections q_a and
    kv_a fused and whole on every rank, the up projections by heads (rows), their norms whole."""
    out = {s + "kv_a_layernorm.weight": hf[s + "kv_a_layernorm.weight"],
           s + "kv_b_proj.weight": rows(hf[s + "kv_b_proj.weight"], r, p)}
    if s + "q_a_proj.weight" in hf:
        out[s + "fused_qkv_a_proj.weight"] = torch.cat([hf[s + "q_a_proj.weight"], hf[s + "kv_a_proj_with_mqa.weight"]])
        out[s + "q_a_layernorm.weight"] = hf[s + "q_a_layernorm.weight"]
        out[s + "q_b_proj.weight"] = rows(hf[s + "q_b_proj.weight"], r, p)
    else:  # no q_lora_rank: q_proj by heads, kv_a whole
        out[s + "q_proj.weight"] = rows(hf[s + "q_proj.weight"], r, p)
        out[s + "kv_a_proj_with_mqa.weight"] = hf[s + "kv_a_proj_with_mqa.weight"]
    return out


def gpt_oss_shards(hf: dict[str, torch.Tensor], config: dict, r: int, p: int, ep_size: int = 1,
                   local_expert_ids: list[int] | None = None) -> dict[str, torch.Tensor]:
    """GPT-OSS as vLLM's gpt_oss.py loads BF16 experts: attention under `attn.`, sinks by heads; experts stacked
    [E, H, 2I] / [E, I, H] on disk, sliced on the (interleaved) intermediate dim, then permuted to [E, 2I/g, H]
    / [E, H, I/g]; w2_bias whole on rank 0 of each expert group, zero elsewhere."""
    n_kv, d = config["num_key_value_heads"], config["head_dim"]
    g = p // ep_size
    group, t = r // g, r % g
    n_experts, inter = config["num_local_experts"], config["intermediate_size"]
    ids = local_expert_ids if local_expert_ids is not None else \
        list(range(group * n_experts // ep_size, (group + 1) * n_experts // ep_size))
    ids = sorted(ids)
    s0, s1 = t * inter // g, (t + 1) * inter // g
    out = {"model.embedding.weight": vocab_rows(hf["model.embed_tokens.weight"], r, p),
           "lm_head.weight": vocab_rows(hf["lm_head.weight"], r, p), "model.norm.weight": hf["model.norm.weight"]}
    for i in range(config["num_hidden_layers"]):
        a, s = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        for name in ("input_layernorm.weight", "post_attention_layernorm.weight", "mlp.router.weight",
                     "mlp.router.bias"):
            out[a + name] = hf[a + name]
        for kind in ("weight", "bias"):
            q, k, v = (hf[s + f"{x}_proj.{kind}"] for x in "qkv")
            out[a + f"attn.qkv_proj.{kind}"] = torch.cat([rows(q, r, p), kv_rows(k, r, p, n_kv, d),
                                                         kv_rows(v, r, p, n_kv, d)])
        out[a + "attn.o_proj.weight"] = cols(hf[s + "o_proj.weight"], r, p)
        out[a + "attn.o_proj.bias"] = hf[s + "o_proj.bias"]
        out[a + "attn.sinks"] = rows(hf[s + "sinks"], r, p)
        e = a + "mlp.experts."
        out[e + "w13_weight"] = hf[e + "gate_up_proj"][ids][:, :, 2 * s0:2 * s1].permute(0, 2, 1)
        out[e + "w2_weight"] = hf[e + "down_proj"][ids][:, s0:s1, :].permute(0, 2, 1)
        out[e + "w13_bias"] = hf[e + "gate_up_proj_bias"][ids][:, 2 * s0:2 * s1]
        bias = hf[e + "down_proj_bias"][ids]
        out[e + "w2_bias"] = bias if t == 0 else torch.zeros_like(bias)
    return {name: v.clone(memory_format=torch.contiguous_format) for name, v in out.items()}


def internlm2_shards(hf: dict[str, torch.Tensor], config: dict, r: int, p: int) -> dict[str, torch.Tensor]:
    """InternLM2 as vLLM's internlm2.py loads it: wqkv unpacked from its kv-head groups into q, k, v, then cut
    like every qkv_proj; w1/w3 merged; names kept."""
    heads, n_kv, hidden = config["num_attention_heads"], config["num_key_value_heads"], config["hidden_size"]
    d = hidden // heads
    out = {"model.tok_embeddings.weight": vocab_rows(hf["model.tok_embeddings.weight"], r, p),
           "output.weight": vocab_rows(hf["output.weight"], r, p), "model.norm.weight": hf["model.norm.weight"]}
    for i in range(config["num_hidden_layers"]):
        a = f"model.layers.{i}."
        packed = hf[a + "attention.wqkv.weight"].reshape(n_kv, heads // n_kv + 2, d, hidden)
        q, k, v = (x.reshape(-1, hidden) for x in packed.split([heads // n_kv, 1, 1], dim=1))
        out[a + "attention.wqkv.weight"] = torch.cat([rows(q, r, p), kv_rows(k, r, p, n_kv, d), kv_rows(v, r, p, n_kv, d)])
        out[a + "attention.wo.weight"] = cols(hf[a + "attention.wo.weight"], r, p)
        out[a + "feed_forward.gate_up_proj.weight"] = torch.cat([rows(hf[a + "feed_forward.w1.weight"], r, p),
                                                                 rows(hf[a + "feed_forward.w3.weight"], r, p)])
        out[a + "feed_forward.w2.weight"] = cols(hf[a + "feed_forward.w2.weight"], r, p)
        for name in ("attention_norm.weight", "ffn_norm.weight"):
            out[a + name] = hf[a + name]
    return {name: v.clone(memory_format=torch.contiguous_format) for name, v in out.items()}
