"""scripts/refit_bench.py end to end at smoke size: trainer 2 -> serving 2, a few MB, both methods.

Never a timing assertion: the bytes each serving rank receives (distload: its own shard; the baseline: every
full tensor), and that both methods leave every serving rank's params bit for bit the same.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_refit_bench_quick(tmp_path):
    out = tmp_path / "refit.json"
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "refit_bench.py"), "--quick", "--workdir",
                           str(tmp_path), "--out", str(out)], env={**os.environ, "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    s = json.loads(out.read_text())
    d, b = s["methods"]["distload"], s["methods"]["broadcast"]
    # each serving rank receives only its shard (vocab padding rows are not sent), each byte sent once
    assert all(0 < got <= own for got, own in zip(d["bytes_received_per_serving_rank"], d["own_shard_bytes"]))
    assert b["bytes_received_per_serving_rank"] == [s["meta"]["checkpoint_bytes"]] * 2
    assert sum(d["trainer_bytes_sent"]) == sum(d["bytes_received_per_serving_rank"])
    assert s["same_params"] and len(set(d["fingerprints"])) == 2
    assert "| distload |" in proc.stdout and "| broadcast |" in proc.stdout
