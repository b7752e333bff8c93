"""Issue 35: a trainer job and a serving job (two real torchruns) joined by distload.join_refit; after a refit
every serving rank's params equal a fresh distload.load of the trainer's new weights saved as a checkpoint."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from hf_models import save_checkpoint
from moe_checks import expected_hosts
from spawn import free_port

CASES = Path(__file__).resolve().parents[1] / "support" / "refit_cases.py"


def _torchrun(nproc: int, role: str, cases: Path, out: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--rdzv-backend", "c10d", "--rdzv-endpoint",
           f"127.0.0.1:{free_port()}", "--nproc-per-node", str(nproc), str(CASES), "--role", role,
           "--cases", str(cases), "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_fsdp2_on_4_ranks_refits_tp2_serving_exactly(tmp_path):
    """An FSDP2 trainer job on 4 ranks and a serving job at tp 2 (two torchruns), untied and tied Llama in one
    launch each: the tied case sends embed_tokens once and it lands as both the embedding and lm_head."""
    cases = []
    for family in ("llama", "llama_mqa_tied"):
        old = save_checkpoint(family, tmp_path / f"{family}-old", seed=0)
        new = save_checkpoint(family, tmp_path / f"{family}-new", seed=1)
        cases.append({"name": f"fsdp4_{family}_tp2", "old": str(old), "new": str(new), "trainer": "fsdp",
                      "trainers": 4, "serving": {"tp": 2}, "port": free_port(), "dtype": "float32",
                      "versions": [5, 6]})   # given by the trainer: every trainer rank passes it
    path = tmp_path / "cases.json"
    path.write_text(json.dumps(cases))
    out = tmp_path / "out"
    out.mkdir()
    jobs = [_torchrun(2, "serving", path, out), _torchrun(4, "trainer", path, out)]
    logs = [j.communicate(timeout=300)[0] for j in jobs]
    assert all(j.returncode == 0 for j in jobs), "\n".join(logs)
    for case in cases:
        for rank in range(2):
            got = json.loads((out / f"{case['name']}.serving.{rank}.json").read_text())
            assert got["differ"] == [] and got["version"] == 6, (case["name"], rank, got["differ"][:5])
            for report in got["reports"]:
                assert report["bytes_received"] <= 1.02 * report["own_shard_bytes"], (case["name"], report)
        sent = [json.loads((out / f"{case['name']}.trainer.{t}.json").read_text()) for t in range(4)]
        assert all(r["bytes_sent"] > 0 for got in sent for r in got["reports"]), case["name"]


def test_trainer_layouts_refit_serving_layouts_exactly(tmp_path):
    """One 4-rank trainer job and one 4-rank serving job, every case in sequence: FSDP2 -> tp 4 (tied MQA Llama,
    in place, into params whose vocab padding rows hold NaN, as an engine's receive buffers do); DDP on 2 ranks -> tp 2 x pp 2 (each stage receives only its layers); FSDP2 + TP 2 (dp 2 x tp 2,
    _StridedShard placements, the vocab split unevenly) -> tp 4; Qwen3-MoE FSDP2 (stacked experts, one per
    trainer rank) -> tp 2 ep 2, each serving rank receiving only its experts; a BF16 FSDP2 trainer -> tp 4
    quantized to FP8 blocks on the receiving ranks, bitwise a fresh load with the same quantize; the same trainer ->
    tp 2 x pp 2 quantized to per-tensor FP8 (fused params requantized with one scale across their parts)."""
    ckpts = {}
    for family, dtype in (("llama", torch.float32), ("llama_mqa_tied", torch.float32), ("qwen3_moe", torch.float32),
                          ("llama", torch.bfloat16)):
        key = f"{family}-{str(dtype)[6:]}"
        ckpts[key] = (save_checkpoint(family, tmp_path / f"{key}-old", seed=0, dtype=dtype),
                      save_checkpoint(family, tmp_path / f"{key}-new", seed=1, dtype=dtype))
    cases = [
        {"name": "fsdp_tied_tp4_in_place", "ckpt": "llama_mqa_tied-float32", "trainer": "fsdp", "trainers": 4,
         "serving": {"tp": 4}, "staged": False, "garbage_padding": True},
        {"name": "ddp_tp2_pp2", "ckpt": "llama-float32", "trainer": "ddp", "trainers": 2,
         "serving": {"tp": 2, "pp": 2}},
        {"name": "fsdp_tp2_tp4", "ckpt": "llama-float32", "trainer": "fsdp_tp", "trainers": 4, "serving": {"tp": 4}},
        {"name": "moe_fsdp_tp2_ep2", "ckpt": "qwen3_moe-float32", "trainer": "fsdp", "trainers": 4,
         "serving": {"tp": 2, "ep": 2}},
        {"name": "bf16_fsdp_fp8_block_tp4", "ckpt": "llama-bfloat16", "trainer": "fsdp", "trainers": 4,
         "serving": {"tp": 4, "quantize": "fp8-block"}, "dtype": "bfloat16"},
        {"name": "bf16_fsdp_fp8_tensor_tp2_pp2", "ckpt": "llama-bfloat16", "trainer": "fsdp", "trainers": 4,
         "serving": {"tp": 2, "pp": 2, "quantize": "fp8"}, "dtype": "bfloat16"},
    ]
    for case in cases:
        old, new = ckpts[case.pop("ckpt")]
        case.update(old=str(old), new=str(new), port=free_port())
        case.setdefault("dtype", "float32")
    path = tmp_path / "cases.json"
    path.write_text(json.dumps(cases))
    out = tmp_path / "out"
    out.mkdir()
    jobs = [_torchrun(4, "serving", path, out), _torchrun(4, "trainer", path, out)]
    logs = [j.communicate(timeout=600)[0] for j in jobs]
    assert all(j.returncode == 0 for j in jobs), "\n".join(logs)
    for case in cases:
        for rank in range(4):
            got = json.loads((out / f"{case['name']}.serving.{rank}.json").read_text())
            assert got["differ"] == [] and got["version"] == 2, (case["name"], rank, got["differ"][:5])
            # a quantized rank keeps FP8; what it receives is its shard as the update carries it (BF16)
            own = got["update_shard_bytes"] or got["reports"][0]["own_shard_bytes"]
            for report in got["reports"]:
                assert 0 < report["bytes_received"] <= 1.02 * own, (case["name"], report, own)
    # Expert-aware routing: trainer rank t holds expert t of every layer; it sends expert bytes only to the
    # serving ranks hosting that expert (tp 2 ep 2 over 4 ranks: experts 0, 1 on ranks 0, 1; 2, 3 on 2, 3).
    received: dict[int, set] = {s: set() for s in range(4)}
    for t in range(4):
        sent = json.loads((out / f"moe_fsdp_tp2_ep2.trainer.{t}.json").read_text())["experts_sent"]
        for s, ids in sent.items():
            received[int(s)].update(ids)
    assert received == {s: set(ids) for s, ids in enumerate(expected_hosts(4, 4, 2))}, received
