"""scripts/refit_plan_scale.py's smoke run (BENCHMARKS.md "Refit: planning once"): one row, its bytes exact."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "refit_plan_scale.py"


def test_the_planning_table_has_a_row_per_trainer_world_covering_the_shard_exactly():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--trainers", "4,8", "--repeat", "1"], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = re.findall(r"^\| (\d+) \| 4 \| [\d.]+ \| [\d.]+ \| [\d.]+ \| (\d+) \| \d+ \| \d+ \| ([\d.]+) \|$", proc.stdout,
                      re.M)
    assert [(int(t), int(senders), ratio) for t, senders, ratio in rows] == [(4, 4, "1.000"), (8, 8, "1.000")], \
        proc.stdout
