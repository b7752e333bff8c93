"""Reference tensor-parallel forward over the serving layout, used to verify loaded shards.

`forward_for(config)` picks the forward for a config.json: families whose blocks differ from the Llama-like
decoder (MLA, sinks, linear attention) have their own module, listed in FORWARDS by model_type and imported
only when asked for; every forward takes the arguments of `forward.forward`.
"""

import importlib

from distload.models.forward import FAMILIES, Family, family_of, forward

# model_type -> "module:function" under distload.models, for forwards other than forward.forward.
FORWARDS: dict[str, str] = {
    "deepseek_v2": "deepseek:forward",
    "deepseek_v3": "deepseek:forward",
    "glm4_moe": "glm4_moe:forward",
    "gpt_oss": "gpt_oss:forward",
    "qwen3_next": "qwen3_next:forward",
}


def forward_for(config: dict):
    """The forward function for this config.json (forward.forward unless FORWARDS names another)."""
    target = FORWARDS.get(config.get("model_type"))
    if target is None:
        return forward
    module, name = target.split(":")
    return getattr(importlib.import_module(f"distload.models.{module}"), name)


__all__ = ["FAMILIES", "FORWARDS", "Family", "family_of", "forward", "forward_for"]
