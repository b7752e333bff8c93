"""The hostile corpus (tests/support/hostile/), every case a real torchrun job: each gets its expected outcome.

Every case of the suite's corpus must get its expected outcome: a case distload does not handle yet is not in
CASES (it may wait in a module's EXTRA, which `python -m tests.support.hostile --all` runs too). `pytest -s`
prints the table; `python -m tests.support.hostile` runs the corpus alone.
"""

from __future__ import annotations

import os

import pytest

from hostile import CASES, make_bases, run_corpus, table

pytestmark = pytest.mark.hostile

JOBS_AT_ONCE = int(os.environ.get("HOSTILE_JOBS", "6"))  # torchrun mostly waits; CPU bounds the rest


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile")
    found = run_corpus(CASES, root, make_bases(root, {c.base for c in CASES if c.base}), jobs=JOBS_AT_ONCE)
    print("\n" + table(found))
    return {r.case.id: r for r in found}


@pytest.mark.parametrize("case_id", [c.id for c in CASES])
def test_case_gets_its_expected_outcome(results, case_id):
    r = results[case_id]
    assert r.outcome == r.case.expect, (f"{case_id}: expected {r.case.expect}, got {r.outcome} in {r.seconds:.1f}s: "
                                        f"{r.detail}\n" + "\n".join(f"--- rank {k} (exit {rc}) ---\n{out[-3000:]}"
                                                                    for k, (rc, out) in sorted(r.ranks.items())))
