"""`distload verify --dequantize` for the packed 4-bit formats (issue 23) and the per-channel FP8 / INT8 W8A8 ones
(issue 37): each rank dequantizes the shards it loaded and runs the reference TP forward; the reference is
transformers on a plain checkpoint written here from the tests' own dequantization (tests/quant4_reference.py,
tests/channel_checkpoints.py) of the full tensors, passed as `reference=`.

One gloo world of 2 ranks verifies every case (the tiny Llama in each format, the wide Llama for bitsandbytes'
64-value blocks, and Qwen3-MoE in one format), each through distload.verify.verify as the CLI calls it.
"""

from __future__ import annotations

import pytest
import torch

import channel_checkpoints as cc
import quant4_checkpoints as q4
from hf_models import checkpoint_tensors, read_config, save_checkpoint
from spawn import run_ranks

TOL = 2e-2
INPUT_IDS = [1, 17, 42, 7, 249, 0, 128, 63]
CASES = [("llama", "gptq"), ("llama", "gptq-act"), ("llama", "awq"), ("llama", "ct"), ("llama", "ct-asym"),
         ("llama", "nvfp4"), ("llama-wide", "bnb"), ("llama-wide", "bnb-nested"), ("qwen3-moe", "awq"),
         ("llama", "fp8-channel"), ("llama", "int8-channel"), ("qwen3-moe", "fp8-channel"), ("qwen3-moe", "int8-channel")]
CHANNEL = {"fp8-channel": "fp8", "int8-channel": "int8"}   # channel_checkpoints.py's kinds


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> list[tuple[str, str, str]]:
    """(case id, packed checkpoint, reference checkpoint) per case."""
    root = tmp_path_factory.mktemp("verify4")
    models = {"llama": save_checkpoint("llama", root / "llama", dtype=torch.bfloat16),
              "llama-wide": save_checkpoint("llama", root / "llama-wide", dtype=torch.bfloat16, hidden_size=256,
                                            intermediate_size=512, max_shard_size="1MB"),
              "qwen3-moe": save_checkpoint("qwen3_moe", root / "qwen3-moe", dtype=torch.bfloat16)}
    out = []
    for model, fmt in CASES:
        case = f"{model}-{fmt}"
        if fmt in CHANNEL:
            packed = cc.channel_checkpoint(models[model], root / case, CHANNEL[fmt])
            plain = cc.dequantized(checkpoint_tensors(packed))
        else:
            packed = q4.packed_checkpoint(models[model], root / case, fmt)
            plain = q4.dequantized(checkpoint_tensors(packed), fmt)
        # in BF16, what --dequantize makes of the reference values: the check is the layout, not the rounding
        reference = q4.write_plain(plain, read_config(packed), root / f"{case}-reference", dtype=torch.bfloat16)
        out.append((case, str(packed), str(reference)))
    return out


def _verify_all(cases) -> list[tuple[str, object]]:
    from distload.verify import verify

    torch.set_num_threads(1)
    return [(case, verify(packed, input_ids=INPUT_IDS, tolerance=TOL, reference=reference, dequantize=True, tp=2,
                          progress=False).verdict) for case, packed, reference in cases]


def test_verify_dequantize_matches_transformers_at_tp2(cases):
    per_rank = run_ranks(2, _verify_all, cases)
    assert per_rank[0] == per_rank[1]   # every rank returns rank 0's verdict
    failed = [f"{case}: {v.message}" for case, v in per_rank[0] if not (v.compared and v.ok)]
    assert not failed, "\n".join(failed)
    # both sides compute on the same BF16 values: only summation order differs
    assert all(v.max_rel < 1e-4 and v.argmax_same for _, v in per_rank[0]), [(c, v.max_rel) for c, v in per_rank[0]]
