"""scripts/s3_bench.py end to end at smoke size: a few-MB checkpoint on the test S3 server, 1 node x 2 ranks, every
loader once. Never a timing assertion: the bytes and requests the server's log counts are the robust numbers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_quick_bench_counts_what_the_server_sent(tmp_path):
    pytest.importorskip("runai_model_streamer")
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "s3_bench.py"), "--quick", "--out", str(out)],
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=900)
    log = (out / "jobs.log").read_text() if (out / "jobs.log").exists() else ""
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}\n{log[-3000:]}"
    results = json.loads((out / "results.json").read_text())
    by = {s["loader"]: s for s in results["summary"]}
    assert sorted(by) == ["distload", "distload-cached", "every-rank-fetches", "runai"]
    assert by["distload"]["bytes_x_checkpoint"] >= 1.0 and by["distload"]["bytes_x_checkpoint"] < 1.01  # + headers
    assert by["distload-cached"]["get_requests"] == 0 and by["distload-cached"]["bytes_served"] == 0
    for other in ("runai", "every-rank-fetches"):   # every rank fetched every byte
        assert by[other]["bytes_x_checkpoint"] >= 2.0, by[other]
    assert "| 1 x 2 | distload |" in (out / "results.md").read_text()
