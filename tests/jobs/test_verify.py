"""`distload verify` end to end: every family at tp 2 and 4 agrees with transformers, and a wrong layout fails.

What runs where (a torchrun costs ~10 s on the CI's 2 cores, a gloo world in run_ranks a few seconds):
- every family x tp {2, 4} (MoE also at ep 2) goes through `distload.verify.verify` - the function the CLI
  calls - inside ONE run_ranks call per world size: the real load, forward, rank-0 comparison, logits file
  and verdict broadcast; each rank returns its verdict, so "every rank exits with the same code" is checked;
- real `torchrun -m distload verify` for the CLI contract: tp 4 on the MQA + tied model (kv head
  replicated 4 ways) with --save-logits, tp 2 / ep 2 on Qwen2-MoE, and the negative case (k and v parts
  swapped by a --config rules file) at tp 2.
The reference is transformers in this test process, from the model object that was saved, independent of
both distload and the rank-0 comparison inside verify.
"""

from __future__ import annotations

import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from distload.models import FAMILIES as FORWARD_FAMILIES
from distload.rules import shipped_families
from hf_models import DENSE, FAMILIES, MOE, build_model, save_checkpoint
from spawn import run_ranks
from jobs import ROOT, torchrun_verify

TOL = 2e-2
# Ids across the vocab (250), including its last real row next to the zero padding, and id 0.
TOKENS = "1,17,42,7,249,0,128,63"
INPUT_IDS = [int(t) for t in TOKENS.split(",")]


def missing_rules(family: str) -> str | None:
    """Why a family cannot be loaded yet (its rules file does not ship), else None."""
    arch = FORWARD_FAMILIES[FAMILIES[family]["model_type"]].architecture
    if any(arch in rules.architectures for rules in shipped_families()):
        return None
    return f"no shipped configs/*.toml lists {arch}: configs/{FAMILIES[family]['model_type']}.toml is not there yet"


AVAILABLE = [f for f in DENSE + MOE if missing_rules(f) is None]


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """The measure verify prints: max |got - ref| / max |ref|."""
    return ((got - ref).abs().max() / ref.abs().max()).item()


@dataclass(frozen=True)
class Case:
    family: str
    ep: int = 1
    dtype: str = "float32"
    rules: str | None = None          # --config: a rules file instead of the shipped one
    hide_transformers: bool = False   # as if transformers were not installed
    tp: int | None = None             # None: the world size
    placement: str = "linear"         # --expert-placement
    expert_map: tuple[tuple[int, ...], ...] | None = None  # --expert-map (EPLB): per rank, the experts it hosts

    @property
    def id(self) -> str:
        extra = [f"ep{self.ep}"] + ([self.dtype] if self.dtype != "float32" else [])
        extra += ["kv-swapped"] if self.rules else []
        extra += ["no-transformers"] if self.hide_transformers else []
        extra += [f"tp{self.tp}"] if self.tp else []
        extra += [self.placement] if self.placement != "linear" else []
        extra += ["hosts" + "_".join("".join(map(str, ids)) for ids in self.expert_map)] if self.expert_map else []
        return "-".join([self.family, *extra])


def matching_cases(world: int) -> list[Case]:
    """Cases that must agree with transformers: every family, MoE also with experts spread over 2 groups."""
    out = [Case(f) for f in AVAILABLE]
    out += [Case(f, ep=2) for f in AVAILABLE if f in MOE]
    # Local experts that are not a contiguous block, and EPLB replicas (expert hosted twice, counted once):
    # the forward must take each rank's expert ids from what the load put there.
    moe = [f for f in AVAILABLE if f in MOE]
    if moe:
        out += [Case(moe[-1], ep=2, placement="round_robin")]
        out += [Case(moe[0], ep=2, expert_map=((0, 1, 2, 3), (1, 3)) if world == 2 else
                     ((0, 1, 2), (0, 1, 2), (1, 2, 3), (1, 2, 3)))]
    return out


def cases(world: int, swapped_rules: str) -> list[Case]:
    out = matching_cases(world)
    if world == 2:
        out += [Case("llama", dtype="bfloat16"), Case("llama", rules=swapped_rules), Case("llama", tp=1),
                Case("qwen2", hide_transformers=True)]  # last: it hides transformers for the rest of the process
    return out


