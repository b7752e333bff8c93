"""The cyclic collector leaves the objects that existed before a load alone while it runs (distload/gc_freeze.py).

No timing here: what is checked is what a full collection during a load would walk. A fresh interpreter
with torch imported holds ~170k tracked objects; while the load plans, the collector must track only what
the load allocated, and everything must be handed back afterwards.
"""

from __future__ import annotations

import gc
import inspect
import json
import subprocess
import sys

from distload.gc_freeze import earlier_objects_frozen
from distload.loader import run_load


def test_freeze_is_scoped_and_leaves_a_process_that_manages_it_alone():
    assert gc.get_freeze_count() == 0
    before = len(gc.get_objects())
    with earlier_objects_frozen():
        assert gc.get_freeze_count() >= before * 0.9
        assert len(gc.get_objects()) < before * 0.1  # frozen objects are not tracked by any generation
    assert gc.get_freeze_count() == 0 and len(gc.get_objects()) >= before * 0.9
    gc.freeze()  # the process froze objects itself: not ours to unfreeze
    try:
        frozen = gc.get_freeze_count()
        with earlier_objects_frozen():
            assert gc.get_freeze_count() == frozen
        assert gc.get_freeze_count() == frozen
    finally:
        gc.unfreeze()
    gc.disable()  # collector off: nothing to keep it from
    try:
        with earlier_objects_frozen():
            assert gc.get_freeze_count() == 0
    finally:
        gc.enable()
    assert "options" in inspect.signature(run_load).parameters  # the decorator keeps the API's signature


_PROBE = r"""
import gc, json, sys
import torch, distload
import distload.loader as loader
import distload.sources.checkpoint as sources
from distload.options import LoadOptions
seen = []
plan = sources.build_plan
def build_plan(*args, **kwargs):  # what a collection while planning would have to walk
    seen.append(len(gc.get_objects()))
    return plan(*args, **kwargs)
sources.build_plan = build_plan
before = len(gc.get_objects())  # a fresh process, as torchrun starts it
load = loader.run_load if sys.argv[2] == "frozen" else loader.run_load.__wrapped__
load(sys.argv[1], LoadOptions(progress=False))
print(json.dumps({"before": before, "seen": seen, "frozen_after": gc.get_freeze_count(), "after": len(gc.get_objects())}))
"""


def test_collections_during_a_load_skip_what_existed_before(dense_checkpoints):
    out = {}
    for mode in ("frozen", "plain"):
        run = subprocess.run([sys.executable, "-c", _PROBE, str(dense_checkpoints["llama"]), mode],
                             capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-3000:]
        out[mode] = json.loads(run.stdout.strip().splitlines()[-1])
    frozen, plain = out["frozen"], out["plain"]
    assert frozen["before"] > 50_000, frozen["before"]  # torch imported: what the freeze is for
    # without the freeze a collection while planning walks the whole process; with it, only the load's objects
    assert plain["seen"] and min(plain["seen"]) >= 0.9 * plain["before"], plain
    assert frozen["seen"] and max(frozen["seen"]) < 0.2 * frozen["before"], frozen
    # and afterwards every object is back where the collector sees it
    assert frozen["frozen_after"] == 0 and frozen["after"] >= 0.9 * frozen["before"], frozen
