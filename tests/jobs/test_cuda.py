"""On a GPU: the CUDA / NCCL path end to end (skipped without one; scripts/gpu_check.sh runs it on a lent GPU).

What a CPU machine cannot check: params land on the device through pinned staging buffers and NCCL, the
post-load steps run as compiled Triton kernels, the report measures device memory. The reference is the
CPU / gloo path of the same loads (checked against transformers' own tensors by the rest of the suite): each
load on the GPU (one NCCL rank) must give bit for bit what the same load gives on the CPU (one gloo rank),
FP8 requantization, online quantization and dequantization included (the Triton kernels equal their torch
references bit for bit: tests/test_kernels.py). Plain loads are also compared with tests/layout_oracle.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from checks import differences, module_from_specs
from hf_models import DENSE, MOE, checkpoint_tensors, read_config, save_checkpoint
from layout_oracle import serving_shards
from spawn import run_ranks
from fp8_checkpoints import quantized_checkpoint, skew_parts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# (case, checkpoint, load options): loads compared GPU against CPU. "many-buckets" has ~20 buckets of 1 MiB,
# so pinned read buffers are reused while earlier copies to the device may still be in flight.
LOADS = [(fam, fam, {}) for fam in DENSE + MOE] + [
    ("many-buckets", "wide", dict(staging_mib=1)),
    ("quantize-fp8", "llama-bf16", dict(quantize="fp8")),
    ("quantize-fp8-block", "llama-bf16", dict(quantize="fp8-block")),
    ("fp8-per-tensor", "llama-fp8", {}),
    ("fp8-per-tensor-fused-on-disk", "phi3-fp8", {}),
    ("fp8-block", "llama-block", {}),
    ("fp8-moe", "mixtral-fp8", {}),
    ("fp8-dequantized", "llama-fp8", dict(dequantize=True)),
    ("fp8-block-dequantized", "llama-block", dict(dequantize=True)),
]
PLAIN = {*DENSE, *MOE, "many-buckets"}  # also compared with the oracle (the others hold FP8 params and scales)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, dense_checkpoints) -> dict[str, str]:
    root = tmp_path_factory.mktemp("cuda")
    out = dict(dense_checkpoints)
    out |= {fam: str(save_checkpoint(fam, root / fam)) for fam in MOE}
    out["wide"] = str(save_checkpoint("llama", root / "wide", dtype=torch.bfloat16, hidden_size=256,
                                      intermediate_size=1024, vocab_size=4000, num_hidden_layers=4,
                                      max_shard_size="4MB"))
    bf16 = skew_parts(save_checkpoint("llama", root / "llama-bf16", dtype=torch.bfloat16))
    out["llama-bf16"] = str(bf16)
    out["llama-fp8"] = str(quantized_checkpoint(bf16, root / "llama-fp8", "tensor"))
    out["llama-block"] = str(quantized_checkpoint(bf16, root / "llama-block", "block"))
    phi3 = save_checkpoint("phi3", root / "phi3-bf16", dtype=torch.bfloat16)
    out["phi3-fp8"] = str(quantized_checkpoint(phi3, root / "phi3-fp8", "tensor"))
    mixtral = skew_parts(save_checkpoint("mixtral", root / "mixtral-bf16", dtype=torch.bfloat16))
    out["mixtral-fp8"] = str(quantized_checkpoint(mixtral, root / "mixtral-fp8", "tensor"))
    return out


def _load_all(checkpoints: dict, out_dir: str) -> dict:
    """Every case of LOADS on this rank's device; params saved to OUT_DIR/<device type>-<case>.safetensors."""
    from safetensors.torch import save_file

    import distload

    kind = "cuda" if torch.cuda.is_available() else "cpu"
    facts = {}
    for case, ckpt, options in LOADS:
        result = distload.load(checkpoints[ckpt], tp=1, progress=False, **options)
        record = result.report["per_rank"][0]
        facts[case] = dict(ok=result.report["ok"], device=record["device"], peak_device=record["peak_device_bytes"],
                           on=sorted({str(t.device.type) for t in result.params.values()}))
        save_file({n: t.detach().cpu().clone() for n, t in result.params.items()},
                  os.path.join(out_dir, f"{kind}-{case}.safetensors"))
        del result
    return facts


