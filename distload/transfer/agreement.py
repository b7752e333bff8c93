"""Agreement steps (every phase ends in one) and the diagnosis of a lost peer.

If any rank failed a phase, every rank raises, naming it: nobody is left waiting in a later collective
for a peer that already raised. When the process group itself broke, the job's store still tells who
failed and why.
"""

from __future__ import annotations

import itertools
import pickle
import time

import torch.distributed as dist

from .. import faults
from ..errors import CheckpointError, RankFailure
from . import postmortem
from .collectives import active, count_over_ranks, max_over_ranks


def _failed_ranks(mine: str | None, digest: int | None = None) -> tuple[int, bool]:
    """How many ranks failed, and whether the ranks' digests differ (digest given): one small all-reduce. The
    failed ranks' reasons are in the job's store (_named_failures), never gathered: that would hand every rank
    every rank's message, world x world in all, on the failure path."""
    if not active():
        return (0 if mine is None else 1), False
    if digest is None:
        return count_over_ranks(0 if mine is None else 1), False
    failed, high, low = max_over_ranks([0 if mine is None else 1, digest, -digest])
    return failed, high != -low


def agree(phase: str, error: BaseException | None, digest: int | None = None) -> bool:
    """The agreement step that ends every phase: if any rank failed, every rank raises, naming it.

    Each rank contributes (ok, message); nobody is left waiting in a later collective for a peer that
    already raised. digest (a non-negative int, on every rank or none): returns whether the ranks' digests
    differ, found in the same collective (agree_on_planning).
    """
    step = next(_agreement_steps)
    if error is None:
        try:
            faults.hit(phase)  # test hook (DISTLOAD_FAULT), a no-op otherwise
        except Exception as exc:
            error = exc
    mine = None if error is None else f"{type(error).__name__}: {error}"
    if isinstance(error, LostPeer):
        raise _postmortem(phase, step, error) from error  # the group is broken: no collective can agree now
    if mine is not None:
        _tell_store(step, mine)  # so that peers learn why even if the collective below breaks
        digest = None if digest is None else 0
    try:
        failed, differ = _failed_ranks(mine, digest)
    except Exception as exc:  # a peer died or hung past the timeout during this very step
        raise _postmortem(phase, step, LostPeer(f"agreeing on {phase}", exc)) from exc
    if not failed:
        return differ
    if error is not None:
        # This rank failed itself: its own exception (type, traceback) is the most useful thing to raise.
        raise error
    raise _named_failures(phase, step, failed)


def _named_failures(phase: str, step: int, failed: int) -> RankFailure:
    """What a rank that was fine raises: the reasons of the first few failed ranks (postmortem.DETAILS), which they
    posted to the job's store before the all-reduce that counted them, and how many failed. O(1) store reads per
    rank whatever the world; every rank reads the same slots, so every rank says the same."""
    try:
        named = postmortem.causes(dist.distributed_c10d._get_default_store(), step)
    except Exception:  # the store is gone: the count is all there is (each failed rank prints its own reason)
        named = {}
    return rank_failure(phase, named, failed)


def run_phase(name: str, fn, *, digest=None, clock=None):
    """Run one phase on this rank, then its agreement step; returns fn()'s result on every rank that got
    one. Whatever fn raised, this rank still reaches the agreement (so no peer waits for it) and then
    raises it; a rank that was fine raises RankFailure naming the ranks that failed.

    digest (the planning phase): a function of the result giving a non-negative int that must be equal
    on every rank; ranks holding different results are refused together (agree_on_planning).
    clock (report.PhaseClock): told how long the agreement step took, mostly waiting for the slowest rank."""
    result, error = None, None
    try:
        result = fn()
    except BaseException as exc:  # every rank must reach the agreement step, whatever happened
        error = exc
    start = time.perf_counter()
    if digest is None:
        agree(name, error)
    else:
        agree_on_planning(error, result, digest, phase=name)
    if clock is not None:
        clock.waiting(time.perf_counter() - start)
    return result


