"""An RL loop refits a running vLLM instance with weight_transfer_config={"backend": "distload"}: a trainer job
(torchrun, 2 ranks, an FSDP2 Llama with new weights; tests/support/vllm_refit_job.py) drives LLM(... tp 2, CPU ...)
through vLLM's init_weight_transfer_engine / start_weight_update / update_weights / finish_weight_update; another
drives vLLM's OpenAI server (the README's command, tp 2, mp workers) through the same protocol's HTTP endpoints with
vLLM's own HTTP client. After the refit each generates the greedy tokens a fresh vLLM load (vLLM's own safetensors
loader) of the trainer's new weights, saved as a checkpoint, generates, and not those of before. One fresh load for
both (each instance costs minutes). Runs in the vLLM stage's venv (scripts/vllm_stage.sh)."""

from __future__ import annotations

import contextlib
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
    finally:   # whatever of its tree outlived it (or an interrupted test), as on a hang
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, f"{' '.join(cmd[:4])} exited {proc.returncode}:\n{err[-8000:]}"
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def same_weights(a: Path, b: Path) -> bool:
    """Two checkpoints' tensors are bitwise the same (the jobs' new weights are the fixture's, not just alike)."""
    from safetensors.torch import load_file

    def tensors(ckpt: Path) -> dict:
        return {k: v for f in sorted(ckpt.glob("*.safetensors")) for k, v in load_file(f).items()}

    ours, theirs = tensors(a), tensors(b)
    return sorted(ours) == sorted(theirs) and all(torch.equal(ours[n], theirs[n]) for n in theirs)


@pytest.fixture(scope="module")
def refit_case(tmp_path_factory) -> dict:
    """The old checkpoint (with a tokenizer, for the server), the trainer's new weights saved (what every trainer
    job computes: vllm_refit_job.trained_model) and a fresh vLLM load's greedy tokens of them."""
    from hf_models import save_checkpoint
    from vllm_http import add_tokenizer
    from vllm_refit_job import trained_model

    base = tmp_path_factory.mktemp("refit")
    old = add_tokenizer(save_checkpoint("llama", base / "old", dtype=torch.bfloat16, **SIZES))
    trained_model(str(old)).save_pretrained(base / "new")
    run([sys.executable, str(HERE / "vllm_serve.py"), str(base / "new"), "safetensors", str(base / "fresh.json"),
         "--tokens"], timeout=900)
    expected = json.loads((base / "fresh.json").read_text())["tokens"]
    assert len(expected) == 16
    state = [r["processed"] for r in json.loads((base / "fresh.json").read_text())["ranks"]]
    return {"old": old, "new": base / "new", "expected": expected, "state": state}


def trainer_job(old: Path, new: Path, *mode: str) -> None:
    from spawn import free_port

    run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(HERE / "vllm_refit_job.py"), str(old), str(new), f"tcp://127.0.0.1:{free_port()}", *mode], timeout=900)


@needs_vllm
def test_trainer_job_refits_a_running_instance(refit_case, tmp_path):
    trainer_job(refit_case["old"], tmp_path / "new", "--tokens", str(tmp_path / "tokens.json"))
    assert same_weights(tmp_path / "new", refit_case["new"])
    refit = json.loads((tmp_path / "tokens.json").read_text())
    assert refit["after"] == refit_case["expected"]
    assert refit["before"] != refit_case["expected"], "the new weights generate what the old did: the test shows nothing"
    # vLLM's state (post-processed, per worker) after the refit is a fresh vLLM load's of the new checkpoint
    fresh = refit_case["state"]
    assert len(fresh) == len(refit["state_after"]) == 2
    for worker, (got, want) in enumerate(zip(refit["state_after"], fresh)):
        assert got.keys() == want.keys(), (worker, sorted(got.keys() ^ want.keys())[:5])
        differ = sorted(n for n in want if got[n] != want[n])
        assert not differ, f"worker {worker}: {len(differ)} tensor(s) differ from a fresh load, e.g. {differ[:5]}"
        assert any(refit["state_before"][worker][n] != want[n] for n in want), "the refit changed no tensor"


@needs_vllm
def test_trainer_job_refits_the_openai_server_over_http(refit_case, tmp_path):
    """The README's server command with the backend (<!-- block: vllm-serve-refit -->; plus a port, --enforce-eager,
    --max-model-len and mp workers), stopped with everything it started however the test ends."""
    from readme_blocks import command
    from vllm_http import Server
    from vllm_refit_job import PROMPT

    server = Server(f"{command('vllm-serve-refit')} --distributed-executor-backend mp", refit_case["old"], tmp_path)
    try:
        server.start().wait_ready()
        before = server.greedy_ids(PROMPT)
        trainer_job(refit_case["old"], tmp_path / "new", "--server", server.url)
        after = server.greedy_ids(PROMPT)
        version = server.get("/weight_info")["weight_version"]
    except BaseException:
        print(f"the server's last lines:\n{server.tail(80)}")   # pytest shows them with the failure
        raise
    finally:
        server.stop()
    assert same_weights(tmp_path / "new", refit_case["new"])
    assert after == refit_case["expected"]
    assert before != refit_case["expected"], "the new weights generate what the old did: the test shows nothing"
    assert version == "1", version   # finish_weight_update's, from the trainer's step
