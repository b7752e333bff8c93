"""An RL loop refits a running vLLM instance with weight_transfer_config={"backend": "distload"}: a trainer job
(torchrun, 2 ranks, an FSDP2 Llama with new weights; tests/support/vllm_refit_job.py) drives LLM(... tp 2, CPU ...)
through vLLM's init_weight_transfer_engine / start_weight_update / update_weights / finish_weight_update. After the
refit the instance generates the greedy tokens a fresh vLLM load (vLLM's own safetensors loader) of the trainer's
new weights, saved as a checkpoint, generates, and not those of before. Two instances in all: each costs minutes.
Runs in the vLLM stage's venv (scripts/vllm_stage.sh)."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM is not installed in this interpreter: scripts/vllm_stage.sh runs "
                                       "these tests in a venv of their own (pip install 'distload[vllm]')")

HERE = Path(__file__).resolve().parents[1] / "support"
SIZES = dict(hidden_size=128, head_dim=32)   # vLLM's CPU attention takes head_dim 32 and up
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0|1"}


def run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    """`cmd` with the vLLM stage's environment, killed with all it started on a hang."""
    path = os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH", "")) if p)
    proc = subprocess.Popen(cmd, cwd=HERE, env={**os.environ, **VLLM_ENV, "PYTHONPATH": path}, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{' '.join(cmd[:4])} hung for {timeout} s:\n{err[-6000:]}")
    assert proc.returncode == 0, f"{' '.join(cmd[:4])} exited {proc.returncode}:\n{err[-8000:]}"
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


@needs_vllm
def test_trainer_job_refits_a_running_instance(tmp_path):
    from hf_models import save_checkpoint
    from spawn import free_port

    old = save_checkpoint("llama", tmp_path / "old", dtype=torch.bfloat16, **SIZES)
    new, tokens = tmp_path / "new", tmp_path / "tokens.json"
    run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(HERE / "vllm_refit_job.py"), str(old), str(new), f"tcp://127.0.0.1:{free_port()}", str(tokens)],
        timeout=900)
    refit = json.loads(tokens.read_text())
    fresh = tmp_path / "fresh.json"
    run([sys.executable, str(HERE / "vllm_serve.py"), str(new), "safetensors", str(fresh), "--tokens"], timeout=900)
    expected = json.loads(fresh.read_text())["tokens"]
    assert len(expected) == len(refit["after"]) == 16
    assert refit["after"] == expected
    assert refit["before"] != expected, "the new weights generate what the old did: the test shows nothing"
