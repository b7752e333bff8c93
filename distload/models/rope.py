"""Rotary position embeddings, computed from a config.json dict exactly as transformers 5.x does.

Why our own copy: the reference forward gets the plain config.json a checkpoint ships, not a
`PretrainedConfig`, and every scaling type is a few lines of arithmetic. Each function mirrors the one of
the same name in transformers' `modeling_rope_utils` (float32, same operation order), so the logits agree
to ~1e-6 and a mismatch in a test points at the weights, not at RoPE.
"""

from __future__ import annotations

import math

import torch

from distload.errors import DistloadError


def rope_parameters(config: dict, aliases: dict[str, str] | None = None, layer_type: str | None = None) -> dict:
    """The rope dict wherever this config.json keeps it, with `rope_type`, `rope_theta` and
    `partial_rotary_factor` filled in.

    transformers >= 5 writes `rope_parameters` with `rope_theta` inside, nested by layer type where layer types
    differ (Gemma 3: {"sliding_attention": ..., "full_attention": ...}); older files write `rope_scaling` (or
    null) next to a top-level `rope_theta`, and call the type `type`, and Gemma 3 kept its sliding layers' base
    as `rope_local_base_freq`. `aliases` renames legacy types (Phi-3 saved LongRoPE as "su" or "yarn").
    """
    rp = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    if set(rp) & set(config.get("layer_types") or ()):
        if layer_type not in rp:
            raise DistloadError(f"rope_parameters are nested by layer type ({sorted(rp)}) but layer type "
                                f"{layer_type!r} has none")
        rp = dict(rp[layer_type] or {})
    elif layer_type == "sliding_attention" and config.get("rope_local_base_freq"):
        rp = {"rope_type": "default", "rope_theta": config["rope_local_base_freq"]}
    rope_type = rp.get("rope_type", rp.get("type", "default"))
    rp["rope_type"] = (aliases or {}).get(rope_type, rope_type)
    rp.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    rp.setdefault("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    # A top-level original_max_position_embeddings (Phi-3) wins over the rope dict, as in transformers.
    rp["original_max_position_embeddings"] = (config.get("original_max_position_embeddings")
                                              or rp.get("original_max_position_embeddings")
                                              or config.get("max_position_embeddings"))
    return rp


def _wavelength_steps(base: float, dim: int) -> torch.Tensor:
    """base^(2i/dim) for the dim/2 rotated pairs."""
    return base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)


def _inv_freq(base: float, dim: int) -> torch.Tensor:
    return 1.0 / _wavelength_steps(base, dim)


def _default(rp, config, dim, seq_len):
    return _inv_freq(rp["rope_theta"], dim), 1.0


def _linear(rp, config, dim, seq_len):
    # Scaling positions by 1/factor is the same as scaling the frequencies.
    return _inv_freq(rp["rope_theta"], dim) / rp["factor"], 1.0


def _dynamic(rp, config, dim, seq_len):
    # NTK-aware: the base grows with the sequence once it exceeds max_position_embeddings.
    max_pos, factor = config["max_position_embeddings"], rp["factor"]
    seq_len = max(seq_len, max_pos)
    base = rp["rope_theta"] * ((factor * seq_len / max_pos) - (factor - 1)) ** (dim / (dim - 2))
    return _inv_freq(base, dim), 1.0


def _llama3(rp, config, dim, seq_len):
    inv_freq = _inv_freq(rp["rope_theta"], dim)
    factor, low, high = rp["factor"], rp["low_freq_factor"], rp["high_freq_factor"]
    old_len = rp["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are interpolated by `factor`, short ones kept, the band between blended smoothly.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled), 1.0


def _yarn(rp, config, dim, seq_len):
    base, orig = rp["rope_theta"], rp["original_max_position_embeddings"]
    factor = rp.get("factor") or config["max_position_embeddings"] / orig

    def get_mscale(scale, mscale=1.0):
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = rp.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = rp.get("mscale"), rp.get("mscale_all_dim")
        attention_factor = (float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
                            if mscale and mscale_all_dim else get_mscale(factor))
    beta_fast, beta_slow = rp.get("beta_fast") or 32, rp.get("beta_slow") or 1

    def correction_dim(num_rotations):
        return (dim * math.log(orig / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rp.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: avoid a division by zero in the ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)

    pos_freqs = _wavelength_steps(base, dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp  # high-frequency dims keep their frequency, low-frequency ones are scaled
    inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv_freq, attention_factor


def _longrope(rp, config, dim, seq_len):
    orig = rp["original_max_position_embeddings"]
    factor = rp.get("factor") or config["max_position_embeddings"] / orig
    attention_factor = rp.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    # transformers picks the long factors once the sequence is longer than the pretraining length.
    ext = torch.tensor(rp["long_factor"] if seq_len > orig else rp["short_factor"], dtype=torch.float32)
    return 1.0 / (ext * _wavelength_steps(rp["rope_theta"], dim)), attention_factor


ROPE_TYPES = {"default": _default, "linear": _linear, "dynamic": _dynamic, "llama3": _llama3, "yarn": _yarn,
              "longrope": _longrope}


def rope_cos_sin(config: dict, head_dim: int, seq_len: int, device, dtype, aliases: dict[str, str] | None = None,
                 layer_type: str | None = None, interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin `[seq_len, rotary_dim]` for positions 0..seq_len-1 (rotary_dim = head_dim * partial factor).

    interleaved: each frequency repeated for the pair (2i, 2i+1) it rotates (Cohere), not once per half."""
    rp = rope_parameters(config, aliases, layer_type)
    if rp["rope_type"] not in ROPE_TYPES:
        raise DistloadError(f"rope_type {rp['rope_type']!r} is not supported by the reference forward "
                            f"(supported: {', '.join(sorted(ROPE_TYPES))})")
    dim = int(head_dim * rp["partial_rotary_factor"])
    inv_freq, attention_scaling = ROPE_TYPES[rp["rope_type"]](rp, config, dim, seq_len)
    freqs = torch.arange(seq_len, dtype=torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.repeat_interleave(freqs, 2, dim=-1) if interleaved else torch.cat((freqs, freqs), dim=-1)
    return ((emb.cos() * attention_scaling).to(device=device, dtype=dtype),
            (emb.sin() * attention_scaling).to(device=device, dtype=dtype))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """Rotate the first rotary_dim features of each head of x `[heads, T, head_dim]`; the rest pass through (Phi-3
    partial rotary). Half-split pairs (i, i + rot/2), or with `interleaved` the pairs (2i, 2i+1) (Cohere)."""
    rot = cos.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    if interleaved:
        rotated = torch.stack((-x_rot[..., 1::2], x_rot[..., ::2]), dim=-1).flatten(-2)
    else:
        x1, x2 = x_rot[..., : rot // 2], x_rot[..., rot // 2:]
        rotated = torch.cat((-x2, x1), dim=-1)
    return torch.cat((x_rot * cos + rotated * sin, x_pass), dim=-1)