def rank_failure(phase: str, failures: dict[int, str], count: int | None = None) -> RankFailure:
    """What every other rank raises when some failed `phase`: each message once, with the ranks that gave it.
    count: how many failed, when `failures` names only some of them."""
    count = len(failures) if count is None else count
    by_message: dict[str, list[int]] = {}
    for r, m in sorted(failures.items()):
        by_message.setdefault(m, []).append(r)
    parts = [f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: {m}" for m, rs in by_message.items()]
    if count > len(failures):
        parts.append(f"{count - len(failures)} {'more ' if failures else ''}rank(s) not named here (each prints its "
                     "own reason)")
    return RankFailure(f"{phase} failed on {count} rank(s): {'; '.join(parts)}", failures)


# When a peer is gone, the job's store names who and why (postmortem.py: bounded at any world).

_agreement_steps = itertools.count()  # the n-th agreement of this process; equal on all ranks while in step


class LostPeer(RuntimeError):
    """A collective of this rank failed (a peer was killed, crashed, or stayed silent past the timeout)."""

    def __init__(self, doing: str, cause: BaseException):
        self.doing = doing
        super().__init__(f"lost a peer while {doing}: {postmortem.first_line(cause)}")


def _tell_store(step: int, message: str) -> None:
    try:
        postmortem.tell(dist.distributed_c10d._get_default_store(), step, dist.get_rank(), message)
    except Exception:  # the store is gone too; the postmortem will say so
        pass


def _postmortem(phase: str, step: int, error: LostPeer) -> RankFailure:
    """Name who failed and why from the store, after this rank's process group broke."""
    me, world = dist.get_rank(), dist.get_world_size()
    causes, silent, count, store_error = {}, [], 0, None
    try:
        causes, silent, count = postmortem.gather(dist.distributed_c10d._get_default_store(), step, me, world,
                                                  str(error))
    except Exception as exc:
        store_error = exc
    message, failures = postmortem.describe(phase, me, error, causes, silent, count, store_error)
    return RankFailure(message, failures)


def report_together(seconds: float = 3.0) -> None:
    """Before a failed rank exits: wait (briefly) until every rank has reported its error.

    Under torchrun the first rank to exit gets the others SIGTERMed within 0.1 s, maybe before they
    printed why; ranks that fail together leave together instead. A vanished peer costs `seconds`.
    """
    if not active():
        return
    try:
        store = dist.distributed_c10d._get_default_store()
        store.add("distload/reported", 1)
        deadline = time.monotonic() + seconds
        while store.add("distload/reported", 0) < dist.get_world_size() and time.monotonic() < deadline:
            time.sleep(0.02)
    except Exception:  # the store went with its host: nobody left to wait for
        pass


def plan_digest(plan) -> int:
    """60 bits of the digest of the plan's inputs (plan/digest.py): equal on every rank that planned the same
    load, O(1) here whatever the size of the plan."""
    return int(plan.digest[:15], 16)


def agree_on_planning(error: BaseException | None, plan, digest=plan_digest, phase: str = "planning") -> None:
    """The planning phase's agreement step, which also checks that every rank holds the same plan: no
    control message ever travels, so ranks that planned differently (different distload versions or rules
    files on different nodes) would wait forever for bytes nobody sends. One all-reduce carries both (a
    failed rank, and the largest and smallest plan digest). Each rank names its own digest (its line says which
    plan it holds; gathering every rank's would cost each rank the world)."""
    # Every rank takes part in the same collective: a rank that failed contributes digest 0 (its failure wins).
    digest = digest(plan) if error is None and plan is not None else 0
    if agree(phase, error, digest=digest):
        raise RankFailure(f"ranks computed different load plans (this rank {dist.get_rank()}: plan {digest:015x}): "
                          "check that every node runs the same distload version, rules file (--config) and options")


_verdicts = itertools.count()   # the n-th verdict_everywhere of this process; equal on all ranks while in step


def verdict_everywhere(phase: str, scan, verdict) -> None:
    """Each rank runs `scan` (a phase) for its findings (a list, empty: nothing found); verdict(findings by rank,
    how many ranks found any) makes one message (None: fine), raised identically on every rank as a CheckpointError.
    One all-reduce counts the ranks that found something; the first few of them (postmortem.DETAILS) left their
    findings in the job's store before it, so a rank reads O(1) of them at any world."""
    found = run_phase(phase, scan)
    if not active():
        few, count = {0: found}, 1 if found else 0
    else:
        store, prefix = dist.distributed_c10d._get_default_store(), f"distload/verdict-{next(_verdicts)}"
        if found:
            postmortem.post(store, prefix, dist.get_rank(), pickle.dumps(found))
        count = count_over_ranks(1 if found else 0)
        few = {r: pickle.loads(b) for r, b in postmortem.posted(store, prefix)[0].items()} if count else {}
    message = verdict(few, count) if count else None
    if message is not None:
        raise CheckpointError(message)
