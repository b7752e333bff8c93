"""join_refit's serving side takes its layout from the rank / world it is given, not from torchrun's environment:
an engine's workers (vLLM's server) have none, and an instance inside a trainer's torchrun has the trainer's."""

from __future__ import annotations

import os

import pytest

import distload
from distload.errors import DistloadError
from spawn import free_port

CONFIG = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
          "tie_word_embeddings": False}


TRAINER_ENV = {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "4"}


@pytest.mark.parametrize("env,tp,refusal", [
    ({}, 2, "nobody answered"),                          # from the (empty) environment: world 1, and tp 2 refused
    (TRAINER_ENV, 4, "--tp 4 must divide the world size 2"),   # from the trainer's: world 4, and tp 4 taken
])
def test_serving_layout_is_the_given_rank_and_world(monkeypatch, env, tp, refusal):
    """Serving rank 1 of world 2 as given; nobody hosts the address, so a layout that plans fails at the
    rendezvous ("nobody answered") and one that does not is refused before it."""
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(DistloadError, match=refusal):
        distload.join_refit(f"tcp://127.0.0.1:{free_port()}", role="serving", target={}, config=CONFIG, tp=tp,
                            rank=1, world=2, timeout=0.5)
    assert {k: os.environ.get(k) for k in env} == env   # the environment is restored
