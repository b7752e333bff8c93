"""Expert parallelism (issue 4): every expert leaves storage once and goes only to the ranks that host it.

The reference is independent of distload: `transformers` saved the checkpoints, `safetensors` reads them
back, tests/layout_oracle.py slices them per rank (its `local_expert_ids` covers EPLB), and the expected
placement is computed here from the definitions (linear: group k hosts [k*n/E, (k+1)*n/E); round_robin:
e % E == k; an EPLB map: what it says). Plans are checked in process for every placement; real gloo ranks
(one run_ranks call per world size) and one real torchrun check loaded and saved shards bit for bit, and the
report's bytes: storage read == checkpoint bytes, and each non-reader rank receives about what it keeps.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from checks import assert_rows_stay_on_their_node, differences, tensor_bytes
from spawn import run_ranks

import distload
from distload.errors import PlanError, RuleError
from moe_checks import expected_hosts, expected_shards, materialise, num_experts, stack_experts

# ----------------------------------------------------------------------------------------------------
# Checkpoints


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> dict[str, str]:
    """name -> checkpoint dir. `*_stacked` hold the same values as their per-expert twin."""
    from hf_models import MOE, save_checkpoint

    root = tmp_path_factory.mktemp("moe")
    out = {fam: str(save_checkpoint(fam, root / fam)) for fam in MOE}
    # Layer 0 dense (mlp_only_layers), layer 1 sparse: the rules' [sets] decide which params exist where.
    out["qwen2_moe_mixed"] = str(save_checkpoint("qwen2_moe", root / "qwen2_moe_mixed", mlp_only_layers=[0]))
    for fam in ("qwen3_moe", "mixtral"):
        out[f"{fam}_stacked"] = str(stack_experts(Path(out[fam]), root / f"{fam}_stacked"))
    return out


def oracle_source(name: str) -> str:
    """The per-expert checkpoint whose values a case must reproduce."""
    return name.removesuffix("_stacked")


@dataclass(frozen=True)
class Case:
    ckpt: str
    ep: int
    placement: str = "linear"
    expert_map: tuple[tuple[int, ...], ...] | None = None

    @property
    def id(self) -> str:
        extra = f"-{self.placement}" if self.placement != "linear" else ""
        return f"{self.ckpt}-ep{self.ep}{extra}" + ("-eplb" if self.expert_map else "")


EXPERT_SOURCE = re.compile(r"experts\.(\d+)\.")

PLAN_LAYOUTS = [  # (world, ep, placement, expert map)
    (1, 1, "linear", None), (2, 1, "linear", None), (2, 2, "linear", None), (4, 2, "linear", None),
    (4, 4, "linear", None), (4, 2, "round_robin", None), (4, 4, "round_robin", None),
    (2, 2, "linear", ((0, 1, 2, 3), (3, 1))),              # expert 1 and 3 replicated on both ranks
    (4, 2, "linear", ((0, 1, 2), (0, 1, 2), (1, 2, 3), (1, 2, 3))),
    (4, 4, "linear", ((0,), (0, 1), (2, 3, 1), (3,))),     # expert 0, 1, 3 on two ranks each
    (2, 2, "linear", ((), (0, 1, 2, 3))),                 # rank 0 hosts no expert
]


@pytest.mark.parametrize("ckpt", ["mixtral", "qwen2_moe", "qwen3_moe", "qwen2_moe_mixed", "qwen3_moe_stacked",
                                  "mixtral_stacked"])
def test_plan_delivers_every_expert_to_exactly_its_hosts(moe, ckpt):
    from hf_models import checkpoint_tensors, read_config

    stored = checkpoint_tensors(moe[ckpt])
    original = checkpoint_tensors(moe[oracle_source(ckpt)])
    config = read_config(moe[ckpt])
    n = num_experts(config)
    # 4 ranks also as 2 nodes x 2 ranks (a reader per node): a node's experts are read on that node.
    for world, ep, placement, emap, local_world in [(*x, n) for x in PLAN_LAYOUTS for n in {x[0], min(x[0], 2)}]:
        where = f"{ckpt} world {world} ep {ep} {placement} map {emap} {world // local_world} node(s)"
        plan = distload.inspect(moe[ckpt], tp=world, ep=ep, expert_placement=placement, expert_map=emap,
                                local_world=local_world)
        if local_world < world:
            assert_rows_stay_on_their_node(plan)
        hosts = expected_hosts(n, world, ep, placement, emap)
        for src in plan.sources.values():
            receivers = sorted({d.rank for d in src.deliveries})
            m = EXPERT_SOURCE.search(src.name)
            if m:  # a per-expert tensor: exactly its hosts, each once per param it feeds
                assert receivers == [r for r in range(world) if int(m.group(1)) in hosts[r]], (where, src.name)
            elif src.name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # stacked: rows of expert e
                rows_per = src.rows // n
                for d in src.deliveries:
                    e0, e1 = d.piece.rows[0] // rows_per, (d.piece.rows[1] - 1) // rows_per
                    assert e0 == e1 and e0 in hosts[d.rank], (where, src.name, d)
                for e in range(n):
                    got = sorted({d.rank for d in src.deliveries if d.piece.rows[0] // rows_per == e})
                    assert got == [r for r in range(world) if e in hosts[r]], (where, src.name, e)
        # Read once: the buckets tile every source exactly.
        assert sum(b.read_bytes for b in plan.buckets) == plan.checkpoint_bytes == tensor_bytes(moe[ckpt])
        for rank in range(world):
            want = expected_shards(original, config, rank, world, ep, hosts[rank])
            got = materialise(plan, rank, stored)
            problems = differences(got, want, f"{where} rank {rank}")
            assert not problems, "\n".join(problems)
            for name, spec in plan.specs[rank].items():
                if spec.style == "expert":
                    assert list(spec.experts) == hosts[rank], (where, name)
                    assert spec.global_shape[0] == n


def test_plan_mixed_layers_follow_config(moe):
    """qwen2_moe with mlp_only_layers=[0]: layer 0 has a dense MLP, layer 1 experts; a config.json that
    disagrees with the files is refused before any I/O, naming both sides."""
    from distload.checkpoint import discover
    from distload.plan import build_plan
    from distload.rules import rules_for
    from distload.topology import Layout

    index = discover(moe["qwen2_moe_mixed"])
    plan = build_plan(index.tensors, index.config, rules_for(index.config), Layout(world=2, tp=2, ep=2))
    assert "model.layers.0.mlp.gate_up_proj.weight" in plan.specs[0]
    assert "model.layers.0.mlp.experts.w13_weight" not in plan.specs[0]
    assert "model.layers.1.mlp.experts.w13_weight" in plan.specs[0]
    assert "model.layers.1.mlp.gate_up_proj.weight" not in plan.specs[0]
    wrong = {**index.config, "mlp_only_layers": []}
    with pytest.raises(PlanError) as exc:
        build_plan(index.tensors, wrong, rules_for(wrong), Layout(world=2, tp=2, ep=2))
    msg = str(exc.value)
    assert "missing" in msg and "model.layers.0.mlp.experts.{0..3}.down_proj.weight" in msg
    assert "unexpected" in msg and "model.layers.0.mlp.down_proj.weight" in msg
    # decoder_sparse_step 2: layers 1, 3, ... are sparse, so layer 0 dense and layer 1 sparse again.
    stepped = {**index.config, "mlp_only_layers": [], "decoder_sparse_step": 2}
    plan = build_plan(index.tensors, stepped, rules_for(stepped), Layout(world=2, tp=2, ep=2))
    assert not plan.missing and not plan.unexpected


def test_plan_refuses_bad_placements(moe):
    path = moe["qwen3_moe"]
    bad = {
        "has 3 rank entries; the world size is 4": dict(ep=2, expert_map=((0, 1), (0, 1), (2, 3))),
        "names experts [7] outside 0..3": dict(ep=4, expert_map=((0,), (1,), (2,), (7,))),
        "hosts no rank for experts [3]": dict(ep=4, expert_map=((0,), (1,), (2,), (2,))),
        "ranks 0 and 1 are in one expert group": dict(ep=2, expert_map=((0, 1), (0,), (2, 3), (2, 3))),
        "rank 1 lists an expert twice": dict(ep=4, expert_map=((0,), (1, 1), (2,), (3,))),
    }
    for fragment, kwargs in bad.items():
        with pytest.raises(PlanError, match=re.escape(fragment)):
            distload.inspect(path, tp=4, **kwargs)
    with pytest.raises(PlanError, match=r"num_experts=4, ep=8: ep must divide the number of experts \(try --ep 1, 2, 4\)"):
        distload.inspect(path, tp=8, ep=8)
    with pytest.raises(distload.DistloadError, match=r"--ep 3 must divide the world size 4"):
        distload.inspect(path, tp=4, ep=3)


def test_plan_refuses_a_stacked_tensor_that_disagrees_with_config(moe):
    """Rows per expert != 2 x moe_intermediate_size, or dim 0 != num_experts: refused while planning, by name."""
    from distload.checkpoint import discover
    from distload.plan import build_plan
    from distload.rules import rules_for
    from distload.topology import Layout

    index = discover(moe["qwen3_moe_stacked"])
    rules = rules_for(index.config)
    for what, change in (("rows", lambda t: t[:, :48]), ("3 experts", lambda t: t[:3])):
        tensors = dict(index.tensors)
        name = "model.layers.0.mlp.experts.gate_up_proj"
        shape = tuple(change(torch.empty(tensors[name].shape, device="meta")).shape)
        tensors[name] = dataclasses.replace(tensors[name], shape=shape, nbytes=math.prod(shape) * 4)
        with pytest.raises(PlanError, match=re.escape(name)) as exc:
            build_plan(tensors, index.config, rules, Layout(world=2, tp=2, ep=2))
        want = ("has 48 in dim 1 but config.json says 2 * moe_inter = 64", "moe_intermediate_size=32", "found [4, 48, 64]") \
            if what == "rows" else ("has 3 rows but config.json says experts = 4", "num_local_experts=4", "found [3, 64, 64]")
        assert all(w in str(exc.value) for w in want), str(exc.value)


def test_rules_extensions_are_validated(tmp_path):
    from distload.rules import parse_rules

    head = 'name = "toy"\narchitectures = ["Toy"]\n[dims]\nlayers = "n"\nexperts = "e"\n[loops]\nlayer = "layers"\nexpert = "experts"\n'
    bad = {
        "stacked = true only applies to style expert": '[params."a.{layer}.w"]\nstyle = "column"\nstacked = true\n',
        "which [sets] does not define": '[params."a.{layer}.w"]\nstyle = "column"\nonly = "nope"\n',
        "each alternative is a table with parts": '[params."a.{layer}.w"]\nstyle = "column"\n'
                                                  '[[params."a.{layer}.w".alternative]]\nstyle = "row"\nparts = ["x"]\n',
        "a stacked form has one source without {expert}": '[params."a.{layer}.w"]\nstyle = "expert"\ninner = "row"\n'
                                                           'stacked = true\nparts = ["a.{layer}.{expert}.w"]\n',
        "[sets.s] every names dim 'zz', not in [dims]": '[sets.s]\nloop = "layer"\nevery = "zz"\n',
    }
    for i, (fragment, body) in enumerate(bad.items()):
        path = tmp_path / f"toy{i}.toml"
        path.write_text(head + body)
        with pytest.raises(RuleError, match=re.escape(fragment)):
            parse_rules(path)


def test_inspect_prints_experts_and_bytes_per_rank(moe, capsys):
    from distload.cli import main

    assert main(["inspect", moe["qwen2_moe"], "--tp", "4", "--ep", "2"]) == 0
    out = capsys.readouterr().out
    plan = distload.inspect(moe["qwen2_moe"], tp=4, ep=2)
    rows = [line.split() for line in out.splitlines() if re.match(r"\s+\d+\s", line)]
    assert [r[0] for r in rows] == ["0", "1", "2", "3"]
    for r, cells in enumerate(rows):
        keeps, expert_bytes, experts = int(cells[2].replace(",", "")), int(cells[5].replace(",", "")), cells[6]
        assert experts == ("0-1" if r < 2 else "2-3")
        # Independently: 2 sparse layers x 2 local experts x (w13 [2*I/2, H] + w2 [H, I/2]) float32.
        config = json.loads((Path(moe["qwen2_moe"]) / "config.json").read_text())
        i, h = config["moe_intermediate_size"], config["hidden_size"]
        assert expert_bytes == 2 * 2 * (2 * (i // 2) * h + h * (i // 2)) * 4
        assert keeps == sum(s.nbytes for s in plan.specs[r].values() if not s.alias_of)


def test_inspect_plans_as_the_rank_does_and_totals_the_job(moe, capsys):
    """On two nodes inspect times what --rank plans in the load (its node's part: the other node's experts left
    out) and prints the job's totals from the whole plan."""
    from distload.checkpoint import discover
    from distload.cli import main
    from distload.plan import build_plan
    from distload.rules import rules_for
    from distload.topology import Layout

    assert main(["inspect", moe["qwen2_moe"], "--tp", "4", "--ep", "2", "--world", "4", "--local-world", "2",
                 "--rank", "3"]) == 0
    out = capsys.readouterr().out
    whole = distload.inspect(moe["qwen2_moe"], tp=4, ep=2, world=4, local_world=2)
    index = discover(moe["qwen2_moe"])
    mine = build_plan(index.tensors, index.config, rules_for(index.config),
                      Layout(world=4, tp=4, ep=2, readers=(0, 2), local_world=2), rank=3)
    assert f"checkpoint tensors {len(whole.sources)}, bytes {whole.checkpoint_bytes:,}, buckets {len(whole.buckets)}" in out
    assert len(mine.sources) < len(whole.sources) and len(mine.buckets) < len(whole.buckets)
    assert f"({len(mine.sources):,} sources, {len(mine.buckets):,} buckets of its block's part)" in out, out


