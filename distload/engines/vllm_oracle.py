"""vLLM as the fidelity oracle of a rules file: load a checkpoint into vLLM's own model twice, with
load_format="distload" and with vLLM's default loader, and compare every param of every rank, before and after
vLLM's post-load processing (`distload rules check FILE CKPT --tp 2 --against vllm`).

Why vLLM and not a slicing of its layout written by hand: which layout is right depends on the installed vLLM (0.32
serves GPT-NeoX through its Transformers backend, cut as that model's tensor-parallel plan says; its Llama-4 permutes
q / k rows while loading), so only the installed vLLM is the oracle.

How: `tp` processes (torchrun) each join vLLM's distributed groups once, as a vLLM worker does, and then build each
case's model through vLLM's CPU model runner (its `load_model`, the path a worker takes, without an engine, a KV
cache or a tokenizer: a few seconds a load after ~20 s of imports), so one process group serves many checkpoints.
A load's params are digested (dtype, shape, sha256 of the bytes) when vLLM is about to post-process them and its
state_dict after; each rank writes its digests and the parent compares them. A case whose load fails (distload
refusing a rule, vLLM unable to build the model) is reported with its error, and the others still run.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import DistloadError

FORMATS = ("distload", "safetensors")     # distload's load, and vLLM's default loader of the same files
STAGES = ("loaded", "processed")          # before vLLM's process_weights_after_loading, and after it


@dataclass(frozen=True)
class Case:
    """One comparison: a checkpoint, the rules file distload loads it with (None: the shipped family), expert
    parallelism or not."""
    checkpoint: str
    rules: str | None = None
    ep: bool = False

    @property
    def label(self) -> str:
        rules = f" with {Path(self.rules).name}" if self.rules else ""
        return f"{Path(self.checkpoint).name}{rules}" + (" (ep)" if self.ep else "")


@dataclass
class CaseResult:
    """What the two loads held, compared: per stage the params compared and those that differ, per rank."""
    case: Case
    tp: int
    model: str = ""                          # vLLM's model class (TransformersForCausalLM: its Transformers backend)
    error: str | None = None                 # a load failed: its first line, and which loader
    compared: dict = field(default_factory=dict)     # stage -> params compared (summed over ranks)
    differ: dict = field(default_factory=dict)       # stage -> ["rank R NAME: distload ..., vLLM ..."]
    seconds: dict = field(default_factory=dict)      # format -> seconds of rank 0's load

    @property
    def ok(self) -> bool:
        return self.error is None and all(self.compared.get(s) for s in STAGES) and not any(self.differ.values())

    def lines(self) -> list[str]:
        head = f"{self.case.label} at tp {self.tp} ({self.model or 'no model'}):"
        if self.error is not None:
            return [f"{head} not compared: {self.error}"]
        out = [head + " " + "; ".join(
            f"{stage}: {self.compared.get(stage, 0)} params " +
            ("equal on every rank" if not self.differ.get(stage) else f"{len(self.differ[stage])} differ")
            for stage in STAGES)]
        for stage in STAGES:
            out += [f"  {stage}: {d}" for d in self.differ.get(stage, [])[:20]]
        return out


def compare(cases: list[Case], tp: int = 2, timeout_s: float = 1800) -> list[CaseResult]:
    """Every case on `tp` local processes of this interpreter (which must have vLLM); results in case order."""
    with tempfile.TemporaryDirectory(prefix="distload-vllm-oracle-") as tmp:
        spec = Path(tmp) / "cases.json"
        spec.write_text(json.dumps([case.__dict__ for case in cases]))
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(tp),
               "--master-port", str(_free_port()), "-m", "distload.engines.vllm_oracle", str(spec), tmp]
        # A session of its own: on a hang, its workers are killed too, not only torchrun.
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        try:
            _, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            _, err = proc.communicate()
            raise DistloadError(f"the vLLM comparison ran past {timeout_s:.0f} s and was stopped:\n{err[-3000:]}")
        ranks = [Path(tmp) / f"rank{r}.json" for r in range(tp)]
        if proc.returncode != 0 or not all(p.exists() for p in ranks):
            tail = "\n".join(err.strip().splitlines()[-15:])
            raise DistloadError(f"the vLLM comparison's processes exited {proc.returncode}:\n{tail}")
        per_rank = [json.loads(p.read_text()) for p in ranks]
    return [_compared(case, tp, [rank[i] for rank in per_rank]) for i, case in enumerate(cases)]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _compared(case: Case, tp: int, ranks: list[dict]) -> CaseResult:
    """One case's per-rank digests -> its result."""
    result = CaseResult(case, tp, model=ranks[0].get("model", ""))
    errors = [f"{fmt}: {r[fmt]['error']}" for r in ranks for fmt in FORMATS if "error" in r.get(fmt, {})]
    if errors:
        result.error = errors[0]
        return result
    result.seconds = {fmt: ranks[0][fmt]["seconds"] for fmt in FORMATS}
    for stage in STAGES:
        result.compared[stage], result.differ[stage] = 0, []
        for rank, r in enumerate(ranks):
            ours, theirs = r["distload"][stage], r["safetensors"][stage]
            result.compared[stage] += len(theirs)
            for name in sorted(set(ours) | set(theirs)):
                if ours.get(name) != theirs.get(name):
                    result.differ[stage].append(f"rank {rank} {name}: distload {_short(ours.get(name))}, "
                                                f"vLLM's loader {_short(theirs.get(name))}")
    return result


