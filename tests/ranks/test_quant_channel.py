"""Per-channel FP8 and INT8 W8A8 whole loads on real gloo ranks (issue 37): `distload.load` at tp 2 and 4
(Qwen3-MoE at ep 1 and 2) gives every rank exactly what vLLM's loaders cut (the codes, each scale [rows, 1] with
its weight's rows), --dequantize the oracle's cut of the dequantized checkpoint in BF16, --quantize fp8-channel a
scale per row of each rank's shard within FP8's error, and a sharded save reloads bit for bit.

Checkpoints and expectations: tests/support/channel_checkpoints.py (its own quantizer; the layout oracle's cut).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import channel_checkpoints as cc
from spawn import run_ranks

FP8_ERROR = 0.08   # relative Frobenius error FP8 e4m3 allows (~2-4% in practice), as tests/ranks/test_quant.py
CASES = {2: [("llama", "fp8", 1), ("llama", "int8", 1), ("qwen3_moe", "fp8", 1), ("qwen3_moe", "int8", 2),
             ("qwen3_moe", "fp8", 2)],
         4: [("llama", "fp8", 1), ("llama", "int8", 1), ("qwen3_moe", "int8", 2)]}   # (family, kind, ep)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from hf_models import save_checkpoint

    root = tmp_path_factory.mktemp("channel-loads")
    out = {}
    for family in ("llama", "qwen3_moe"):
        out[family, "bf16"] = bf16 = save_checkpoint(family, root / family, dtype=torch.bfloat16)
        for kind in ("fp8", "int8"):
            out[family, kind] = cc.channel_checkpoint(bf16, root / f"{family}-{kind}", kind)
    return {f"{family}-{kind}": str(path) for (family, kind), path in out.items()}


def _codes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _differences(got: dict, want: dict, where: str) -> list[str]:
    if set(got) != set(want):
        return [f"{where}: names differ: {sorted(set(got) ^ set(want))[:6]}"]
    return [f"{where}: {n} differs" for n, w in want.items()
            if _codes(got[n]).dtype != w.dtype or not torch.equal(_codes(got[n]), w)]


def _online_problems(path: str, tp: int, rank: int) -> list[str]:
    """--quantize fp8-channel: fp8 codes and a float32 scale per row of each linear shard, dequantizing to within
    FP8's error of the original's cut."""
    import distload
    from hf_models import checkpoint_tensors, read_config
    from layout_oracle import serving_shards

    result = distload.load(path, tp=tp, quantize="fp8-channel", progress=False, staging_mib=0.01)
    want, problems = serving_shards(checkpoint_tensors(path), read_config(path), rank, tp), []
    scaled = [n for n in result.params
              if n.endswith(".weight") and n[: -len("weight")] + "weight_scale" in result.params]
    for name in scaled:
        t, scale = result.params[name], result.params[name[: -len("weight")] + "weight_scale"]
        err = float((t.float() * scale - want[name].float()).norm() / want[name].float().norm())
        if t.dtype != torch.float8_e4m3fn or scale.shape != t.shape[:-1] + (1,) or not err <= FP8_ERROR:
            problems.append(f"online rank {rank}: {name} {t.dtype} {list(t.shape)}, scale {list(scale.shape)}, "
                            f"error {err:.3%}")
    n_linear = 4 * read_config(path)["num_hidden_layers"]   # qkv, o, gate_up, down per layer
    return problems + ([] if len(scaled) == n_linear else [f"online rank {rank}: {len(scaled)} quantized weights"])


def _load_all(paths: dict, tp: int, out_root: str) -> list[str]:
    import torch.distributed as dist

    import distload
    from hf_models import checkpoint_tensors, read_config
    from layout_oracle import serving_shards
    from quant4_checkpoints import reload_differences

    rank, problems = dist.get_rank(), []
    for family, kind, ep in CASES[tp]:
        path = paths[f"{family}-{kind}"]
        ckpt, config = checkpoint_tensors(path), read_config(path)
        where = f"{family} {kind} tp {tp} ep {ep} rank {rank}"
        loaded = distload.load(path, tp=tp, ep=ep, progress=False)
        problems += _differences(loaded.params, cc.expected_shards(ckpt, config, rank, tp, ep), where)
        if not loaded.report["quantization"].startswith(f"{kind}-channel"):
            problems.append(f"{where}: report says {loaded.report['quantization']!r}")
        deq = distload.load(path, tp=tp, ep=ep, progress=False, dequantize=True)
        oracle = {n: t.to(torch.bfloat16) for n, t in serving_shards(cc.dequantized(ckpt), config, rank, tp, ep).items()
                  if t.is_floating_point()}
        problems += _differences(deq.params, oracle, where + " --dequantize")
    if tp == 2:   # a sharded save of a channel load reloads bit for bit, on its own topology and re-cut for tp 1
        save = str(Path(out_root) / "llama-fp8-save")
        distload.load(paths["llama-fp8"], tp=2, progress=False, save_sharded=save)
        for at in (2, 1):
            differ = reload_differences(paths["llama-fp8"], save, at)
            problems += [f"reload at tp {at} rank {rank}: {n}" for n in differ]
    return problems + _online_problems(paths["llama-bf16"], tp, rank)


@pytest.mark.parametrize("tp", sorted(CASES))
def test_channel_loads_equal_vllms_cut(checkpoints, tmp_path, tp):
    problems = [p for per_rank in run_ranks(tp, _load_all, checkpoints, tp, str(tmp_path)) for p in per_rank]
    assert not problems, "\n".join(problems[:20])