def test_stacked_file_is_transformers_own_layout(moe):
    """transformers loads our stacked file straight into its stacked params (no conversion applies) and gets
    the same model as from the per-expert file: the dim order we support is the one transformers uses."""
    from transformers import AutoModelForCausalLM

    a = AutoModelForCausalLM.from_pretrained(moe["qwen3_moe"]).state_dict()
    b = AutoModelForCausalLM.from_pretrained(moe["qwen3_moe_stacked"]).state_dict()
    assert sorted(a) == sorted(b) and any(k.endswith("experts.gate_up_proj") for k in a)
    assert all(torch.equal(a[k], b[k]) for k in a)


# ----------------------------------------------------------------------------------------------------
# Real gloo ranks: loaded and saved shards, and the report's bytes


def _load_cases(checkpoints: dict, cases: list[Case], out_root: str) -> list[dict]:
    import torch.distributed as dist
    from safetensors.torch import load_file

    from hf_models import checkpoint_tensors, read_config

    rank, world = dist.get_rank(), dist.get_world_size()
    out = []
    for case in cases:
        path = checkpoints[case.ckpt]
        save = Path(out_root) / f"{case.id}-w{world}"
        result = distload.load(path, tp=world, ep=case.ep, expert_placement=case.placement,
                               expert_map=case.expert_map, save_sharded=str(save), progress=False)
        config = read_config(path)
        hosts = expected_hosts(num_experts(config), world, case.ep, case.placement, case.expert_map)
        want = expected_shards(checkpoint_tensors(checkpoints[oracle_source(case.ckpt)]), config, rank, world,
                               case.ep, hosts[rank])
        where = f"{case.id} world {world} rank {rank}"
        problems = differences(result.params, want, f"{where} loaded")
        saved = load_file(str(save / f"rank-{rank:05d}-of-{world:05d}.safetensors"))
        problems += differences(saved, want, f"{where} saved")
        manifest = json.loads((save / "manifest.json").read_text())
        for name, entry in manifest["params"].items():
            if entry["style"] == "expert" and entry["ranks"][rank]["experts"] != hosts[rank]:
                problems.append(f"{where}: manifest {name} experts {entry['ranks'][rank]['experts']} != {hosts[rank]}")
        kept = sum(t.numel() * t.element_size() for n, t in result.params.items() if not result.specs[n].alias_of)
        out.append({"case": case, "problems": problems, "kept": kept, "report": result.report})
    return out


