"""Planning is bounded by --timeout: pure work past it stops with an error naming the option (deadline.py),
on its own and inside a real 2-rank load whose planning is made slow on purpose."""

from __future__ import annotations

import time

import pytest

from distload.deadline import DeadlineExceeded, within
from spawn import run_ranks


def test_work_past_its_seconds_is_stopped_naming_the_option():
    start = time.monotonic()
    with pytest.raises(DeadlineExceeded, match=r"planning took longer than --timeout 0\.2 s"):
        with within(0.2, "planning"):
            while time.monotonic() - start < 60:  # pure Python, as planning is; ends alone if never stopped
                pass


def test_work_within_its_seconds_and_unbounded_work_run_to_the_end():
    with within(5, "planning"):
        total = sum(range(1000))
    with within(None, "planning"), within(float("inf"), "planning"):
        total += 1
    assert total == 499501
    with within(0.2, "planning"):
        pass
    time.sleep(0.4)  # the timer is off once the body ended: nothing fires later


def _slow_planning_load(path: str) -> str:
    import distload
    import distload.sources.checkpoint as sources

    def slow_build_plan(*args, **kwargs):  # a planner stuck in pure Python (ends alone if never stopped)
        start = time.monotonic()
        while time.monotonic() - start < 60:
            pass
        raise AssertionError("planning was not stopped at --timeout")

    sources.build_plan = slow_build_plan
    try:
        distload.load(path, timeout_s=3, progress=False)
    except distload.DistloadError as e:
        return str(e)
    return "loaded"


def test_a_load_whose_planning_outlasts_timeout_is_refused_on_every_rank(dense_checkpoints):
    messages = run_ranks(2, _slow_planning_load, str(dense_checkpoints["llama"]), timeout=120)
    for rank, message in enumerate(messages):
        assert "planning took longer than --timeout 3 s" in message, (rank, message)