def _verify_cases(case_list: list[Case], checkpoints: dict, out_dir: str) -> list[dict]:
    """On every rank: verify each case the way the CLI does; this rank's verdicts and logits."""
    import torch.distributed as dist

    from distload.errors import DistloadError
    from distload.verify import verify

    torch.set_num_threads(1)  # W processes share the CI cores
    world = dist.get_world_size()
    results = []
    for case in case_list:
        if case.hide_transformers:
            sys.modules["transformers"] = None  # importlib finds no such module from here on
        try:
            out = verify(checkpoints[case.family], input_ids=INPUT_IDS, dtype=case.dtype, tolerance=TOL,
                         logits_file=str(Path(out_dir) / f"{case.id}-tp{world}.safetensors"),
                         tp=case.tp or world, ep=case.ep, config=case.rules, expert_placement=case.placement,
                         expert_map=case.expert_map, progress=False)
        except DistloadError as exc:  # the CLI prints it and exits 1 on this rank
            results.append(dict(id=case.id, error=str(exc)))
            continue
        # Plain lists: a tensor would go back through shared memory that dies with this process.
        results.append(dict(id=case.id, verdict=out.verdict, logits=out.logits.tolist(), tp=out.tp, ep=out.ep))
    return results


@pytest.fixture(scope="module")
def swapped_rules(tmp_path_factory) -> str:
    """Llama's rules with the k and v parts of qkv_proj swapped: loads 'fine', computes garbage."""
    d = tmp_path_factory.mktemp("rules")
    shutil.copy(ROOT / "configs" / "_decoder.toml", d / "_decoder.toml")
    text = (ROOT / "configs" / "llama.toml").read_text().replace('name = "llama"', 'name = "llama_kv_swapped"')
    text += ('\n[params."model.layers.{layer}.self_attn.qkv_proj.weight"]\nstyle = "qkv"\n'
             'parts = ["model.layers.{layer}.self_attn.q_proj.weight", "model.layers.{layer}.self_attn.v_proj.weight",'
             ' "model.layers.{layer}.self_attn.k_proj.weight"]\n')
    (d / "llama_kv_swapped.toml").write_text(text)
    return str(d / "llama_kv_swapped.toml")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("ckpt")
    return {f: str(save_checkpoint(f, root / f)) for f in AVAILABLE}


@pytest.fixture(scope="module")
def reference() -> dict[str, torch.Tensor]:
    """family -> transformers' fp32 logits, from the in-memory model that was saved (same seed)."""
    out = {}
    with torch.no_grad():
        for f in AVAILABLE:
            out[f] = build_model(f)(torch.tensor([INPUT_IDS])).logits[0]
    return out


@pytest.fixture(scope="module")
def api_runs(checkpoints, swapped_rules, tmp_path_factory):
    """world -> (out dir, per rank: [result per case]); one run_ranks call per world size, made once."""
    cache = {}

    def get(world: int):
        if world not in cache:
            out_dir = tmp_path_factory.mktemp(f"logits-tp{world}")
            cache[world] = (out_dir, run_ranks(world, _verify_cases, cases(world, swapped_rules), checkpoints,
                                               str(out_dir)))
        return cache[world]
    return get


def _by_id(per_rank: list[list[dict]], case_id: str) -> list[dict]:
    """One case's result on every rank; the verdict must be the same object on all of them."""
    rows = [next(r for r in results if r["id"] == case_id) for results in per_rank]
    assert all("verdict" in r for r in rows), f"{case_id}: {rows}"
    assert len({r["verdict"] for r in rows}) == 1, f"{case_id}: ranks disagree: {[r['verdict'] for r in rows]}"
    return rows


def _saved_logits(path: Path) -> torch.Tensor:
    from safetensors.torch import load_file

    tensors = load_file(str(path))
    assert list(tensors) == ["logits"] and tensors["logits"].dtype == torch.float32
    return tensors["logits"]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("family", DENSE + MOE)
def test_verify_matches_transformers(api_runs, reference, family, world):
    if missing_rules(family):
        pytest.skip(missing_rules(family))
    out_dir, per_rank = api_runs(world)
    for case in [c for c in matching_cases(world) if c.family == family]:
        rows = _by_id(per_rank, case.id)
        verdict, ref = rows[0]["verdict"], reference[family]
        assert (rows[0]["tp"], rows[0]["ep"]) == (world, case.ep)
        assert verdict.compared and verdict.ok and verdict.exit_code == 0, verdict
        assert verdict.max_rel < TOL and verdict.argmax_same, verdict
        saved = _saved_logits(out_dir / f"{case.id}-tp{world}.safetensors")
        assert saved.shape == ref.shape == (len(INPUT_IDS), 250)
        assert rel_err(saved, ref) < TOL and torch.equal(saved.argmax(-1), ref.argmax(-1)), rel_err(saved, ref)
        for r in rows:  # the gathered logits are the same on every rank
            assert torch.equal(torch.tensor(r["logits"]), saved)


