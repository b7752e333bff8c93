"""distload.report.PhaseClock: each phase's own seconds apart from the seconds this rank waited for the others
(the rendezvous, each phase's agreement step), the two adding up to the wall time."""

from __future__ import annotations

import time

from distload.report import PhaseClock, summary_line


def test_waits_are_kept_apart_from_each_phases_own_seconds():
    clock = PhaseClock()
    time.sleep(0.02)
    clock.lap("topology", waited=True)      # the rendezvous is all waiting
    time.sleep(0.01)
    clock.waiting(0.03)                     # more than the phase lasted: capped at the phase
    clock.lap("discover")
    time.sleep(0.03)
    clock.waiting(0.01)
    clock.lap("plan")
    seconds, waits = clock.as_dict(), clock.waiting_dict()
    assert seconds["topology"] == 0 and waits["topology"] >= 0.02
    assert seconds["discover"] == 0 and waits["discover"] >= 0.01
    assert waits["plan"] == 0.01 and seconds["plan"] >= 0.02
    phases = sum(v for k, v in seconds.items() if k != "total") + sum(waits.values())
    assert abs(phases - seconds["total"]) < 1e-3


def test_the_summary_line_says_how_long_this_rank_waited():
    report = {"checkpoint_bytes": 10**9, "seconds": {"plan": 0.1, "total": 1.0}, "waiting": {"topology": 0.25},
              "per_rank": [{"peak_rss_bytes": 1 << 30}], "ok": True, "family": "llama", "world_size": 2, "tp": 2,
              "ep": 1, "readers": [0], "params": 3, "storage_bytes_read": 10**9, "verdict": "fine"}
    assert "in 1.00s (1.00 GB/s, 0.25s of it waiting for other ranks)" in summary_line(report)
    assert "waiting" not in summary_line({**report, "waiting": {}})