def check_report(case: Case, report: dict, kept: list[int], checkpoint_bytes: int) -> None:
    assert report["ok"] and report["ep"] == case.ep, (case.id, report["verdict"])
    assert report["storage_bytes_read"] == report["checkpoint_bytes"] == checkpoint_bytes, case.id
    for r, rec in enumerate(report["per_rank"]):
        if r in report["readers"]:
            continue  # the reader keeps its share by a local copy: nothing arrives over the wire
        # Expert bytes never travel to a non-owner: a rank receives what it keeps, less vocab padding.
        assert 0.9 * kept[r] <= rec["bytes_received"] <= kept[r], (case.id, r, rec["bytes_received"], kept[r])


WORLD_CASES = {
    2: [Case(f, ep) for f in ("mixtral", "qwen2_moe", "qwen3_moe") for ep in (1, 2)]
    + [Case("mixtral", 2, expert_map=((0, 1, 2, 3), (1, 3))), Case("qwen3_moe_stacked", 2),
       Case("qwen2_moe_mixed", 2), Case("qwen3_moe", 2, expert_map=((), (0, 1, 2, 3)))],  # rank 0 hosts none
    4: [Case(f, ep) for f in ("mixtral", "qwen2_moe", "qwen3_moe") for ep in (2, 4)]
    + [Case("qwen3_moe", 2, expert_map=((0, 1, 2), (0, 1, 2), (1, 2, 3), (1, 2, 3))),
       Case("mixtral", 2, "round_robin"), Case("qwen3_moe_stacked", 4), Case("mixtral_stacked", 2)],
}


