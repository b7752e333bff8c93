"""End to end on real gloo ranks: every dense family at tp 1, 2, 4 lands exactly in the serving layout.

The reference is independent of distload: `transformers` saved the checkpoint, `safetensors` reads it
back, and tests/layout_oracle.py slices it with plain torch into what each rank must hold. Each rank's
params are compared with torch.equal, bit for bit; so are the shards written by --save-sharded.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from checks import cross_node_bytes, differences, module_from_specs, record_weight_opens, tensor_bytes
from spawn import run_ranks

def _expected(path: str, rank: int, tp: int) -> dict:
    from hf_models import checkpoint_tensors, read_config
    from layout_oracle import serving_shards

    return serving_shards(checkpoint_tensors(path), read_config(path), rank, tp)


def _load_every_family(checkpoints: dict, out_root: str) -> dict:
    import torch.distributed as dist

    import distload
    from safetensors.torch import load_file

    opened = record_weight_opens(checkpoints.values())
    rank, world = dist.get_rank(), dist.get_world_size()
    problems, reports = [], {}
    for fam, path in sorted(checkpoints.items()):
        out = Path(out_root) / f"{fam}-tp{world}"
        result = distload.load(path, tp=world, save_sharded=str(out), progress=False)
        want = _expected(path, rank, world)
        problems += differences(result.params, want, f"{fam} tp{world} rank{rank} loaded")
        if "lm_head.weight" in result.params and result.config.get("tie_word_embeddings"):
            if result.params["lm_head.weight"] is not result.params["model.embed_tokens.weight"]:
                problems.append(f"{fam}: tied lm_head is not aliased to the embedding")
        saved = load_file(str(out / f"rank-{rank:05d}-of-{world:05d}.safetensors"))
        want_saved = {n: t for n, t in want.items() if not (n == "lm_head.weight" and result.config.get("tie_word_embeddings"))}
        problems += differences(saved, want_saved, f"{fam} tp{world} rank{rank} saved")
        reports[fam] = result.report
    return {"problems": problems, "reports": reports, "opened": sorted(set(opened))}


@pytest.mark.parametrize("world", [1, 2, 4])
def test_dense_families_exact(dense_checkpoints, tmp_path, world):
    results = run_ranks(world, _load_every_family, dense_checkpoints, str(tmp_path))
    problems = [p for r in results for p in r["problems"]]
    assert not problems, "\n".join(problems)
    for fam, path in dense_checkpoints.items():
        report = results[0]["reports"][fam]
        assert report["ok"] and report["world_size"] == world and report["tp"] == world
        # every tensor byte of the checkpoint is read, and only once (counted here with safetensors itself)
        assert report["storage_bytes_read"] == report["checkpoint_bytes"] == tensor_bytes(path), fam
        manifest = json.loads((tmp_path / f"{fam}-tp{world}" / "manifest.json").read_text())
        assert manifest["world_size"] == world and manifest["tp"] == world
    # one node: every rank copied its pieces from the files rank 0 opened (world 1: the one owner reads)
    paths = {r["transfer_path"] for rep in results[0]["reports"].values() for r in rep["per_rank"]}
    assert paths == {"node-pulls" if world > 1 else "owner-reads"}, paths
    # a lone reader gets concurrent reads for what is not cached; ranks that all read keep plain reads
    strategies = {r["read_strategy"] for rep in results[0]["reports"].values() for r in rep["per_rank"]}
    assert strategies == {"threaded-cold" if world == 1 else "plain"}, strategies
    # rank 0 asked storage for the start of each checkpoint while the ranks planned: all of these small ones
    for fam, path in dense_checkpoints.items():
        asked = [r["early_fetch_bytes"] for r in results[0]["reports"][fam]["per_rank"]]
        assert asked == [tensor_bytes(path)] + [0] * (world - 1), (fam, asked)
    # only rank 0 (the one reader of this single node) ever opened a weight file
    assert results[0]["opened"], "rank 0 read nothing?"
    assert all(not r["opened"] for r in results[1:]), [r["opened"] for r in results[1:]]
    assert all(r["bytes_read"] == 0 for r in results[0]["reports"]["llama"]["per_rank"][1:])


def _expect_tp3_refused(path: str) -> str:
    import distload

    try:
        distload.load(path, tp=3, progress=False)
    except distload.PlanError as exc:
        return str(exc)
    return "loaded?!"


def test_tp3_refused_on_every_rank(dense_checkpoints):
    messages = run_ranks(3, _expect_tp3_refused, dense_checkpoints["qwen2"])
    assert len(set(messages)) == 1, messages
    assert "qkv_proj.weight (rule qkv)" in messages[0] and "tp=3" in messages[0]
    assert "try tp 1, 2, 4" in messages[0]


def _load_into_modules(checkpoints: dict) -> list[str]:
    import torch.distributed as dist

    import distload

    rank, world = dist.get_rank(), dist.get_world_size()
    problems = []
    for fam in ("llama_mqa_tied", "phi3"):
        path = checkpoints[fam]
        plan = distload.inspect(path, tp=world)
        module = module_from_specs(plan.specs[rank])
        distload.load_into(module, path, tp=world, progress=False)
        got = {n: p.data for n, p in module.named_parameters(remove_duplicate=False)}
        problems += differences(got, _expected(path, rank, world), f"load_into {fam} rank{rank}")
    return problems


def test_load_into_meta_module(dense_checkpoints):
    results = run_ranks(2, _load_into_modules, dense_checkpoints)
    problems = [p for r in results for p in r]
    assert not problems, "\n".join(problems)


def _load_with_many_readers(checkpoints: dict, bin_checkpoint: str) -> dict:
    import os

    import torch.distributed as dist

    import distload

    opened = record_weight_opens(list(checkpoints.values()) + [bin_checkpoint])
    rank, world = dist.get_rank(), dist.get_world_size()
    problems, readers_seen = [], {}
    for fam in ("llama", "qwen3", "phi3"):
        for readers in (2, world):
            result = distload.load(checkpoints[fam], tp=world, readers=readers, staging_mib=1, progress=False)
            problems += differences(result.params, _expected(checkpoints[fam], rank, world),
                                 f"{fam} readers={readers} rank{rank}")
            readers_seen[(fam, readers)] = [r["bytes_read"] for r in result.report["per_rank"]]
            if result.report["storage_bytes_read"] != result.report["checkpoint_bytes"]:
                problems.append(f"{fam} readers={readers}: read {result.report['storage_bytes_read']} bytes "
                                f"of {result.report['checkpoint_bytes']}")
    # a legacy .bin checkpoint: torch.load(weights_only=True) on the reader only
    result = distload.load(bin_checkpoint, tp=world, progress=False)
    problems += differences(result.params, _expected_from_bin(bin_checkpoint, rank, world), f"bin rank{rank}")
    # While the ranks plan, rank 0 asks storage for the start of the checkpoint (a budget's worth:
    # DISTLOAD_EARLY_FETCH_MIB); not around the page cache (O_DIRECT), not for torch.load files.
    early = {"bin": [r["early_fetch_bytes"] for r in result.report["per_rank"]]}
    for name, strategy, budget in (("256 KiB", None, "0.25"), ("odirect", "odirect", None)):
        if budget is not None:
            os.environ["DISTLOAD_EARLY_FETCH_MIB"] = budget
        try:
            result = distload.load(checkpoints["llama"], tp=world, read_strategy=strategy, progress=False)
        finally:
            os.environ.pop("DISTLOAD_EARLY_FETCH_MIB", None)
        problems += differences(result.params, _expected(checkpoints["llama"], rank, world), f"{name} rank{rank}")
        early[name] = [r["early_fetch_bytes"] for r in result.report["per_rank"]]
    return {"problems": problems, "readers": readers_seen, "opened": len(opened), "early": early}


def _expected_from_bin(path: str, rank: int, tp: int) -> dict:
    from hf_models import read_config
    from layout_oracle import serving_shards

    state = torch.load(str(Path(path) / "pytorch_model.bin"), weights_only=True)
    return serving_shards(state, read_config(path), rank, tp)


def test_several_readers_and_legacy_bin(dense_checkpoints, tmp_path):
    from hf_models import build_model

    # transformers 5 no longer writes .bin files: write the legacy layout (config + pickled state dict) directly
    bin_dir = tmp_path / "llama-bin"
    model = build_model("llama", seed=3)
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(bin_dir)
    torch.save({k: v.contiguous() for k, v in model.state_dict().items()}, bin_dir / "pytorch_model.bin")
    results = run_ranks(4, _load_with_many_readers, dense_checkpoints, str(bin_dir))
    problems = [p for r in results for p in r["problems"]]
    assert not problems, "\n".join(problems)
    per_rank_reads = results[0]["readers"]
    for (fam, readers), reads in per_rank_reads.items():
        assert sum(1 for b in reads if b > 0) == readers, (fam, readers, reads)   # every reader took a share
        assert max(reads) <= 0.75 * sum(reads), (fam, readers, reads)           # ... and nobody took it all
    assert all(r["opened"] > 0 for r in results)   # with readers == world every rank reads some file
    assert results[0]["early"] == {"bin": [0] * 4, "256 KiB": [1 << 18, 0, 0, 0], "odirect": [0] * 4}


def _node_pulls_and_the_bucketed_path(checkpoints: dict) -> dict:
    """One node: node pulls (the default) and the bucketed path through shared slots (DISTLOAD_PULL=0)
    give the same exact shards; a module of another dtype is converted as pieces are pulled."""
    import os

    import torch.distributed as dist

    import distload

    opened = record_weight_opens(checkpoints.values())
    rank, world = dist.get_rank(), dist.get_world_size()
    problems, paths = [], []
    for pull in ("1", "0"):
        os.environ["DISTLOAD_PULL"] = pull
        try:
            for fam in ("llama_mqa_tied", "qwen3", "phi3"):
                for readers in ("per-node", 2):
                    result = distload.load(checkpoints[fam], tp=world, readers=readers, staging_mib=1, progress=False)
                    where = f"{fam} readers={readers} DISTLOAD_PULL={pull} rank{rank}"
                    problems += differences(result.params, _expected(checkpoints[fam], rank, world), where)
                    report = result.report
                    paths.append((pull, readers, report["per_rank"][rank]["transfer_path"]))
                    if report["storage_bytes_read"] != report["checkpoint_bytes"]:
                        problems.append(f"{where}: read {report['storage_bytes_read']} of {report['checkpoint_bytes']}")
                    sent = sum(r["bytes_sent"] for r in report["per_rank"])
                    received = sum(r["bytes_received"] for r in report["per_rank"])
                    if sent != received or received == 0:
                        problems.append(f"{where}: sent {sent} != received {received}")
        finally:
            del os.environ["DISTLOAD_PULL"]
    opened = sorted(set(opened))  # inspect (below) reads headers on every rank: not a load
    path = checkpoints["qwen2"]
    module = module_from_specs(distload.inspect(path, tp=world).specs[rank]).to(torch.float64)
    distload.load_into(module, path, tp=world, progress=False)
    got = {n: p.data for n, p in module.named_parameters(remove_duplicate=False)}
    problems += differences(got, {n: t.double() for n, t in _expected(path, rank, world).items()},
                            f"node pulls load_into float64 rank{rank}")
    return {"problems": problems, "paths": paths, "opened": opened}


def test_node_pulls_and_the_bucketed_path_agree(dense_checkpoints):
    results = run_ranks(4, _node_pulls_and_the_bucketed_path, dense_checkpoints)
    problems = [p for r in results for p in r["problems"]]
    assert not problems, "\n".join(problems)
    for r in results:
        assert {path for pull, _, path in r["paths"] if pull == "1"} == {"node-pulls"}, r["paths"]
        assert {path for pull, _, path in r["paths"] if pull == "0"} == {"buckets"}, r["paths"]
    assert results[0]["opened"] and results[1]["opened"]  # readers=2: ranks 0 and 1 ...
    assert not results[2]["opened"] and not results[3]["opened"]  # ... and nobody else opened a weight file


def _load_with_rank_dependent_staging(path: str) -> str:
    import torch.distributed as dist

    import distload

    try:
        distload.load(path, staging_mib=0.01 if dist.get_rank() == 0 else 0.02, progress=False)
    except distload.DistloadError as exc:
        return str(exc)
    return "loaded?!"


def test_ranks_with_different_plans_fail_instead_of_hanging(dense_checkpoints):
    messages = run_ranks(2, _load_with_rank_dependent_staging, dense_checkpoints["llama"], timeout=120)
    assert all("ranks computed different load plans" in m for m in messages), messages
    digests = [re.search(r"this rank \d: plan ([0-9a-f]{15})", m)[1] for m in messages]
    assert digests[0] != digests[1], messages   # each rank says which plan it holds


def _load_with_planning_failing_on_rank1(path: str) -> str:
    import os

    import distload

    os.environ["DISTLOAD_FAULT"] = "raise@rank1:planning"  # read at the planning agreement step
    try:
        distload.load(path, progress=False)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        del os.environ["DISTLOAD_FAULT"]
    return "loaded?!"


def test_a_rank_failing_to_plan_fails_every_rank(dense_checkpoints):
    """The planning agreement also compares the plan digests (one collective); a rank that failed there still
    takes part in it, so every rank ends, naming the failure, rather than one side waiting for the other."""
    messages = run_ranks(4, _load_with_planning_failing_on_rank1, dense_checkpoints["llama"], timeout=120)
    assert "injected fault" in messages[1], messages
    for m in (messages[0], messages[2], messages[3]):
        assert "planning failed on 1 rank(s): rank 1" in m and "injected fault" in m, messages


def _load_with_owner_reads(checkpoints: dict) -> dict:
    import torch.distributed as dist

    import distload

    opened = record_weight_opens(checkpoints.values())
    rank, world = dist.get_rank(), dist.get_world_size()
    problems = []
    for fam, path in sorted(checkpoints.items()):
        result = distload.load(path, tp=world, readers="owners", progress=False)
        problems += differences(result.params, _expected(path, rank, world), f"owners {fam} rank{rank}")
        report = result.report
        if not report["ok"] or report["readers"] != list(range(world)):
            problems.append(f"owners {fam}: ok={report['ok']} readers={report['readers']}")
        # each rank read exactly its own pieces (replicated ones included), nothing else, and sent nothing
        mine = report["per_rank"][rank]
        if mine["bytes_read"] != result.plan.owned_bytes(rank) or mine["bytes_received"] or mine["bytes_sent"]:
            problems.append(f"owners {fam} rank{rank}: read {mine['bytes_read']} (own pieces "
                            f"{result.plan.owned_bytes(rank)}), received {mine['bytes_received']}, "
                            f"sent {mine['bytes_sent']}")
    # into a module of another dtype: pieces converted while copied, both the whole-row and the strided ones
    path = checkpoints["qwen2"]
    module = module_from_specs(distload.inspect(path, tp=world).specs[rank]).to(torch.float64)
    distload.load_into(module, path, tp=world, readers="owners", progress=False)
    got = {n: p.data for n, p in module.named_parameters(remove_duplicate=False)}
    problems += differences(got, {n: t.double() for n, t in _expected(path, rank, world).items()},
                            f"owners load_into float64 rank{rank}")
    # a post-load step cannot run per piece: it falls back to the bucketed path, same result
    fp8_owners = distload.load(path, tp=world, readers="owners", quantize="fp8", progress=False)
    fp8_default = distload.load(path, tp=world, quantize="fp8", progress=False)
    problems += differences(fp8_owners.params, fp8_default.params, f"owners --quantize fp8 rank{rank}")
    return {"problems": problems, "opened": len(set(opened))}


@pytest.mark.parametrize("world", [1, 4])
def test_owner_reads_exact(dense_checkpoints, world):
    results = run_ranks(world, _load_with_owner_reads, dense_checkpoints)
    problems = [p for r in results for p in r["problems"]]
    assert not problems, "\n".join(problems)
    assert all(r["opened"] > 0 for r in results)  # every rank is a reader in this mode


def test_inspect_shows_owner_reads(dense_checkpoints):
    from distload.inspect_cmd import describe_plan, inspect_load
    from distload.options import LoadOptions

    def inspect(**options):
        world, local_world = options.pop("world"), options.pop("local_world", None)
        inspection = inspect_load(dense_checkpoints["qwen3"], LoadOptions(**options), world, local_world)
        return inspection.plan, describe_plan(inspection.plan, inspection.route)

    plan, table = inspect(tp=4, world=4, readers="owners")
    assert "owner reads (--readers owners)" in table and "readers [0, 1, 2, 3]" in table
    assert "node pulls" in inspect(tp=4, world=4)[1]
    two_nodes, described = inspect(tp=4, world=4, local_world=2)
    assert "node pulls" not in described
    assert f"reads the rows its own ranks keep; {sum(cross_node_bytes(two_nodes)):,} bytes cross" in described
    rows = [line.split() for line in table.splitlines() if line.strip()[:1].isdigit()]
    assert [int(r[3].replace(",", "")) for r in rows] == [plan.owned_bytes(r) for r in range(4)]  # reads
    assert all(int(r[4].replace(",", "")) == 0 for r in rows)  # receives nothing
    assert sum(plan.owned_bytes(r) for r in range(4)) >= plan.checkpoint_bytes


def test_owner_reads_refused_across_nodes():
    from distload.errors import DistloadError
    from distload.topology import reader_ranks

    assert reader_ranks(4, 4, "owners") == (0, 1, 2, 3)
    with pytest.raises(DistloadError, match="owners.*2 nodes.*--readers per-node"):
        reader_ranks(4, 2, "owners")
    with pytest.raises(DistloadError, match="'some'.*per-node.*owners"):
        reader_ranks(4, 4, "some")


def _owners_match_default_on_experts(path: str) -> list[str]:
    import distload

    owners = distload.load(path, tp=4, ep=2, readers="owners", progress=False)
    default = distload.load(path, tp=4, ep=2, progress=False)
    return differences(owners.params, default.params, f"mixtral tp4 ep2 owners rank{owners.rank}")


def test_owner_reads_expert_parallel_matches_the_default_path(tmp_path):
    """Experts (per-expert tensors stacked into w13/w2 on their hosts) through owner reads: the same bytes
    as the bucketed path (tests/test_moe.py checks that one against the oracle)."""
    from hf_models import save_checkpoint

    path = str(save_checkpoint("mixtral", tmp_path / "mixtral"))
    problems = [p for r in run_ranks(4, _owners_match_default_on_experts, path) for p in r]
    assert not problems, "\n".join(problems)


def _gather_records_of_every_size() -> list:
    import torch.distributed as dist

    from distload.transfer import all_gather_objects
    from distload.transfer.collectives import gather_objects

    rank = dist.get_rank()
    small = all_gather_objects({"rank": rank, "names": [f"p{i}" for i in range(rank)]})
    # one rank's record does not fit the fixed slot (16 KiB): everyone takes the second, sized round
    mixed = all_gather_objects(["x" * (40_000 if rank == 1 else 3), rank])
    to_one = gather_objects(["x" * (40_000 if rank == 1 else 3), rank], dst=2)   # rank 2 alone receives them
    return [small, mixed, to_one]


def test_records_are_gathered_whole_whatever_their_size():
    results = run_ranks(3, _gather_records_of_every_size)
    want_small = [{"rank": r, "names": [f"p{i}" for i in range(r)]} for r in range(3)]
    want_mixed = [["x" * (40_000 if r == 1 else 3), r] for r in range(3)]
    assert all(r[:2] == [want_small, want_mixed] for r in results), results[0]
    assert [r[2] for r in results] == [None, None, want_mixed]


def _fail_on_most_ranks() -> list[str]:
    """Ranks 1-5 of 7 fail a phase, then find something in a verdict: what each rank raises, both times."""
    import torch.distributed as dist

    from distload.errors import CheckpointError, RankFailure
    from distload.transfer.agreement import run_phase, verdict_everywhere

    rank, out = dist.get_rank(), []

    def step():
        if 1 <= rank <= 5:
            raise RuntimeError(f"boom on {rank}" if rank == 5 else "boom")
    try:
        run_phase("demo", step)
    except (RankFailure, RuntimeError) as exc:
        out.append(f"{type(exc).__name__}: {exc}")
    try:
        verdict_everywhere("scan", lambda: [f"bad {rank}"] if 1 <= rank <= 5 else [],
                           lambda by_rank, ranks: f"{ranks} ranks, shown {sorted(by_rank.items())}")
    except CheckpointError as exc:
        out.append(str(exc))
    return out


def test_many_failed_ranks_are_counted_and_a_few_named_alike_everywhere():
    """A phase that fails on 5 of 7 ranks: every fine rank raises the same message, naming postmortem.DETAILS of
    them (read from the job's store, not gathered from every rank) and counting the rest; a verdict's findings
    likewise."""
    from distload.transfer import postmortem

    import ast

    results = run_ranks(7, _fail_on_most_ranks)
    assert all(results[r][0] == f"RuntimeError: boom on {r}" if r == 5 else "RuntimeError: boom"
               for r in range(1, 6)), results
    failure, verdict = results[0]
    assert failure.startswith("RankFailure: demo failed on 5 rank(s): "), failure
    named = [int(r) for r in re.findall(r"rank(?:s)? ([\d, ]+):", failure) for r in r.split(", ")]
    assert len(named) == postmortem.DETAILS and set(named) <= {1, 2, 3, 4, 5}, failure
    assert "1 more rank(s) not named here" in failure, failure
    assert ("boom on 5" in failure) == (5 in named), failure
    assert verdict.startswith("5 ranks, shown "), verdict
    shown = ast.literal_eval(verdict.removeprefix("5 ranks, shown "))
    assert len(shown) == postmortem.DETAILS and all(f == [f"bad {r}"] for r, f in shown), verdict
    assert results[6] == results[0], results   # the fine ranks say the same
    assert all(r[1] == verdict for r in results), results


def _load_as_two_nodes(checkpoints: dict, moe_path: str) -> dict:
    """4 ranks presenting themselves as 2 nodes x 2 ranks (torchrun's LOCAL_WORLD_SIZE / GROUP_RANK), as a
    2-node job does: a reader per node, each node's column-parallel rows read on that node."""
    import os

    import torch.distributed as dist

    import distload

    rank = dist.get_rank()
    os.environ.update(LOCAL_WORLD_SIZE="2", GROUP_RANK=str(rank // 2), LOCAL_RANK=str(rank % 2))
    problems, reports = [], {}
    for fam in ("llama", "llama_mqa_tied", "qwen3", "phi3"):
        result = distload.load(checkpoints[fam], tp=4, staging_mib=1, progress=False)
        problems += differences(result.params, _expected(checkpoints[fam], rank, 4), f"{fam} 2 nodes rank{rank}")
        reports[fam] = result.report
    # Experts: ep 2 puts experts 0-1 on node 0 and 2-3 on node 1, read there; the same bytes as one node
    # loads (tests/test_moe.py checks those against the oracle).
    # A sharded save plans as the load does (a rank's part), yet its manifest lists the whole job: the same as the
    # one-node save's, whose plan is the whole job's; and it reloads on the two nodes as saved.
    saves = [f"{moe_path}-saved-{nodes}" for nodes in (2, 1)]
    two = distload.load(moe_path, tp=4, ep=2, staging_mib=1, progress=False, save_sharded=saves[0])
    reports["mixtral"] = two.report
    reloaded = distload.load(saves[0], tp=4, ep=2, staging_mib=1, progress=False)
    problems += differences(reloaded.params, two.params, f"mixtral ep2 2 nodes reloaded rank{rank}")
    os.environ.update(LOCAL_WORLD_SIZE="4", GROUP_RANK="0", LOCAL_RANK=str(rank))
    one = distload.load(moe_path, tp=4, ep=2, staging_mib=1, progress=False, save_sharded=saves[1])
    problems += differences(two.params, one.params, f"mixtral ep2 2 nodes vs 1 node rank{rank}")
    manifests = [(Path(out) / "manifest.json").read_text() for out in saves]
    # Each rank planned its node's part: the other node's experts are not in its plan (plan/build.py rank mode).
    return {"problems": problems, "reports": reports, "part": (two.plan.planned_for, len(two.plan.sources)),
            "one_node_part": (one.plan.planned_for, len(one.plan.sources)), "manifests": manifests}


def test_two_nodes_keep_column_rows_on_their_node(dense_checkpoints, tmp_path):
    """Real gloo ranks as 2 nodes: every rank holds exactly the oracle's shard; each byte is read once by the
    job; a node's ranks receive from the other node only what the plan says crosses, well under what they keep."""
    import distload
    from hf_models import checkpoint_tensors, save_checkpoint

    moe_path = str(save_checkpoint("mixtral", tmp_path / "mixtral"))
    results = run_ranks(4, _load_as_two_nodes, dense_checkpoints, moe_path)
    problems = [p for r in results for p in r["problems"]]
    assert not problems, "\n".join(problems)
    moe_sources = len(distload.inspect(moe_path, tp=4, ep=2, world=4, local_world=2).sources)
    assert [r["part"][0] for r in results] == [0, 1, 2, 3], results
    two_nodes, one_node = results[0]["manifests"]
    assert two_nodes.replace(f"{moe_path}-saved-2", "SAVE") == one_node.replace(f"{moe_path}-saved-1", "SAVE")
    assert set(json.loads(two_nodes)["checkpoint_tensors"]) == set(checkpoint_tensors(moe_path))
    assert all(r["part"][1] < moe_sources and r["one_node_part"] == (None, moe_sources) for r in results), results
    for fam, report in results[0]["reports"].items():
        path = moe_path if fam == "mixtral" else dense_checkpoints[fam]
        assert report["ok"] and report["readers"] == [0, 2], fam
        # an early fetch on one node would read the other node's rows from storage here too
        assert all(r["early_fetch_bytes"] == 0 for r in report["per_rank"]), fam
        assert report["storage_bytes_read"] == report["checkpoint_bytes"] == tensor_bytes(path), fam
        plan = distload.inspect(path, tp=4, ep=2 if fam == "mixtral" else 1, world=4, local_world=2, staging_mib=1)
        crossed = [r["bytes_from_other_nodes"] for r in report["per_rank"]]
        assert crossed == cross_node_bytes(plan), fam
        for r in range(4):
            kept = sum(s.nbytes for s in plan.specs[r].values() if not s.alias_of)
            assert 0 < crossed[r] < 0.25 * kept, (fam, r, crossed[r], kept)  # one big file per node: ~0.5


def _load_in_the_callers_group(path: str, store: str) -> tuple[bool, int]:
    import os
    import sys

    import torch.distributed as dist

    import distload

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=int(os.environ["RANK"]),
                            world_size=int(os.environ["WORLD_SIZE"]))
    try:
        result = distload.load(path, tp=2, progress=False)
        # Imported after this group exists, torch.distributed.nn would pin it, and gloo can abort at exit.
        return "torch.distributed.nn.functional" in sys.modules, len(result.params)
    finally:
        dist.destroy_process_group()


def test_a_callers_own_group_is_used_and_not_pinned(tmp_path):
    """A caller that made its own group (without importing torch.distributed.nn first): distload loads in it
    and does not import the module that would pin it (topology.init_process_group)."""
    from distload.demo import make_demo_checkpoint

    path = make_demo_checkpoint(tmp_path / "demo")
    out = run_ranks(2, _load_in_the_callers_group, str(path), str(tmp_path / "store"), init_group=False)
    assert [pinned for pinned, _ in out] == [False, False], out
    assert all(n > 0 for _, n in out), out
