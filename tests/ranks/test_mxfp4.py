"""GPT-OSS MXFP4 experts (issue 20): the tiny transformers GPT-OSS model's experts quantized by the reference
quantizer (tests/quant4_reference.py) into the released checkpoints' layout (X_blocks uint8 [E, out, in/32, 16],
X_scales E8M0 [E, out, in/32]), then cut as vLLM's gpt_oss.py cuts them and padded as its mxfp4.py allocates.

Expectations are sliced here from the checkpoint's tensors with vLLM's two rules, written out below; the
dequantized experts against the reference dequantization of the full tensors, cut and padded the same way.
intermediate_size 224 = 7 blocks: vLLM's split is uneven at tp 2 (128 + 96) and at tp 4 (64, 64, 64, 32).
"""

from __future__ import annotations

import pytest
import torch

import quant4_checkpoints as q4
from distload.quant import OPS
from distload.checkpoint import discover
from distload.errors import PlanError
from distload.plan import build_plan
from distload.quant import for_load
from distload.rules import rules_for
from distload.topology import Layout
from checks import differences, tensor_bytes
from hf_models import checkpoint_tensors, read_config, save_checkpoint
from layout_oracle import serving_shards
from spawn import run_ranks
from plan_checks import staged_shards
from quant4_checkpoints import reload_differences, save_sharded_at_tp2

DIMS = dict(intermediate_size=224, num_attention_heads=8, num_key_value_heads=2, head_dim=8)  # 8 heads: tp 8 plans


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("mxfp4")
    bf16 = save_checkpoint("gpt_oss", root / "bf16", dtype=torch.bfloat16, **DIMS)
    return str(q4.mxfp4_checkpoint(bf16, root / "mxfp4"))


@pytest.fixture(scope="module")
def tensors(ckpt):
    packed = checkpoint_tensors(ckpt)
    return packed, q4.mxfp4_dequantized(packed)


