"""scripts/scale_bench.py at smoke size: a tiny sparse checkpoint planned as one rank at world 8 and 16.

No timing assertion: this proves the benchmark writes a checkpoint distload discovers, plans it in fresh
processes as a load plans it (its counts are those `distload.inspect` finds for the same job), and prints a
markdown table whose rows hold numbers.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import distload
from distload.inspect_cmd import rank_traffic

REPO = Path(__file__).resolve().parents[2]


def test_quick_run_prints_a_table_of_numbers(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "scale_bench.py"), "--models", "tiny-llama",
                           "--worlds", "8,16", "--limit-s", "120", "--cache", str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("Command: `python scripts/scale_bench.py --models tiny-llama")
    header = next(line for line in lines if line.startswith("| model |"))
    columns = [c.strip() for c in header.strip("|").split("|")]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines if line.startswith("| tiny-llama |")]
    assert [r[1] for r in rows] == ["8", "16"], proc.stdout
    for row in rows:
        assert len(row) == len(columns), row
        values = {c: float(v.replace(",", "")) for c, v in zip(columns[2:], row[2:])}  # every cell a number
        assert values["tensors"] == 21 and values["buckets"] >= 1 and values["p2p messages (rank)"] >= 1, row
        assert values["detail record B"] > 0 and values["reconcile recv/rank B"] > 0, row
        # The counts are the plan a load makes of that job (8 ranks a node, tp 8), found again by inspect.
        world = int(row[1])
        job = distload.inspect(tmp_path / "tiny-llama", tp=8, world=world, local_world=8)
        traffic = rank_traffic(job, 0)
        assert values["buckets"] == len(job.buckets), (row, len(job.buckets))
        assert values["p2p messages (rank)"] == traffic["sends"] + traffic["receives"], (row, traffic)
    config = json.loads((tmp_path / "tiny-llama" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
