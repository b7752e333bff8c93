"""vLLM serves what distload loads: load_format="distload" against vLLM's own safetensors load.

Each end-to-end case runs this file as a script (vLLM's workers are processes; its `LLM` must be built
under `if __name__ == "__main__":`), once per load format, and compares what the workers held. A probe
(StateProbe, vLLM's worker_extension_cls) hashes every param just before vLLM's post-load processing and
the whole state_dict after it: on CPU the linear weights move into oneDNN handles there, so the first
snapshot is the one that shows every loaded byte. Run with /work/vllm-env/bin/python -m pytest.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402

HERE = Path(__file__).resolve().parent
PROMPT = [1, 17, 42, 99, 7, 3, 150, 64]
STEPS = 16
SIZES = dict(hidden_size=128, head_dim=32)  # vLLM's CPU attention takes head_dim 32 and up
PROBE_ENV = "DISTLOAD_VLLM_PROBE"


def tensor_digest(t: torch.Tensor) -> str:
    t = t.detach().cpu().contiguous()
    raw = t.reshape(-1).view(torch.uint8)
    return f"{t.dtype} {list(t.shape)} {hashlib.sha256(raw.numpy().tobytes()).hexdigest()}"


_snapshots: dict[str, dict[str, str]] = {}


def _install_probe() -> None:
    """Hash the loaded params right before vLLM's post-load processing (in each worker)."""
    from vllm.model_executor.model_loader import base_loader

    original = base_loader.process_weights_after_loading
    if getattr(original, "distload_probe", False):
        return

    def hashed_then_processed(model, model_config, target_device):
        _snapshots["loaded"] = {n: tensor_digest(p) for n, p in model.named_parameters(remove_duplicate=False)}
        return original(model, model_config, target_device)

    hashed_then_processed.distload_probe = True
    base_loader.process_weights_after_loading = hashed_then_processed


if os.environ.get(PROBE_ENV) == "1":  # imported by a vLLM worker as its worker_extension_cls module
    _install_probe()


class StateProbe:
    """Mixed into vLLM's worker class: returns what the worker's model held."""

    def distload_probe_state(self) -> dict:
        model = self.model_runner.model
        return {"loaded": _snapshots.get("loaded", {}),
                "processed": {n: tensor_digest(t) for n, t in model.state_dict().items()}}


def serve_once(ckpt: str, load_format: str, ep: bool, generate: bool, out: str, report: str | None) -> None:
    """Script mode: one vLLM instance at tp 2; writes the workers' snapshots, tokens and timings to `out`."""
    from vllm import LLM, SamplingParams

    extra = {"report": report} if report and load_format == "distload" else {}
    start = time.perf_counter()
    llm = LLM(ckpt, tensor_parallel_size=2, dtype="bfloat16", enforce_eager=True, max_model_len=128,
              distributed_executor_backend="mp", skip_tokenizer_init=True, enable_expert_parallel=ep,
              load_format=load_format, model_loader_extra_config=extra,
              worker_extension_cls="test_vllm.StateProbe")
    startup = time.perf_counter() - start
    result = {"startup_s": startup, "ranks": llm.collective_rpc("distload_probe_state")}
    if generate:
        params = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)
        result["tokens"] = list(outputs[0].outputs[0].token_ids)
    Path(out).write_text(json.dumps(result))


def run_vllm(ckpt: Path, load_format: str, tmp: Path, ep: bool = False, generate: bool = True) -> dict:
    out, report = tmp / f"{load_format}-{ep}.json", tmp / f"report-{ep}.json"
    env = {**os.environ, PROBE_ENV: "1", "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
           "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    cmd = [sys.executable, __file__, str(ckpt), load_format, str(int(ep)), str(int(generate)), str(out), str(report)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise AssertionError(f"vLLM ({load_format}) exited {proc.returncode}:\n{proc.stderr[-6000:]}")
    result = json.loads(out.read_text())
    result["stderr"] = proc.stderr
    if load_format == "distload":
        result["report"] = json.loads(report.read_text())
    return result


def assert_same_state(ours: dict, theirs: dict) -> None:
    for rank, (mine, ref) in enumerate(zip(ours["ranks"], theirs["ranks"])):
        for stage in ("loaded", "processed"):
            assert mine[stage], f"rank {rank}: no {stage} snapshot"
            assert mine[stage].keys() == ref[stage].keys(), f"rank {rank} {stage}: different names"
            differ = sorted(n for n in ref[stage] if mine[stage][n] != ref[stage][n])
            assert not differ, f"rank {rank} {stage}: params differ: {differ[:10]}"


def assert_read_once(result: dict) -> None:
    report = result["report"]
    assert report["ok"], report["verdict"]
    assert report["storage_bytes_read"] == report["checkpoint_bytes"], report


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from hf_models import save_checkpoint

    root = tmp_path_factory.mktemp("vllm_ckpts")
    return lambda family: save_checkpoint(family, root / family, dtype=torch.bfloat16, **SIZES)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_dense_tp2_state_and_tokens(family, checkpoints, tmp_path):
    ckpt = checkpoints(family)
    ours, theirs = run_vllm(ckpt, "distload", tmp_path), run_vllm(ckpt, "safetensors", tmp_path)
    assert_same_state(ours, theirs)
    assert len(theirs["tokens"]) == STEPS
    assert ours["tokens"] == theirs["tokens"]
    assert_read_once(ours)


@pytest.mark.parametrize("family,ep", [("mixtral", False), ("mixtral", True), ("qwen3_moe", False)])
def test_moe_tp2_state(family, ep, checkpoints, tmp_path):
    ckpt = checkpoints(family)  # no tokens: vLLM's CPU fused-MoE kernel crashes generating with EP
    ours = run_vllm(ckpt, "distload", tmp_path, ep=ep, generate=False)
    theirs = run_vllm(ckpt, "safetensors", tmp_path, ep=ep, generate=False)
    assert_same_state(ours, theirs)
    assert_read_once(ours)


if __name__ == "__main__":
    path, fmt, with_ep, with_tokens, out_file, report_file = sys.argv[1:7]
    serve_once(path, fmt, with_ep == "1", with_tokens == "1", out_file, report_file)
