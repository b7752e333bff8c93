"""Cases: a config.json that lies about the model, and rules files that are not there."""

from __future__ import annotations

from .case import Case
from .st_files import DROP, edit_config


def _config(**changes):
    def build(ckpt, ws):
        edit_config(ckpt, **changes)
        return [str(ckpt)]
    return build


def _config_text(text):
    def build(ckpt, ws):
        (ckpt / "config.json").write_text(text)
        return [str(ckpt)]
    return build


def _rules(text):
    def build(ckpt, ws):
        rules = ws / "rules.toml"
        if text is not None:
            rules.write_text(text)
        return [str(ckpt), "--config", str(rules)]
    return build


CASES = [
    Case("config-hidden-512", _config(hidden_size=512), names=("hidden_size",)),
    Case("config-layers-200000", _config(num_hidden_layers=200000), names=("num_hidden_layers",)),
    Case("config-heads-16", _config(num_attention_heads=16), names=("num_attention_heads",)),
    Case("config-intermediate-1024", _config(intermediate_size=1024), names=("intermediate_size",)),
    Case("config-hidden-string", _config(hidden_size="256"), names=("hidden_size",)),
    Case("config-heads-negative", _config(num_attention_heads=-8), names=("num_attention_heads",)),
    Case("config-architecture-unknown", _config(architectures=["FooForCausalLM"]), names=("FooForCausalLM",)),
    Case("config-not-json", _config_text('{"architectures": ['), names=("config.json",)),
    Case("rules-file-missing", _rules(None), names=("rules.toml",)),
]

# Further cases of the same kinds: `python -m tests.support.hostile --all` runs them too (kept out of the suite's time).
EXTRA = [
    Case("config-layers-3", _config(num_hidden_layers=3), names=("model.layers.3",)),
    Case("config-heads-7", _config(num_attention_heads=7), names=("num_attention_heads",)),
    Case("config-kv-heads-4", _config(num_key_value_heads=4), names=("num_key_value_heads",)),
    Case("config-head-dim-64", _config(head_dim=64), names=("head_dim",)),
    Case("config-architectures-missing", _config(architectures=DROP, model_type=DROP), names=("architectures",)),
    Case("config-vocab-2000", _config(vocab_size=2000), names=("vocab_size",)),
    Case("config-heads-zero", _config(num_attention_heads=0), names=("num_attention_heads",)),
    Case("config-layers-null", _config(num_hidden_layers=None), names=("num_hidden_layers",)),
    Case("config-array", _config_text("[1, 2]"), names=("config.json",)),
    Case("rules-file-not-toml", _rules("family = [unclosed"), names=("rules.toml",)),
]
