"""`distload inspect`'s per-rank traffic adds up: every byte a rank is said to send, some rank is said to receive
(a broadcast counts once per rank it reaches on both sides), and the line says it is a plan, not a run."""

from __future__ import annotations

import pytest

from distload.inspect_cmd import describe_plan, inspect_load, rank_traffic
from distload.options import LoadOptions


@pytest.mark.parametrize("family,tp,world,local_world", [("llama", 2, 2, 2), ("qwen2", 2, 4, 2), ("llama", 4, 4, 2)])
def test_bytes_sent_are_bytes_received(dense_checkpoints, family, tp, world, local_world):
    inspection = inspect_load(dense_checkpoints[family], LoadOptions(tp=tp), world=world, local_world=local_world)
    traffic = [rank_traffic(inspection.plan, r) for r in range(world)]
    sent, received = sum(t["bytes_sent"] for t in traffic), sum(t["bytes_received"] for t in traffic)
    assert sent == received > 0, traffic
    assert sum(t["broadcasts"] for t in traffic) > 0   # the norms: the case the counts once disagreed on


def test_inspect_says_what_is_planned_for_a_rank(dense_checkpoints):
    inspection = inspect_load(dense_checkpoints["llama"], LoadOptions(tp=2))
    text = describe_plan(inspection.plan, inspection.route, rank=1, inspection=inspection)
    line = next(l for l in text.splitlines() if l.startswith("rank 1 of 2 as planned (no process started): "))
    assert "it would read 0 B" in line and "bytes counted once per rank they reach" in line, line