@pytest.mark.parametrize("world", sorted(WORLD_CASES))
def test_moe_end_to_end(moe, tmp_path, world):
    results = run_ranks(world, _load_cases, moe, WORLD_CASES[world], str(tmp_path))
    problems = [p for per_rank in results for res in per_rank for p in res["problems"]]
    assert not problems, "\n".join(problems)
    for i, case in enumerate(WORLD_CASES[world]):
        kept = [per_rank[i]["kept"] for per_rank in results]
        check_report(case, results[0][i]["report"], kept, tensor_bytes(moe[case.ckpt]))


def test_torchrun_load_tp4_ep2_save_and_report(moe, tmp_path):
    from safetensors.torch import load_file

    from hf_models import checkpoint_tensors, read_config
    from layout_oracle import serving_shards

    ckpt, out, report_path = moe["qwen2_moe"], tmp_path / "shards", tmp_path / "report.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
           "-m", "distload", "load", ckpt, "--tp", "4", "--ep", "2", "--save-sharded", str(out),
           "--report", str(report_path), "--no-progress"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "distload: OK qwen2_moe world=4 tp=4 ep=2" in proc.stdout
    hf, config = checkpoint_tensors(ckpt), read_config(ckpt)
    hosts = expected_hosts(num_experts(config), 4, 2)
    kept = []
    for rank in range(4):
        saved = load_file(str(out / f"rank-{rank:05d}-of-00004.safetensors"))
        problems = differences(saved, serving_shards(hf, config, rank, 4, ep_size=2, local_expert_ids=hosts[rank]),
                           f"torchrun rank {rank} saved")
        assert not problems, "\n".join(problems)
        kept.append(sum(t.numel() * t.element_size() for t in saved.values()))
    check_report(Case("qwen2_moe", 2), json.loads(report_path.read_text()), kept, tensor_bytes(ckpt))