def test_verify_bf16_compute(api_runs, reference):
    """bf16 stays within tolerance; tiny random models have near-tie logits (top-2 gap 0.005 where bf16 errs by
    0.04), so an argmax flip must be verify's FAIL and must be at such a near tie."""
    out_dir, per_rank = api_runs(2)
    verdict = _by_id(per_rank, "llama-ep1-bfloat16")[0]["verdict"]
    assert verdict.compared and 0 < verdict.max_rel < TOL, verdict  # bf16 really ran: not fp32-exact
    assert verdict.ok == verdict.argmax_same, verdict
    if not verdict.argmax_same:
        assert verdict.exit_code == 1 and "a near tie" in verdict.message, verdict
    saved, ref = _saved_logits(out_dir / "llama-ep1-bfloat16-tp2.safetensors"), reference["llama"]
    assert rel_err(saved, ref) < TOL
    ours = saved.argmax(-1)
    assert (ref.max(-1).values - ref.gather(1, ours[:, None])[:, 0]).max() <= verdict.max_abs


def test_wrong_layout_fails_on_every_rank(api_runs):
    rows = _by_id(api_runs(2)[1], "llama-ep1-kv-swapped")
    verdict = rows[0]["verdict"]
    assert not verdict.ok and verdict.exit_code == 1 and verdict.max_rel > TOL and not verdict.argmax_same, verdict
    assert "FAIL" in verdict.message and "argmax differs" in verdict.message and "near tie" not in verdict.message
    assert verdict.diverging_layer == 0 and "hidden states first diverge at layer 0" in verdict.message, verdict


def test_without_transformers_prints_and_skips(api_runs, reference):
    out_dir, per_rank = api_runs(2)
    verdict = _by_id(per_rank, "qwen2-ep1-no-transformers")[0]["verdict"]
    assert not verdict.compared and verdict.ok and verdict.exit_code == 0 and verdict.max_rel is None, verdict
    assert "comparison skipped" in verdict.message
    # ... and the logits it saved are still right
    assert rel_err(_saved_logits(out_dir / "qwen2-ep1-no-transformers-tp2.safetensors"), reference["qwen2"]) < TOL


def test_tp_below_world_refused_on_every_rank(api_runs):
    """verify runs one TP group: data-parallel replicas (tp < world) are refused, before loading."""
    rows = [next(r for r in results if r["id"] == "llama-ep1-tp1") for results in api_runs(2)[1]]
    assert [r.get("error", "").split(":")[0] for r in rows] == ["verify --tp 1 on 2 ranks"] * 2, rows
    assert "--nproc-per-node 1" in rows[0]["error"]


# ----------------------------------------------------------------------------------------------------
# The CLI through real torchrun


def _printed_errors(out: str) -> tuple[float, bool]:
    m = re.search(r"max rel err ([0-9.e+-]+) \(.*argmax same: (True|False)", out)
    assert m, out
    return float(m.group(1)), m.group(2) == "True"


CLI_CASES = [("llama_mqa_tied", 4, 1), ("qwen2_moe", 2, 2)]


@pytest.mark.parametrize("family,tp,ep", CLI_CASES, ids=[f"{f}-tp{t}-ep{e}" for f, t, e in CLI_CASES])
def test_torchrun_verify(checkpoints, reference, tmp_path, family, tp, ep):
    if missing_rules(family):
        pytest.skip(missing_rules(family))
    logits_file = tmp_path / "logits.safetensors"
    proc = torchrun_verify(tp, checkpoints[family], "--tp", str(tp), "--ep", str(ep), "--input-ids", TOKENS,
                     "--save-logits", str(logits_file))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rel, same = _printed_errors(proc.stdout)
    assert rel < TOL and same, proc.stdout
    assert f"world {tp} (tp {tp}, ep {ep})" in proc.stdout and "distload verify: OK" in proc.stdout
    saved = _saved_logits(logits_file)
    assert saved.shape == (len(INPUT_IDS), 250)
    assert rel_err(saved, reference[family]) < TOL and torch.equal(saved.argmax(-1), reference[family].argmax(-1))


def test_torchrun_verify_wrong_layout_exits_nonzero(checkpoints, swapped_rules):
    proc = torchrun_verify(2, checkpoints["llama"], "--tp", "2", "--input-ids", TOKENS, "--config", swapped_rules)
    assert proc.returncode != 0, proc.stdout
    rel, same = _printed_errors(proc.stdout)
    assert rel > TOL and not same, proc.stdout
    assert "distload verify: FAIL" in proc.stdout and "argmax differs" in proc.stdout
