"""vLLM serves a checkpoint from object storage: `LLM("s3://...", load_format="distload")` against a real S3 server
(moto, tests/support/s3_server.py) gives the same greedy tokens as vLLM's own load of the same checkpoint from its
directory. vLLM pulls config and tokenizer from the store as it does for any object-storage model (Run:ai's
streamer, the `vllm` extra); distload fetches the tensors, each byte once. In the vLLM stage (scripts/vllm_stage.sh)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

from s3_checks import fetch_problems

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM is not installed in this interpreter: scripts/vllm_stage.sh runs these "
                                       "tests in a venv of its own (pip install 'distload[vllm]')")

SUPPORT = Path(__file__).resolve().parents[1] / "support"   # vllm_serve.py, vllm_probe.py
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0|1",
            "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING": "0",   # path-style requests, as moto serves them
            "PYTHONPATH": str(SUPPORT)}                       # vllm_serve.py imports vllm_probe beside it


def _serve(model: str, load_format: str, out: Path, env: dict, extra: dict) -> dict:
    cmd = [sys.executable, str(SUPPORT / "vllm_serve.py"), model, load_format, str(out), "--tokens",
           "--extra", json.dumps(extra)]
    proc = subprocess.run(cmd, env={**os.environ, **env, **VLLM_ENV}, cwd=SUPPORT, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, f"vLLM ({load_format}, {model}) exited {proc.returncode}:\n{proc.stderr[-6000:]}"
    return json.loads(out.read_text())


def test_llm_from_s3_with_distload_generates_what_the_directory_load_does(tmp_path):
    from hf_models import save_checkpoint
    from s3_server import S3Server

    ckpt = save_checkpoint("llama", tmp_path / "llama", dtype=torch.bfloat16, hidden_size=128, head_dim=32)
    prefix = f"llama-{uuid.uuid4().hex[:8]}"
    pulled = {"VLLM_ASSETS_CACHE": str(tmp_path / "vllm-assets")}   # where vLLM keeps config and tokenizer it pulled
    with S3Server() as s3:
        url = s3.upload(ckpt, "vllm-models", prefix)
        ours = _serve(url, "distload", tmp_path / "s3.json", {**s3.env(), **pulled},
                      {"report": str(tmp_path / "report.json")})
        log = s3.log
    theirs = _serve(str(ckpt), "safetensors", tmp_path / "dir.json", {}, {})
    assert len(theirs["tokens"]) == 16 and ours["tokens"] == theirs["tokens"]
    assert (next((tmp_path / "vllm-assets" / "model_streamer").iterdir()) / "config.json").exists()   # vLLM's pull
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["source"] == url and report["object_store"]["weights"]["bytes_fetched"] == report["checkpoint_bytes"]
    # each tensor byte fetched once; the headers are read by every worker, which plans before the load
    # (engines/contract.py), and by rank 0's discovery
    assert not fetch_problems(log, prefix, ckpt, tensors_only=True)
