"""One route decision (distload/transfer/route.py): `distload inspect` and the load report the same route,
with the same reason, for every kind of input: safetensors on one node and on two (emulated) nodes, a
legacy .bin checkpoint, a torch.distributed.checkpoint directory, a sharded save, and --readers owners."""

from __future__ import annotations

import os

import torch

from spawn import run_ranks

WORLD = 4


def _cases(paths: dict, saved: str) -> list[tuple[str, str, dict, int | None]]:
    """(label, path, options, ranks per node: None for one node) of every load the test compares."""
    return [("safetensors", paths["llama"], {}, None),
            ("two nodes", paths["llama"], {}, 2),
            ("bin", paths["bin"], {}, None),
            ("dcp", paths["dcp"], {"hf_config": paths["llama"]}, None),
            ("sharded", saved, {}, None),
            ("owners", paths["llama"], {"readers": "owners"}, None)]


def _load_every_case(paths: dict, saved: str) -> dict:
    import torch.distributed as dist

    import distload

    rank = dist.get_rank()
    distload.load(paths["llama"], tp=WORLD, save_sharded=saved, progress=False)  # the save the "sharded" case reads
    routes = {}
    for label, path, options, local_world in _cases(paths, saved):
        local = local_world or WORLD
        os.environ.update(LOCAL_WORLD_SIZE=str(local), GROUP_RANK=str(rank // local), LOCAL_RANK=str(rank % local))
        result = distload.load(path, tp=WORLD, progress=False, **options)
        assert result.report["ok"], label
        routes[label] = result.report["route"]
    return routes


def test_inspect_and_the_load_report_the_same_route(dense_checkpoints, tmp_path):
    import torch.distributed.checkpoint as dcp

    from distload.inspect_cmd import describe_plan, inspect_load
    from distload.options import LoadOptions
    from hf_models import build_model

    model = build_model("llama", seed=3)
    bin_dir = tmp_path / "llama-bin"  # the legacy layout: config + a pickled state dict
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(bin_dir)
    torch.save({k: v.contiguous() for k, v in model.state_dict().items()}, bin_dir / "pytorch_model.bin")
    dcp_dir = tmp_path / "llama-dcp"
    dcp.save(model.state_dict(), checkpoint_id=str(dcp_dir))
    paths = {"llama": dense_checkpoints["llama"], "bin": str(bin_dir), "dcp": str(dcp_dir)}
    saved = str(tmp_path / "saved")

    loaded = run_ranks(WORLD, _load_every_case, paths, saved)[0]
    kinds = {}
    for label, path, options, local_world in _cases(paths, saved):
        inspection = inspect_load(path, LoadOptions(tp=WORLD, **options), world=WORLD, local_world=local_world)
        assert inspection.route.as_dict() == loaded[label], label
        assert inspection.route.describe() in describe_plan(inspection.plan, inspection.route), label
        kinds[label] = inspection.route.kind
    # the kinds themselves, where the OS lets ranks borrow a reader's files (tests/test_pull.py)
    pulls = "node-pulls" if loaded["safetensors"]["kind"] == "node-pulls" else "wire"
    assert kinds == {"safetensors": pulls, "two nodes": "wire", "bin": "wire", "dcp": "wire", "sharded": "wire",
                     "owners": "owner-reads"}
    assert "torch.load" in loaded["bin"]["reason"] and "sharded save" in loaded["sharded"]["reason"]
    assert "2 nodes" in loaded["two nodes"]["reason"]


def test_choose_route_without_processes(dense_checkpoints):
    """The decision is pure: the plan, the device, what the source and the OS allow."""
    from distload.inspect_cmd import inspect_load
    from distload.options import LoadOptions, Tuning
    from distload.transfer.route import choose_route

    plan = inspect_load(dense_checkpoints["qwen3"], LoadOptions(tp=2), world=2).plan
    assert choose_route(plan, device="cpu").kind == "node-pulls"
    assert choose_route(plan, device="cuda:0").reason.endswith("need a host buffer between the file and the device")
    refused = choose_route(plan, device="cpu", pulls_refused="DISTLOAD_PULL=0")
    assert (refused.kind, refused.reason) == ("wire", "one node, but no pulls from the reader's files: DISTLOAD_PULL=0")
    off = inspect_load(dense_checkpoints["qwen3"], LoadOptions(tp=2, tuning=Tuning(pull=False)), world=2)
    assert off.route.kind == "wire" and "DISTLOAD_PULL=0" in off.route.reason
    alone = inspect_load(dense_checkpoints["qwen3"], LoadOptions(tp=1), world=1)
    assert alone.route.kind == "owner-reads"