def vllm_range(inter: int, g: int, t: int) -> tuple[int, int]:
    """gpt_oss.py: whole 32-value blocks, ceil(blocks / tp) per rank, the last rank the rest."""
    per = -(-(inter // 32) // g) * 32
    return t * per, min((t + 1) * per, inter)


def vllm_padded(inter: int, g: int) -> int:
    """mxfp4.py create_weights: every rank allocates round_up(I // tp, 64) (its default backend)."""
    return -(-(inter // g) // 64) * 64


def _corner(t: torch.Tensor, shape) -> torch.Tensor:
    """t in the leading corner of zeros of `shape` (vLLM's param.data[:, :dim1, :dim2].copy_)."""
    out = torch.zeros(shape, dtype=t.dtype)
    out[tuple(slice(0, n) for n in t.shape)] = t
    return out


def expected(packed: dict, reference: dict, config: dict, rank: int, world: int, ep: int,
             dequantize: bool = False) -> dict:
    """Rank's params: non-expert ones by layout_oracle, the MXFP4 experts sliced here (linear placement)."""
    g = world // ep
    group, t = rank // g, rank % g
    n_exp, inter, hidden = config["num_local_experts"], config["intermediate_size"], config["hidden_size"]
    ids = list(range(group * n_exp // ep, (group + 1) * n_exp // ep))
    n, (s, e), pad = len(ids), vllm_range(inter, g, t), vllm_padded(inter, g)
    out = serving_shards(reference, config, rank, world, ep_size=ep)
    for i in range(config["num_hidden_layers"]):
        x = f"model.layers.{i}.mlp.experts."
        out[x + "w13_bias"] = _corner(packed[x + "gate_up_proj_bias"][ids][:, 2 * s:2 * e], (n, 2 * pad))
        if dequantize:
            gate_up = reference[x + "gate_up_proj"][ids].transpose(1, 2)        # [n, 2I, H], interleaved rows
            down = reference[x + "down_proj"][ids].transpose(1, 2)              # [n, H, I]
            out[x + "w13_weight"] = _corner(gate_up[:, 2 * s:2 * e], (n, 2 * pad, hidden)).to(torch.bfloat16)
            out[x + "w2_weight"] = _corner(down[:, :, s:e], (n, hidden, pad)).to(torch.bfloat16)
            continue
        blocks = packed[x + "gate_up_proj_blocks"][ids].flatten(2)              # [n, 2I, H/2]
        out[x + "w13_weight"] = _corner(blocks[:, 2 * s:2 * e], (n, 2 * pad, hidden // 2))
        out[x + "w13_weight_scale"] = _corner(packed[x + "gate_up_proj_scales"][ids][:, 2 * s:2 * e],
                                              (n, 2 * pad, hidden // 32))
        blocks = packed[x + "down_proj_blocks"][ids].flatten(2)                 # [n, H, I/2]
        out[x + "w2_weight"] = _corner(blocks[:, :, s // 2:e // 2], (n, hidden, pad // 2))
        out[x + "w2_weight_scale"] = _corner(packed[x + "down_proj_scales"][ids][:, :, s // 32:e // 32],
                                             (n, hidden, pad // 32))
    return out


def _plan(path: str, world: int, ep: int = 1, **options):
    index = discover(path)
    return build_plan(index.tensors, index.config, rules_for(index.config), Layout(world=world, tp=world, ep=ep),
                      quantization=for_load(index.config, **options))


def test_specs_follow_vllm_padded_uneven_split(ckpt):
    plan = _plan(ckpt, 2)
    x = "model.layers.0.mlp.experts."
    got = {n[len(x):]: (s.dtype, s.local_shape) for n, s in plan.specs[1].items() if n.startswith(x)}
    # I 224 at tp 2: rank 1 holds values [128, 224) = 96, padded to round_up(112, 64) = 128
    assert got == {"w13_weight": ("U8", (4, 256, 32)), "w13_weight_scale": ("U8", (4, 256, 2)),
                   "w13_bias": ("BF16", (4, 256)), "w2_weight": ("U8", (4, 64, 64)),
                   "w2_weight_scale": ("U8", (4, 64, 4)), "w2_bias": ("BF16", (4, 64))}
    assert plan.specs[1][x + "w13_weight"].padding == tuple((k * 256 + 192, (k + 1) * 256, 0, 32) for k in range(4))
    assert plan.quantization.startswith("mxfp4 block 32") and not plan.missing and not plan.unexpected


def delivered(plan, rank: int, values: dict) -> dict:
    """Rank's staging params from the plan's deliveries (no transfer, no post-load step)."""
    from distload.dtypes import torch_dtype
    from distload.plan.shard import view2d
    from plan_checks import put

    staging = plan.staging_specs(rank)
    bufs = {n: torch.zeros(view2d(s.local_shape), dtype=torch_dtype(s.dtype)) for n, s in staging.items()}
    for src in plan.sources.values():
        v = values[src.name].reshape(view2d(src.shape))
        for d in (d for d in src.deliveries if d.rank == rank):
            put(bufs[d.param], d.piece, v[d.piece.rows[0]:d.piece.rows[1], d.piece.cols[0]:d.piece.cols[1]])
    return {n: b.reshape(staging[n].local_shape) for n, b in bufs.items()}


@pytest.mark.parametrize("world,ep", [(1, 1), (2, 1), (4, 1), (2, 2), (4, 2)])
def test_every_rank_exact_and_dequantized(ckpt, tensors, world, ep):
    """The plan's pieces applied in-process: blocks and scales exact, --dequantize = the reference, cut."""
    packed, reference = tensors
    config = read_config(ckpt)
    plan, deq = _plan(ckpt, world, ep), _plan(ckpt, world, ep, dequantize=True)
    for rank in range(world):
        got = staged_shards(plan, rank, packed)
        problems = differences(got, expected(packed, reference, config, rank, world, ep), f"ep {ep} rank {rank}")
        assert not problems, "\n".join(problems)
        assert len(deq.post[rank]) == 2 * config["num_hidden_layers"]
        staged = delivered(deq, rank, packed)     # unpadded: a post-load step never reads a padded param
        out = dict(staged)
        for step in deq.post[rank]:
            finals = [deq.specs[rank][n] for n in step.outputs]
            (out[step.outputs[0]],) = OPS[step.op](step, finals, *(staged[n] for n in step.inputs))
        out = {n: out[n] for n in deq.specs[rank]}
        want = expected(packed, reference, config, rank, world, ep, dequantize=True)
        problems = differences(out, want, f"--dequantize ep {ep} rank {rank}")
        assert not problems, "\n".join(problems)


def test_a_split_that_leaves_a_rank_without_a_block_is_refused(ckpt):
    """7 blocks at tp 8: one block a rank, rank 7 none; refused while planning, with the sizes that work."""
    with pytest.raises(PlanError) as info:
        _plan(ckpt, 8)
    msg = str(info.value)
    assert "w13_weight (mxfp4 block 32" in msg and "intermediate_size 224 cut by 8 ranks" in msg, msg
    assert "7 blocks of 32, ceil(7 / 8) = 1 a rank" in msg and "rank(s) [7]" in msg, msg
    assert "(try 1, 2, 4, 7 ranks per expert group)" in msg, msg
    _plan(ckpt, 8, ep=2)    # 4 ranks per expert: fine


def _load(path: str, cases) -> list[str]:
    import distload
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    packed, config = checkpoint_tensors(path), read_config(path)
    reference = q4.mxfp4_dequantized(packed)
    problems = []
    for ep, dequantize in cases:
        result = distload.load(path, tp=world, ep=ep, dequantize=dequantize, progress=False)
        where = f"tp {world} ep {ep}{' --dequantize' if dequantize else ''} rank {rank}"
        problems += differences(result.params, expected(packed, reference, config, rank, world, ep, dequantize), where)
        if result.report["storage_bytes_read"] != tensor_bytes(path):
            problems.append(f"{where}: read {result.report['storage_bytes_read']} bytes of {tensor_bytes(path)}")
        if not result.report["ok"]:
            problems.append(f"{where}: report not ok")
    return problems


@pytest.mark.parametrize("world,cases", [(2, [(1, False), (1, True), (2, False), (2, True)]),
                                         (4, [(1, False), (1, True), (2, False)])])
def test_real_loads_are_exact_on_every_rank(ckpt, world, cases):
    problems = [p for r in run_ranks(world, _load, ckpt, cases) for p in r]
    assert not problems, "\n".join(problems[:30])


def test_sharded_save_reloads_and_reshards_the_padded_experts(ckpt, tmp_path):
    """Saved at tp 2 (rank 1: 96 of 128 values, padded), reloaded as saved and re-cut for tp 4 (64, 64, 64, 32)."""
    out = str(tmp_path / "sharded")
    run_ranks(2, save_sharded_at_tp2, ckpt, out)
    for tp in (2, 4):
        differences_ = [n for r in run_ranks(tp, reload_differences, ckpt, out, tp) for n in r]
        assert not differences_, (tp, sorted(differences_)[:6])
