"""compressed-tensors' quantization_config, read once for the formats that share its dialect.

    {"quant_method": "compressed-tensors", "format": "float-quantized" | "int-quantized" | "pack-quantized" | ...,
     "config_groups": {"group_0": {"targets": ["Linear"],
                                   "weights": {"type": "float" | "int", "num_bits": 8, "strategy": "tensor" |
                                               "channel" | "block" | "group", "symmetric": true, ...},
                                   "input_activations": {... "dynamic": true, "strategy": "token"} | null}},
     "ignore": ["lm_head"]}

A checkpoint whose groups quantize alike is one format (vLLM picks a scheme per layer; distload plans one per
load, so groups that differ are refused by the registry, naming them).
"""

from __future__ import annotations

METHOD = "compressed-tensors"
PACKED = "pack-quantized"
WEIGHT_KEYS = ("type", "num_bits", "strategy", "block_structure", "group_size", "symmetric")   # what planning reads


def groups(qc: dict) -> list[tuple[str, dict, dict | None]]:
    """(group name, its weights, its input_activations or None) per config group."""
    return [(name, (body or {}).get("weights") or {}, (body or {}).get("input_activations"))
            for name, body in (qc.get("config_groups") or {}).items()]


def uniform_weights(qc: dict, packed: bool) -> dict | None:
    """The one weights description every group shares, when qc is compressed-tensors of the packed (or the
    unpacked) kind and its groups agree; else None (not this dialect's format, or groups that differ)."""
    if qc.get("quant_method") != METHOD or (qc.get("format") == PACKED) != packed:
        return None
    weights = [w for _, w, _ in groups(qc)]
    seen = {repr([w.get(k) for k in WEIGHT_KEYS]) for w in weights}   # block_structure is a list
    return weights[0] if len(seen) == 1 else None


def declares(qc: dict, kind: str, bits: int, strategy: str | None = None) -> bool:
    """Whether qc is unpacked compressed-tensors whose groups all quantize weights to `bits`-bit `kind`
    (with `strategy`, when given)."""
    w = uniform_weights(qc, packed=False)
    return (w is not None and w.get("type") == kind and w.get("num_bits") == bits
            and (strategy is None or w.get("strategy") == strategy))


def static_input(qc: dict) -> bool:
    """Whether the groups quantize activations statically (a stored input_scale per linear)."""
    return any(bool(act) and not act.get("dynamic", False) for _, _, act in groups(qc))


def summary(qc: dict) -> str:
    """What the groups declare, for the registry's refusal."""
    parts = [f"{name}: weights {w.get('num_bits')}-bit {w.get('type')} strategy {w.get('strategy')!r}"
             + (f", input_activations {'dynamic' if act.get('dynamic') else 'static'} {act.get('strategy')!r}"
                if act else "") for name, w, act in groups(qc)]
    return f"format {qc.get('format')!r}, config_groups " + ("; ".join(parts) if parts else "none")