def _short(digest: str | None) -> str:
    return "absent" if digest is None else digest[:-48]   # dtype, shape and the first 16 hex digits


# -- in each process (torchrun) -----------------------------------------------------------------------------------


def digest(t) -> str:
    import torch

    t = t.detach().cpu().contiguous()
    raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return f"{t.dtype} {list(t.shape)} {hashlib.sha256(raw).hexdigest()}"


class _Snapshots:
    """Digests of a model's params at vLLM's process_weights_after_loading (looked up at call time by base_loader,
    so wrapping it there sees every loader's model), before it runs."""

    def __init__(self):
        from vllm.model_executor.model_loader import base_loader

        self.loaded: dict | None = None
        original = base_loader.process_weights_after_loading

        def digested_then_processed(model, model_config, target_device):
            self.loaded = {n: digest(p) for n, p in model.named_parameters(remove_duplicate=False)}
            return original(model, model_config, target_device)
        base_loader.process_weights_after_loading = digested_then_processed


def _engine_config(case: Case, load_format: str, tp: int):
    from vllm.engine.arg_utils import EngineArgs

    extra = {"config": case.rules} if load_format == "distload" and case.rules else {}
    return EngineArgs(model=case.checkpoint, tensor_parallel_size=tp, dtype="auto", enforce_eager=True,
                      max_model_len=128, skip_tokenizer_init=True, distributed_executor_backend="mp",
                      enable_expert_parallel=case.ep, load_format=load_format,
                      model_loader_extra_config=extra).create_engine_config()


def _join_groups(config, rank: int) -> None:
    """This process joins vLLM's groups once, as its CPU worker does (with an expert-parallel group for MoE)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.v1.worker.gpu_worker import init_worker_distributed_environment

    os.environ.setdefault("VLLM_DIST_IDENT", os.environ.get("MASTER_PORT", "distload-oracle"))
    bare = VllmConfig(parallel_config=config.parallel_config)   # no model: the EP group is made too
    with set_current_vllm_config(bare):
        init_worker_distributed_environment(bare, rank, "env://", int(os.environ.get("LOCAL_RANK", rank)), "gloo")


def _load(case: Case, load_format: str, tp: int, rank: int, snapshots: _Snapshots, joined: list) -> dict:
    """One load of one case on this rank: its model class and digests, or the error it raised."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    start = time.perf_counter()
    try:
        config = _engine_config(case, load_format, tp)
        if not joined:
            _join_groups(config, rank)
            joined.append(True)
        snapshots.loaded = None
        with set_current_vllm_config(config):
            runner = CPUModelRunner(config, torch.device("cpu"))
            runner.load_model()
        model = runner.model
        out = {"model": type(model).__name__, "loaded": snapshots.loaded or {},
               "processed": {n: digest(t) for n, t in model.state_dict().items()},
               "seconds": round(time.perf_counter() - start, 3)}
        del model, runner
    except Exception as exc:   # reported per case; the other cases still run
        out = {"error": f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"}
    gc.collect()
    return out


def worker(cases_file: str, out_dir: str) -> None:
    """This rank's loads of every case, both formats, written to OUT/rank{R}.json."""
    from .vllm import register

    register()
    rank, tp = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    snapshots, joined, results = _Snapshots(), [], []
    for raw in json.loads(Path(cases_file).read_text()):
        case = Case(**raw)
        loads = {fmt: _load(case, fmt, tp, rank, snapshots, joined) for fmt in FORMATS}
        model = next((r["model"] for r in loads.values() if "model" in r), "")
        results.append({"model": model, **loads})
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="one rank of the vLLM comparison (run by compare() under torchrun)")
    parser.add_argument("cases")
    parser.add_argument("out")
    args = parser.parse_args(argv)
    worker(args.cases, args.out)


if __name__ == "__main__":
    main()
