"""The progress bar as a user sees it: a ~0.4 GB load under torchrun on a pseudo-terminal shows rank 0's bar (bytes,
rate) on every route, the default one-node route (node pulls) first; the same load piped shows none."""

from __future__ import annotations

import json
import re

import pytest

from hf_models import save_sized_llama
from jobs import torchrun, torchrun_on_a_terminal

BAR = re.compile(r"distload \[#* *\] \d+\.\d/(\d+\.\d) MB \((\d+)%\), [\d.]+ [kMG]?B/s")


@pytest.fixture(scope="module")
def sized(tmp_path_factory):
    return save_sized_llama(tmp_path_factory.mktemp("sized") / "llama")


@pytest.mark.parametrize("route,flags,env", [("node-pulls", (), {}), ("owner-reads", ("--readers", "owners"), {}),
                                             ("wire", (), {"DISTLOAD_PULL": "0"})])
def test_a_load_on_a_terminal_shows_rank_0s_bar(sized, tmp_path, route, flags, env):
    report = tmp_path / "report.json"
    rc, out = torchrun_on_a_terminal(2, "load", str(sized), "--tp", "2", "--report", str(report), *flags, env=env)
    assert rc == 0, out
    assert json.loads(report.read_text())["route"]["kind"] == route
    bars = BAR.findall(out)
    assert bars, out[-3000:]
    assert bars[-1][1] == "100", bars[-1]       # it ends full
    total_mb = float(bars[-1][0])
    checkpoint = json.loads(report.read_text())["checkpoint_bytes"]
    # rank 0's share (owner reads: its own pieces, half of the sharded bytes and the replicated ones), else all
    assert (0.4 if route == "owner-reads" else 0.99) * checkpoint / 1e6 <= total_mb <= checkpoint / 1e6 + 0.1, bars[-1]
    assert "distload: OK llama" in out


def test_the_same_load_piped_shows_no_bar(sized):
    proc = torchrun(2, "load", str(sized), "--tp", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "distload: OK llama" in proc.stdout
    assert "distload [" not in proc.stdout + proc.stderr
    assert " MB " in proc.stdout and "0.000 GB" not in proc.stdout   # the summary in units that fit
