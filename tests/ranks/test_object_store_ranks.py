"""Loads from a real S3 server (moto, tests/support/s3_server.py) on real gloo ranks, through the Python API:
a sharded Llama, a Qwen3-MoE at tp 2 ep 2 and a block-FP8 checkpoint come out bit for bit as the same loads from
their directories, on 2 and 4 ranks and on 2 emulated nodes; the server's log shows each byte of each weight file
fetched exactly once per job (headers included), and the report counts what the store served."""

from __future__ import annotations

import os

import pytest

from s3_checks import bitwise, fetch_problems, header_bytes
from spawn import run_ranks

BUCKET = "checkpoints"
STAGING_MIB = 0.0625   # 64 KiB buckets: a tiny checkpoint still takes many buckets, readers many GETs


@pytest.fixture(scope="module")
def store():
    from s3_server import S3Server

    with S3Server() as server:
        yield server


@pytest.fixture(scope="module")
def checkpoints(store, tmp_path_factory):
    """name -> (directory, s3:// URL of the same files)."""
    from fp8_checkpoints import quantized_checkpoint
    from hf_models import save_checkpoint

    root = tmp_path_factory.mktemp("s3-checkpoints")
    dirs = {"llama": save_checkpoint("llama", root / "llama"), "qwen3_moe": save_checkpoint("qwen3_moe", root / "moe")}
    dirs["fp8_block"] = quantized_checkpoint(dirs["llama"], root / "fp8", "block")
    return {name: (str(d), store.upload(d, BUCKET, name)) for name, d in dirs.items()}


def _load_each(cases: dict, env: dict, nodes: int) -> dict:
    import torch.distributed as dist

    import distload

    os.environ.update(env)
    rank, world = dist.get_rank(), dist.get_world_size()
    if nodes > 1:   # torchrun's view of a job of `nodes` nodes (tests/ranks/test_load_e2e.py does the same)
        local = world // nodes
        os.environ.update(LOCAL_WORLD_SIZE=str(local), GROUP_RANK=str(rank // local), LOCAL_RANK=str(rank % local))
    problems, reports = [], {}
    for name, (directory, url, options) in sorted(cases.items()):
        fetched = distload.load(url, staging_mib=STAGING_MIB, progress=False, **options)
        read = distload.load(directory, staging_mib=STAGING_MIB, progress=False, **options)
        problems += bitwise(fetched.params, read.params, f"{name} world {world} rank {rank}")
        reports[name] = fetched.report
    return {"problems": problems, "reports": reports}


def _cases(checkpoints: dict, world: int, nodes: int) -> dict:
    moe = dict(tp=2, ep=2) if nodes == 1 else dict(tp=4, ep=2)
    options = {"llama": dict(tp=world), "qwen3_moe": moe, "fp8_block": dict(tp=world)}
    return {name: (*checkpoints[name], options[name]) for name in checkpoints}


def _check_job(store, checkpoints: dict, results: list, readers: list[int]) -> None:
    problems = [p for r in results for p in r["problems"]]
    for name, (directory, _) in checkpoints.items():
        problems += fetch_problems(store.log, name, directory)
        report = results[0]["reports"][name]
        weights = report["object_store"]["weights"]
        assert report["ok"] and report["readers"] == readers, name
        assert weights["bytes_fetched"] == report["checkpoint_bytes"] == report["storage_bytes_read"], name
        assert store.log.ranged_bytes(rf"^{name}/.*\.safetensors$") == report["checkpoint_bytes"] + \
            header_bytes(directory), name
        assert report["object_store"]["requests"] == len(store.log.about(name)), name   # no retries: one each
        assert report["object_store"]["retries"] == 0, name
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("world", [2, 4])
def test_s3_loads_are_the_directory_loads_and_fetch_each_byte_once(store, checkpoints, world):
    store.log.clear()
    results = run_ranks(world, _load_each, _cases(checkpoints, world, 1), store.env(), 1)
    _check_job(store, checkpoints, results, readers=[0])


def test_two_emulated_nodes_fetch_each_byte_once_per_job(store, checkpoints):
    store.log.clear()
    results = run_ranks(4, _load_each, _cases(checkpoints, 4, 2), store.env(), 2)
    _check_job(store, checkpoints, results, readers=[0, 2])
    for name in checkpoints:   # both nodes' readers fetched, and between them each byte once (_check_job)
        per_rank = results[0]["reports"][name]["per_rank"]
        assert all(per_rank[r]["object_store"]["bytes_fetched"] > 0 for r in (0, 2)), name
