"""Per-channel FP8 and INT8 W8A8 through the CLI (issue 37), under real torchrun: `distload verify --dequantize
--reference BF16_DIR` agrees with transformers on the BF16 checkpoint of what --dequantize makes, and
`distload load --quantize fp8-channel` quantizes a BF16 checkpoint on each rank.

Checkpoints: tests/support/channel_checkpoints.py (its own quantizer); the reference BF16 directory is its
dequantization of the full tensors, written for transformers (tests/support/quant4_checkpoints.write_plain).
"""

from __future__ import annotations

import json
import re

import pytest
import torch

import channel_checkpoints as cc
from hf_models import checkpoint_tensors, read_config, save_checkpoint
from jobs import torchrun, torchrun_verify
from quant4_checkpoints import write_plain

TOKENS = "1,17,42,7,249,0,128,63"
CASES = [("llama", "fp8", 2, 1), ("qwen3_moe", "int8", 2, 2)]   # (family, kind, tp, ep)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("verify-channel")
    out = {}
    for family in {c[0] for c in CASES}:
        out[family] = save_checkpoint(family, root / family, dtype=torch.bfloat16)
    for family, kind, _, _ in CASES:
        quantized = cc.channel_checkpoint(out[family], root / f"{family}-{kind}", kind)
        reference = write_plain(cc.dequantized(checkpoint_tensors(quantized)), read_config(quantized),
                                root / f"{family}-{kind}-reference", dtype=torch.bfloat16)
        out[family, kind] = (quantized, reference)
    return out


@pytest.mark.parametrize("family,kind,tp,ep", CASES, ids=[f"{f}-{k}-tp{t}-ep{e}" for f, k, t, e in CASES])
def test_torchrun_verify_dequantize_matches_transformers(checkpoints, family, kind, tp, ep):
    quantized, reference = checkpoints[family, kind]
    proc = torchrun_verify(tp, str(quantized), "--tp", str(tp), "--ep", str(ep), "--dequantize", "--reference",
                           str(reference), "--input-ids", TOKENS)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    m = re.search(r"max rel err ([0-9.e+-]+) \(.*argmax same: (True|False)", proc.stdout)
    assert m and float(m.group(1)) < 1e-4 and m.group(2) == "True", proc.stdout   # the same BF16 values
    assert "distload verify: OK" in proc.stdout


def test_torchrun_load_quantize_fp8_channel(checkpoints, tmp_path):
    report = tmp_path / "r.json"
    proc = torchrun(2, "load", str(checkpoints["llama"]), "--tp", "2", "--quantize", "fp8-channel", "--report",
                    str(report), "--no-progress")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    got = json.loads(report.read_text())
    assert got["ok"] and got["quantization"] == "fp8-channel (--quantize fp8-channel)", got["quantization"]
    assert all(r["post_steps"] == 4 * read_config(checkpoints["llama"])["num_hidden_layers"] for r in got["per_rank"])
