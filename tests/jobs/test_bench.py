"""scripts/bench.py end to end at smoke size: a few-MB checkpoint, world 2, every loader, cold and warm.

Never a timing assertion: this proves the benchmark runs, measures what it says, and that every loader
it compares filled the same bytes into the same serving layout (their fingerprints agree with distload's).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LOADERS = ["distload", "every-rank-reads", "fastsafetensors", "dcp"]


@pytest.fixture(scope="module")
def quick_bench(tmp_path_factory):
    pytest.importorskip("matplotlib")
    pytest.importorskip("fastsafetensors")
    work = tmp_path_factory.mktemp("bench")
    out = work / "out"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "bench.py"), "--quick", "--workdir", str(work),
                           "--out", str(out), "--loaders", ",".join(LOADERS)],
                          env=env, capture_output=True, text=True, timeout=600)
    log = (out / "bench.log").read_text() if (out / "bench.log").exists() else ""
    assert proc.returncode == 0, f"bench.py failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}\n{log[-3000:]}"
    return out, json.loads((out / "results.json").read_text())


def test_outputs_exist_and_are_well_formed(quick_bench):
    out, results = quick_bench
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (out / "results.md").read_text()
    assert "| scenario | cache | loader |" in md and "Command: `python scripts/bench.py --quick" in md
    rows = results["summary"]
    got = {(r["cache"], r["loader"]) for r in rows}
    assert got == {(c, name) for c in ("cold", "warm") for name in LOADERS}, got
    for r in rows:
        assert not r["errors"], r
        assert r["world"] == 2 and r["nodes"] == 1 and r["reps"] == 1
        assert r["seconds"] > 0 and r["peak_rss_per_rank"] > r["shard_per_rank"] > 0
        assert r["checkpoint_bytes"] > 1 << 20
        assert f"| {r['loader']} |" in md
    assert results["meta"]["command"].startswith("python scripts/bench.py --quick")
    assert "CPU cores" in results["meta"]["machine"]
    # the hardware's own bandwidth, to set the loaders' against (storage on every device; H2D on CUDA)
    (probe,) = results["meta"]["probes"].values()
    assert probe["storage_read_gbps"] > 0 and (probe["world"], probe["nodes"], probe["device"]) == (2, 1, "cpu")
    assert "Bandwidth, 1 node(s) x 2 rank(s) on cpu: storage read cold by one process" in md
    assert {c["claim"] for c in results["checks"]}  # the 'must show' list is evaluated (whatever the verdicts)


def test_every_loader_filled_the_same_bytes(quick_bench):
    _, results = quick_bench
    assert results["fingerprint_problems"] == []
    runs = results["runs"]
    want = {tuple(p["fingerprint"] for p in r["per_rank"]) for r in runs}
    assert len(want) == 1 and None not in next(iter(want)), "loaders disagree on some rank's params"


def test_what_it_measures(quick_bench):
    _, results = quick_bench
    by = {(r["cache"], r["loader"]): r for r in results["summary"]}
    ckpt = by[("cold", "distload")]["checkpoint_bytes"]
    # distload: rank 0 reads every byte (per-process read_bytes, which page-cache hits do not count), the other
    # rank receives its shard; the every-rank-reads baseline receives nothing over the process group.
    if by[("cold", "distload")]["io_read_bytes"]:  # some containers do not account block I/O per process
        assert by[("cold", "distload")]["io_read_bytes"] >= 0.9 * ckpt
    assert by[("warm", "distload")]["received_per_rank"] > 0
    assert by[("warm", "every-rank-reads")]["received_per_rank"] == 0
    runs = [r for r in results["runs"] if r["loader"] == "distload"]
    assert all(len(r["per_rank"]) == 2 and r["seconds"] >= max(p["seconds"] for p in r["per_rank"]) for r in runs)


def one_node_row(loader: str, seconds: float, seconds_all: list[float]) -> dict:
    """A summary row of scripts/bench.py for a cold 4-rank load on one node."""
    return dict(nodes=1, world=4, cache="cold", loader=loader, seconds=seconds, seconds_all=seconds_all,
                scenario="1 node x 4 ranks", disk_read_bytes=None, checkpoint_bytes=1, rss_over_shard=None)


def test_per_repetition_ratios_pair_loaders_within_a_repetition():
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import bench
    finally:
        sys.path.remove(str(REPO / "scripts"))

    def numbers(distload_all, baseline_all):
        summary = [one_node_row("distload", 0.77, distload_all), one_node_row("every-rank-reads", 0.766, baseline_all)]
        (claim, holds, text), = bench.checks(summary, 16 << 20)
        return holds, text

    assert numbers([1.0, 2.0, 3.0, 0.5], [2.0, 2.0, 2.0, 1.0])[1].endswith("; per repetition 0.750x median, 0.50-1.50x")
    assert numbers([1.0, 2.0, 3.0], [2.0, 2.0, 2.0, 1.0])[1] == "0.770s vs 0.766s = 1.005x"  # a failed repetition: no pairs
    holds, text = numbers([0.7, 0.8, 0.9], [0.8, 0.8, 0.8])
    # three decimals: 0.770 vs 0.766 is not "1.00x" that does not hold
    assert not holds and text == "0.770s vs 0.766s = 1.005x; per repetition 1.000x median, 0.87-1.12x", text
