"""Reference tensor-parallel forward over the serving layout, used to verify loaded shards.

`forward_for(config)` picks the forward for a config.json: families whose blocks differ from the Llama-like
decoder (MLA, sinks, linear attention) have their own module, listed in FORWARDS by model_type and imported
only when asked for; every forward takes the arguments of `forward.forward`.
"""

import importlib

from distload.errors import DistloadError
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


def check_reference(config: dict, family: str) -> None:
    """DistloadError, before any load, when no reference forward knows this config.json (`family`: its rules)."""
    if config.get("model_type") in FORWARDS:
        return
    try:
        family_of(config)
    except DistloadError:
        known = ", ".join(sorted(set(FAMILIES) | set(FORWARDS)))
        raise DistloadError(f"verify: family {family} (model_type {config.get('model_type')!r}) has no reference "
                            f"forward (it knows {known}); compare the load with vLLM's own loader instead: python -m "
                            f"distload rules check auto CKPT --tp 2 --against vllm (where vLLM is installed)") from None


__all__ = ["FAMILIES", "FORWARDS", "Family", "check_reference", "family_of", "forward", "forward_for"]
