"""Pipeline-stage cases shared by the pipeline tests: families and layer counts, the stage cases per family,
the tiny checkpoints (a fixture), each stage's expected shards."""

from __future__ import annotations

import re

import pytest
from hf_models import save_checkpoint

LAYERS = 5

FAMILIES = ("llama", "llama_mqa_tied", "phi3", "qwen3_moe", "gpt2")

CASES = [
    (2, 2, 1, None, None, [(0, 3), (3, 5)]),          # 5 on 2: 2 each, the remainder to the stage before the last
    (1, 4, 1, None, None, [(0, 1), (1, 2), (2, 4), (4, 5)]),
    (2, 2, 1, (1, 4), None, [(0, 1), (1, 5)]),        # --pp-layers
    (1, 4, 1, None, "2,1,1,1", [(0, 2), (2, 3), (3, 4), (4, 5)]),   # VLLM_PP_LAYER_PARTITION
]

MOE_CASES = [(2, 2, 2, None, None, [(0, 3), (3, 5)]), (2, 2, 1, None, None, [(0, 3), (3, 5)])]

CASES_OF = {"qwen3_moe": MOE_CASES, "gpt2": CASES[:2]}   # GPT-2: tied, learned positions, weights stored [in, out]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline")
    return {fam: str(save_checkpoint(fam, root / fam, num_hidden_layers=LAYERS)) for fam in FAMILIES}


def on_stage(name: str, stage: int, pp: int, layers: tuple[int, int], tied: bool) -> bool:
    """Does stage `stage` of `pp` (holding decoder layers [layers)) build param `name`, as vLLM does?"""
    m = re.match(r"(model\.layers|transformer\.h)\.(\d+)\.", name)
    if m:
        return layers[0] <= int(m.group(2)) < layers[1]
    if name in ("model.embed_tokens.weight", "transformer.wte.weight"):
        return stage == 0 or (tied and stage == pp - 1)
    if name == "transformer.wpe.weight":
        return stage == 0
    return stage == pp - 1       # model.norm, transformer.ln_f, lm_head


def expected_shards(hf: dict, config: dict, rank: int, tp: int, pp: int, ep: int, ranges: list) -> dict:
    """Rank's shards: the oracle's tp cut (experts: the stage's dp x tp ranks in ep groups), kept to its stage."""
    from layout_oracle import serving_shards

    stage, t = (rank // tp) % pp, rank % tp
    in_stage = (rank // (pp * tp)) * tp + t
    stage_world = 4 // pp
    experts = config.get("num_experts")
    ids = None
    if experts:
        group = in_stage // (stage_world // ep)
        ids = list(range(group * experts // ep, (group + 1) * experts // ep))
    assert not experts or stage_world == tp   # the cases: one dp copy per stage, so the oracle's ep groups apply
    shards = serving_shards(hf, config, t, tp, ep, ids)
    tied = bool(config.get("tie_word_embeddings"))
    return {n: v for n, v in shards.items() if on_stage(n, stage, pp, ranges[stage], tied)}


def cases_for(family: str) -> list:
    return CASES_OF.get(family, CASES)