def _gpu_only(checkpoints: dict, out_dir: str) -> list[str]:
    """load_into a meta module, a --save-sharded round trip and a live refit, all on the GPU."""
    import distload

    problems = []
    wide = checkpoints["wide"]
    want = serving_shards(checkpoint_tensors(wide), read_config(wide), 0, 1)

    module = module_from_specs(distload.inspect(wide, tp=1).specs[0])
    distload.load_into(module, wide, tp=1, progress=False, staging_mib=1)
    got = {n: p.data for n, p in module.named_parameters(remove_duplicate=False)}
    problems += [f"load_into: {n} is on {t.device}" for n, t in got.items() if not t.is_cuda]
    problems += differences({n: t.cpu() for n, t in got.items()}, want, "load_into on cuda")
    del module, got

    saved = os.path.join(out_dir, "sharded")
    distload.load(wide, tp=1, progress=False, save_sharded=saved)
    again = distload.load(saved, tp=1, progress=False)
    problems += differences({n: t.cpu() for n, t in again.params.items()}, want, "reload of a save from cuda")
    del again

    base = checkpoints["llama"]
    result = distload.load(base, tp=1, progress=False)
    changed = {n: t * 2 for n, t in checkpoint_tensors(base).items()}
    done = distload.refit(result, changed, src=0)
    problems += [f"refit: {n} moved to {t.device}" for n, t in result.params.items() if not t.is_cuda]
    problems += differences({n: t.cpu() for n, t in result.params.items()},
                            serving_shards(changed, read_config(base), 0, 1), "refit on cuda")
    if done.version != 1:
        problems.append(f"refit version {done.version}, want 1")
    return problems


def test_gpu_loads_equal_cpu_loads_bit_for_bit(checkpoints, tmp_path):
    from safetensors.torch import load_file

    gpu_facts, = run_ranks(1, _load_all, checkpoints, str(tmp_path), backend="nccl")
    run_ranks(1, _load_all, checkpoints, str(tmp_path))  # gloo, CUDA hidden: the CPU path
    problems = []
    for case, ckpt, options in LOADS:
        facts = gpu_facts[case]
        if not (facts["ok"] and facts["device"].startswith("cuda") and facts["on"] == ["cuda"]
                and facts["peak_device"] > 0):
            problems.append(f"{case}: {facts}")
        gpu = load_file(str(tmp_path / f"cuda-{case}.safetensors"))
        cpu = load_file(str(tmp_path / f"cpu-{case}.safetensors"))
        mismatched = [n for n in sorted(set(gpu) | set(cpu)) if n not in gpu or n not in cpu
                      or gpu[n].dtype != cpu[n].dtype or gpu[n].shape != cpu[n].shape
                      or not torch.equal(gpu[n].view(-1).view(torch.uint8), cpu[n].view(-1).view(torch.uint8))]
        if mismatched:
            problems.append(f"{case} ({options}): GPU and CPU loads differ in {len(mismatched)} params: {mismatched[:6]}")
        if case in PLAIN:
            path = checkpoints[ckpt]
            problems += differences(gpu, serving_shards(checkpoint_tensors(path), read_config(path), 0, 1), case)
    assert not problems, "\n".join(problems)
    assert any(t.dtype == torch.float8_e4m3fn for t in load_file(str(tmp_path / "cuda-quantize-fp8.safetensors")).values())


def test_load_into_save_sharded_and_refit_on_gpu(checkpoints, tmp_path):
    problems, = run_ranks(1, _gpu_only, checkpoints, str(tmp_path), backend="nccl")
    assert not problems, "\n".join(problems)


def _torchrun(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    # Not from the repository's root: there `-m distload` would find the source tree before the installed
    # package, and the source tree has no distload.configs (pyproject maps it from configs/).
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", "-m", "distload",
           *args, "--no-progress"]
    return subprocess.run(cmd, cwd=cwd, env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True,
                          timeout=300)


def test_torchrun_load_and_verify_on_gpu(checkpoints, tmp_path):
    report_file = tmp_path / "report.json"
    proc = _torchrun(tmp_path, "load", checkpoints["wide"], "--report", str(report_file))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(report_file.read_text())
    rank0 = report["per_rank"][0]
    assert report["ok"] and rank0["device"] == "cuda:0" and rank0["peak_device_bytes"] > 0, report
    assert report["storage_bytes_read"] == report["checkpoint_bytes"], report
    assert "peak_device=" in proc.stdout, proc.stdout

    proc = _torchrun(tmp_path, "verify", checkpoints["qwen2"], "--tp", "1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "distload verify: OK" in proc.stdout, proc.stdout
