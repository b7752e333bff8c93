"""Pipeline parallelism (--pp P): each stage holds, reads and receives only its layers, laid out as vLLM's.

Layer ranges are written out here by hand from vLLM's get_pp_indices (not computed by distload); the shards
come from layout_oracle.py's independent slicing, kept to the stage as vLLM builds it: the embedding on the
first stage, the final norm and lm_head on the last, a tied embedding on both. Pure plans first, then real
loads on 4 gloo ranks, many cases in one process group; refusals on every rank, by the command line.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch

from distload.errors import DistloadError
from distload.stages import PARTITION_ENV
from distload.topology import Layout
from checks import differences, tensor_bytes
from hf_models import save_checkpoint
from spawn import run_ranks
from pipeline_cases import FAMILIES, LAYERS, cases_for, checkpoints, expected_shards  # noqa: F401  (checkpoints: a fixture)

# (tp, pp, ep, pp_layers given, env partition, the stages' layer ranges by vLLM's rule)


# --- Layout: vLLM's rank order, stages, expert groups inside a stage, refusals ------------------------------------


def test_layout_rank_order_and_stage_layers():
    lay = Layout(world=8, tp=2, pp=2)                 # dp 2
    assert [lay.pp_rank(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert [lay.tp_rank(r) for r in range(8)] == [0, 1] * 4
    assert lay.stage_layers(0, 3) == range(0, 2) and lay.stage_layers(1, 3) == range(2, 3)
    assert [lay.stage_layers(s, 61) for s in range(2)] == [range(0, 31), range(31, 61)]
    # The expert groups split one stage's dp x tp ranks (ranks 0, 1, 4, 5 for stage 0), dp-major.
    ep = Layout(world=8, tp=2, pp=2, ep=2)
    assert ep.expert_group_size == 2
    assert [ep.ep_rank(r) for r in (0, 1, 4, 5)] == [0, 0, 1, 1]
    assert [ep.rank_in_expert_group(r) for r in (0, 1, 4, 5)] == [0, 1, 0, 1]
    assert Layout(world=4, tp=4).ep_rank(3) == 0 and Layout(world=4, tp=1, ep=4).ep_rank(3) == 3


@pytest.mark.parametrize("kwargs, words", [
    (dict(world=4, tp=2, pp=3), ["world size 4", "--pp 3", "--tp 2", "try --pp 1, 2"]),
    (dict(world=6, tp=2, pp=2), ["world size 6", "= 4", "multiple of 4"]),
    (dict(world=4, tp=1, pp=2, ep=4), ["--ep 4", "pipeline stage", "2"]),
])
def test_layout_refusals_name_the_numbers(kwargs, words):
    with pytest.raises(DistloadError) as e:
        Layout(**kwargs)
    assert all(w in str(e.value) for w in words), str(e.value)


# --- Pure plans: every rank's shards exact, nothing of other stages, each byte read once ---------------------------


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_plans_keep_each_stage_to_its_layers(checkpoints, family, monkeypatch):
    import distload
    from hf_models import read_config
    from plan_checks import staged_shards
    from plan_checks import arange_values, assert_coverage, assert_each_byte_read_once, materialise_through_buckets

    from distload.checkpoint import discover

    index = discover(checkpoints[family])
    values, config = arange_values(dict(index.tensors)), dict(index.config)
    for tp, pp, ep, parts, env, ranges in cases_for(family):
        if env:
            monkeypatch.setenv(PARTITION_ENV, env)
        plan = distload.inspect(checkpoints[family], tp=tp, pp=pp, ep=ep, world=4, pp_layers=parts)
        monkeypatch.delenv(PARTITION_ENV, raising=False)
        where = f"{family} tp {tp} pp {pp} ep {ep} layers {parts or env}"
        assert plan.layout.pp_layers == tuple(b - a for a, b in ranges), where
        assert_each_byte_read_once(plan)
        assert plan.missing == () and plan.unexpected == (), where   # no stage reports another's layers
        assert plan.checkpoint_bytes == tensor_bytes(checkpoints[family]), where
        for rank in range(4):
            want = expected_shards(values, read_config(checkpoints[family]), rank, tp, pp, ep, ranges)
            assert set(plan.specs[rank]) == set(want), (where, rank, set(plan.specs[rank]) ^ set(want))
            if any(plan.post):   # stored transposed: staged as stored, then each rank's own transpose steps
                assert all(step.outputs[0] in want for step in plan.post[rank]), (where, rank)
                got = staged_shards(plan, rank, values)
            else:
                assert_coverage(plan, rank)
                got = materialise_through_buckets(plan, rank, values)
            assert not differences(got, want, f"{where} rank {rank}")
            # nothing of another stage's layers is delivered to this rank
            for src in plan.sources.values():
                for share in src.shares:
                    assert rank not in share.ranks or share.param in plan.specs[rank], (where, rank, share.param)


def test_plan_refusals_name_the_numbers(checkpoints, monkeypatch):
    import distload

    path = checkpoints["llama"]
    refusals = [
        (dict(tp=1, pp=8, world=8), None, ["--pp 8", "5 layers", "--pp 5 or fewer"]),
        (dict(tp=2, pp=2, world=4, pp_layers="2,2"), None, ["--pp-layers 2,2", "sums to 4", "has 5"]),
        (dict(tp=2, pp=2, world=4, pp_layers="0,5"), None, ["--pp-layers 0,5", "at least one layer"]),
        (dict(tp=2, pp=2, world=4, pp_layers="1,1,3"), None, ["--pp-layers 1,1,3", "3 stages", "--pp 2"]),
        (dict(tp=2, pp=2, world=4), "1,1", [PARTITION_ENV, "1,1", "sums to 2", "has 5"]),
        (dict(tp=2, pp=3, world=4), None, ["world size 4", "--pp 3"]),
    ]
    for kwargs, env, words in refusals:
        if env:
            monkeypatch.setenv(PARTITION_ENV, env)
        try:
            with pytest.raises(DistloadError) as e:
                distload.inspect(path, **kwargs)
            assert all(w in str(e.value) for w in words), (kwargs, str(e.value))
        finally:
            monkeypatch.delenv(PARTITION_ENV, raising=False)


def test_inspect_prints_the_stage_split(checkpoints):
    from distload.inspect_cmd import describe_plan, inspect_load, stage_split
    from distload.options import LoadOptions

    inspection = inspect_load(checkpoints["llama"], LoadOptions(tp=2, pp=2), world=4)
    split = stage_split(inspection.plan)
    assert [s["layers"] for s in split] == [[0, 3], [3, 5]]
    assert split[0]["checkpoint_bytes"] + split[1]["checkpoint_bytes"] == inspection.plan.checkpoint_bytes
    text = describe_plan(inspection.plan, inspection.route, inspection=inspection)
    assert "pp 2" in text.splitlines()[0]
    assert "stage 0: layers 0..2 (3)" in text and "stage 1: layers 3..4 (2)" in text


# --- Real loads on 4 gloo ranks: one process group, every case ------------------------------------------------------


def _refit_stages(path: str, changed: str, rank: int) -> list[str]:
    """Live refit of a tp 2 x pp 2 load from the last stage's rank 3: each rank's stage takes the new weights,
    and a rank receives exactly its own stage's shards (nothing of the other stage's layers); then a refit into
    a plain dict of params given pp=."""
    import distload
    from hf_models import checkpoint_tensors, read_config

    ranges = [(0, 3), (3, 5)]
    result = distload.load(path, tp=2, pp=2, progress=False, staging_mib=0.05)
    new = checkpoint_tensors(changed)
    want = expected_shards(new, read_config(changed), rank, 2, 2, 1, ranges)
    done = distload.refit(result, new if rank == 3 else None, src=3, staging_mib=1)
    problems = differences(result.params, want, f"refit pp 2 rank {rank}")
    # what a rank is sent: its stage's shards, less the vocab padding rows it zero-fills itself
    padded = sum((r1 - r0) * (c1 - c0) * t.element_size() for n, t in want.items()
                 for r0, r1, c0, c1 in result.specs[n].padding)
    mine = sum(t.numel() * t.element_size() for t in want.values()) - padded
    received = done.report["per_rank"][rank]["bytes_received"]
    if rank != 3 and received != mine:
        problems.append(f"refit pp 2: rank {rank} received {received} bytes, its stage's shards are {mine}")
    plain = {n: torch.zeros_like(t) for n, t in result.params.items()}
    distload.refit(plain, checkpoint_tensors(path) if rank == 0 else None, src=0, config=path, tp=2, pp=2, version=5)
    problems += differences(plain, expected_shards(checkpoint_tensors(path), read_config(path), rank, 2, 2, 1, ranges),
                            f"refit pp 2 into a dict rank {rank}")
    return problems


def _load_every_case(checkpoints: dict, out_dir: str, changed: str) -> dict:
    import os

    import torch.distributed as dist

    import distload
    from hf_models import checkpoint_tensors, read_config

    rank = dist.get_rank()
    problems, reports = [], {}
    for family, path in sorted(checkpoints.items()):
        hf, config = checkpoint_tensors(path), read_config(path)
        for tp, pp, ep, parts, env, ranges in cases_for(family):
            if env:
                os.environ[PARTITION_ENV] = env
            try:
                result = distload.load(path, tp=tp, pp=pp, ep=ep, pp_layers=parts, progress=False, staging_mib=0.05)
            finally:
                os.environ.pop(PARTITION_ENV, None)
            where = f"{family} tp {tp} pp {pp} ep {ep} layers {parts or env} rank {rank}"
            problems += differences(result.params, expected_shards(hf, config, rank, tp, pp, ep, ranges), where)
            reports[family, tp, pp, ep, parts, env] = result.report
    problems += _refit_stages(checkpoints["llama"], changed, rank)
    # A sharded save of a pipeline layout reloads as it is, and reshards to another pp.
    path = checkpoints["llama_mqa_tied"]
    hf, config = checkpoint_tensors(path), read_config(path)
    out = os.path.join(out_dir, "pp2")
    distload.load(path, tp=2, pp=2, save_sharded=out, progress=False)
    again = distload.load(out, tp=2, pp=2, progress=False)
    problems += differences(again.params, expected_shards(hf, config, rank, 2, 2, 1, [(0, 3), (3, 5)]),
                            f"reload pp 2 rank {rank}")
    reports["reload"] = again.report
    for tp, pp, ranges in ((1, 4, [(0, 1), (1, 2), (2, 4), (4, 5)]), (4, 1, [(0, 5)])):
        re_cut = distload.load(out, tp=tp, pp=pp, reshard=True, progress=False)
        problems += differences(re_cut.params, expected_shards(hf, config, rank, tp, pp, 1, ranges),
                                f"reshard to tp {tp} pp {pp} rank {rank}")
    try:
        distload.load(out, tp=1, pp=4, progress=False)
        problems.append("a pp 2 save loaded at pp 4 without --reshard")
    except DistloadError as exc:
        if "--reshard" not in str(exc) or "pp 2" not in str(exc):
            problems.append(f"refusal without --reshard: {exc}")
    # Two emulated nodes, one stage each: each node's reader reads its stage's tensors, nothing crosses nodes.
    saved_env = {k: os.environ[k] for k in ("LOCAL_WORLD_SIZE", "GROUP_RANK", "LOCAL_RANK")}
    os.environ.update(LOCAL_WORLD_SIZE="2", GROUP_RANK=str(rank // 2), LOCAL_RANK=str(rank % 2))
    try:
        path = checkpoints["llama"]
        two = distload.load(path, tp=2, pp=2, progress=False, staging_mib=0.05)
        tied = distload.load(checkpoints["gpt2"], tp=2, pp=2, progress=False, staging_mib=0.05)
    finally:
        os.environ.update(saved_env)
    problems += differences(two.params, expected_shards(checkpoint_tensors(path), read_config(path), rank, 2, 2, 1,
                                                        [(0, 3), (3, 5)]), f"two nodes rank {rank}")
    gpt2 = checkpoints["gpt2"]
    problems += differences(tied.params, expected_shards(checkpoint_tensors(gpt2), read_config(gpt2), rank, 2, 2, 1,
                                                         cases_for("gpt2")[0][5]), f"two nodes tied rank {rank}")
    reports["two nodes"], reports["two nodes tied"] = two.report, tied.report
    return {"problems": problems, "reports": reports if rank == 0 else None}


def wte_bytes(path: str) -> int:
    from distload.checkpoint import discover

    return discover(path).tensors["transformer.wte.weight"].nbytes


def test_loads_on_four_ranks_hold_exactly_their_stage(checkpoints, tmp_path):
    import json

    changed = str(save_checkpoint("llama", tmp_path / "llama-step2", seed=2, num_hidden_layers=LAYERS))
    results = run_ranks(4, _load_every_case, checkpoints, str(tmp_path), changed, timeout=900)
    problems = [p for r in results for p in r["problems"]]
    assert not problems, "\n".join(problems[:30])
    for key, report in results[0]["reports"].items():
        if key == "reload":
            assert report["ok"] and report["pp"] == 2, report
            continue
        if key == "two nodes":
            assert report["ok"] and report["readers"] == [0, 2], report
            assert report["storage_bytes_read"] == report["checkpoint_bytes"] == tensor_bytes(checkpoints["llama"])
            assert [r["bytes_from_other_nodes"] for r in report["per_rank"]] == [0, 0, 0, 0], report["per_rank"]
            assert [r["bytes_read"] > 0 for r in report["per_rank"]] == [True, False, True, False]
            continue
        if key == "two nodes tied":   # the tied embedding is read on both stages' nodes: nothing crosses
            assert report["ok"] and [r["bytes_from_other_nodes"] for r in report["per_rank"]] == [0, 0, 0, 0], report
            assert report["storage_bytes_read"] == report["checkpoint_bytes"] + wte_bytes(checkpoints["gpt2"]), report
            continue
        family, tp, pp, ep, parts, env = key
        ranges = next(c[5] for c in cases_for(family) if c[:5] == (tp, pp, ep, parts, env))
        assert report["ok"], key
        assert report["pp"] == pp and report["pp_layers"] == [b - a for a, b in ranges], key
        assert report["pp_layers_from"] == ("--pp-layers" if parts else PARTITION_ENV if env else "default"), key
        assert report["storage_bytes_read"] == report["checkpoint_bytes"] == tensor_bytes(checkpoints[family]), key
        for r in report["per_rank"]:
            stage = (r["rank"] // tp) % pp
            assert r["pp_rank"] == stage and r["layers"] == list(ranges[stage]), (key, r)
    manifest = json.loads((tmp_path / "pp2" / "manifest.json").read_text())
    assert manifest["pp"] == 2 and manifest["pp_layers"] == [3, 2]
    assert [s["layers"] for s in manifest["rank_stages"]] == [[0, 3], [0, 3], [3, 5], [3, 5]]
    assert manifest["params"]["model.layers.4.mlp.down_proj.weight"]["ranks"][0] is None
    assert manifest["params"]["model.embed_tokens.weight"]["pp_ranks"] == [0, 1]   # tied: first and last stage
    # A record missing on a rank whose stage holds the param is damage, named as such.
    from distload.errors import CheckpointError
    from distload.sharded.manifest import check_manifest

    manifest["params"]["model.layers.0.mlp.down_proj.weight"]["ranks"][1] = None
    with pytest.raises(CheckpointError, match=re.escape('model.layers.0.mlp.down_proj.weight"].ranks[1]')):
        check_manifest(manifest, tmp_path / "pp2" / "manifest.json")


# --- Refusals under torchrun: one line on every rank ----------------------------------------------------------------


def _torchrun(nproc: int, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    import os

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           "-m", "distload", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


@pytest.mark.parametrize("args, env, words", [
    (("--tp", "2", "--pp", "3"), None, ["world size 4 is not divisible by --pp 3 x --tp 2"]),
    (("--tp", "1", "--pp", "4"), {PARTITION_ENV: "1,1,1,1"}, [PARTITION_ENV, "sums to 4", "has 5"]),
])
def test_refused_on_every_rank_as_one_line(checkpoints, args, env, words):
    proc = _torchrun(4, "load", checkpoints["llama"], *args, "--timeout", "60", env=env)
    assert proc.returncode != 0
    for rank in range(4):
        lines = [l for l in proc.stderr.splitlines() if l.startswith(f"distload: error on rank {rank}:")]
        assert len(lines) == 1, proc.stderr[-4000:]
        assert all(w in lines[0] for w in words), lines[0]
