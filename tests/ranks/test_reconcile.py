"""Reconciliation on real gloo ranks: one fixed-size summary per rank when all is well, and, when something
differs, a verdict that names the param and the rank exactly (written twice, never written, undeclared,
tied alias, replicas that differ, a rank that failed), identical on every rank."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from distload.errors import DistloadError
from distload.plan import ParamSpec
from distload.reconcile import SUMMARY_BYTES, coverage, local_record, reconcile, summary_of
from distload.topology import Layout
from spawn import run_ranks

WORLD = 4


def _plan(missing=()):
    specs = {"a.weight": ParamSpec("a.weight", "column", "F32", (16, 8), (4, 8)),
             "norm.weight": ParamSpec("norm.weight", "replicate", "F32", (8,), (8,)),
             "tied.weight": ParamSpec("tied.weight", "column", "F32", (16, 8), (4, 8), alias_of="a.weight")}
    return SimpleNamespace(specs=(specs,) * WORLD, missing=tuple(missing), unexpected=(),
                           layout=Layout(world=WORLD, tp=WORLD))


def _inputs(rank: int, case: str):
    a = torch.full((4, 8), float(rank))
    params = {"a.weight": a, "norm.weight": torch.ones(8), "tied.weight": a}
    written = {"a.weight": [(0, 4, 0, 8)], "norm.weight": [(0, 8, 0, 1)]}
    report = {"rank": rank, "bytes_read": 10 * rank, "transfer_path": "p2p", "read_strategy": None}
    if case == "twice" and rank == 2:
        written["a.weight"] = [(0, 4, 0, 8), (2, 4, 0, 8)]
    if case == "never" and rank == 1:
        written["a.weight"] = [(0, 2, 0, 8)]
    if case == "undeclared" and rank == 3:
        params["extra.weight"] = torch.zeros(2)
    if case == "alias" and rank == 0:
        params["tied.weight"] = a.clone()
    if case == "replicas" and rank == 3:
        params["norm.weight"] = torch.full((8,), 2.0)
    if case == "report-keys" and rank == 2:
        report["checksum_files_verified"] = 3
    if case == "report-large":
        report["transfer_path"] = "x" * (SUMMARY_BYTES * rank)
    if case == "no-report":
        report = None
    return params, written, report


def _fingerprints_failing_on_rank1(rank):
    from distload.kernels import fingerprints

    def fps(tensors):
        if rank == 1:
            raise RuntimeError("injected fingerprint failure")
        return fingerprints(tensors)
    return fps


CASES = ["clean", "twice", "never", "undeclared", "alias", "replicas", "report-keys", "report-large", "no-report",
         "missing-not-strict", "replicas-not-strict", "error"]


def _every_case():
    rank = torch.distributed.get_rank()
    out = {}
    for case in CASES:
        params, written, report = _inputs(rank, case.replace("-not-strict", ""))
        plan = _plan(missing=["b.weight"] if case.startswith("missing") else ())
        kwargs = dict(strict=not case.endswith("not-strict"), report_record=report)
        if case == "error":
            kwargs["fingerprints"] = _fingerprints_failing_on_rank1(rank)
        try:
            v = reconcile(plan, rank, params, written, **kwargs)
            out[case] = ("ok", v.ok, v.params, v.summary(), v.rank_reports, v.replicas_differ)
        except (DistloadError, RuntimeError) as exc:
            out[case] = (type(exc).__name__, str(exc))
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(WORLD, _every_case)


def _same_everywhere(results, case):
    per_rank = [r[case] for r in results]
    assert all(x == per_rank[0] for x in per_rank), f"{case}: ranks disagree: {per_rank}"
    return per_rank[0]


def test_clean_load_one_verdict_with_every_rank_report(results):
    kind, ok, params, summary, reports, _ = _same_everywhere(results, "clean")
    assert kind == "ok" and ok and params == 3 * WORLD and summary == "every param loaded exactly once"
    assert reports == [_inputs(r, "clean")[2] for r in range(WORLD)]


@pytest.mark.parametrize("case, words", [
    ("twice", ["written twice: 'rank 2: a.weight (16 elements)'"]),
    ("never", ["never fully written: 'rank 1: a.weight (16 of 32 elements)'"]),
    ("undeclared", ["never fully written: 'rank 3: extra.weight (no rule delivers it)'"]),
    ("alias", ["never fully written: 'rank 0: tied.weight (tied alias of a.weight is a separate tensor)'"]),
    ("replicas", ["replicas differ: 'norm.weight (rank groups [[0, 1, 2], [3]])'"]),
])
def test_a_problem_names_the_param_and_the_rank(results, case, words):
    kind, message = _same_everywhere(results, case)
    assert kind == "DistloadError" and message.startswith("reconciliation failed: "), message
    for w in words:
        assert w in message, message
    assert "--no-strict" in message


@pytest.mark.parametrize("case", ["report-keys", "report-large", "no-report"])
def test_report_records_that_do_not_fit_the_summary_still_arrive_whole(results, case):
    kind, ok, _, _, reports, _ = _same_everywhere(results, case)
    assert kind == "ok" and ok
    assert reports == [_inputs(r, case)[2] for r in range(WORLD)]


def test_not_strict_keeps_the_verdict(results):
    kind, ok, _, summary, _, _ = _same_everywhere(results, "missing-not-strict")
    assert kind == "ok" and not ok and "missing: 'b.weight'" in summary
    kind, ok, _, summary, _, differ = _same_everywhere(results, "replicas-not-strict")
    assert kind == "ok" and not ok and differ == ["norm.weight (rank groups [[0, 1, 2], [3]])"]


def test_a_rank_that_fails_its_record_is_named_on_every_other_rank(results):
    assert results[1]["error"] == ("RuntimeError", "injected fingerprint failure")
    others = {r["error"] for i, r in enumerate(results) if i != 1}
    assert others == {("RankFailure", "reconciliation failed on 1 rank(s): rank 1: RuntimeError: injected "
                                      "fingerprint failure")}


def test_summary_size_does_not_grow_with_the_model():
    """The success path's record is SUMMARY_BYTES whatever the number of params (the detailed record is not)."""
    many = {f"layers.{i}.norm.weight": ParamSpec(f"layers.{i}.norm.weight", "replicate", "F32", (8,), (8,))
            for i in range(5000)}
    params = {n: torch.ones(8) for n in many}
    written = {n: [(0, 8, 0, 1)] for n in many}
    record = local_record(many, params, written, lambda ts: [torch.tensor([1, 2]) for _ in ts])
    report = {"rank": 4095, "bytes_read": 1 << 40, "device": "cuda:7", "transfer_path": "broadcast"}
    assert len(summary_of(record, report)) == SUMMARY_BYTES == len(summary_of({"error": "x"}, None))


def test_coverage_counts_overlaps_exactly():
    assert coverage([(0, 4, 0, 8)], 4, 8) == (32, 0)
    assert coverage([(0, 4, 0, 8), (2, 4, 0, 8)], 4, 8) == (32, 16)
    assert coverage([(0, 2, 0, 8), (2, 4, 0, 4)], 4, 8) == (24, 0)
