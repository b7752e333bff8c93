"""Agreement steps (every phase ends in one) and the diagnosis of a lost peer.

If any rank failed a phase, every rank raises, naming it: nobody is left waiting in a later collective
for a peer that already raised. When the process group itself broke, the job's store still tells who
failed and why.
"""

from __future__ import annotations

import itertools
import time

import torch.distributed as dist

from .. import faults
from ..errors import CheckpointError, RankFailure
from . import postmortem
from .collectives import active, all_gather_objects, count_over_ranks, gather_int64, max_over_ranks


def _failure_records(mine: str | None, digest: int | None = None) -> tuple[list, bool]:
    """Every rank's failure message (None: fine), and whether the ranks' digests differ (digest given). One
    small all-reduce when all are fine, as they nearly always are; the messages themselves are gathered
    only when some rank failed."""
    if not active():
        return [mine], False
    if digest is None:
        failed, differ = count_over_ranks(0 if mine is None else 1), False
    else:
        failed, high, low = max_over_ranks([0 if mine is None else 1, digest, -digest])
        differ = high != -low
    if failed == 0:
        return [None] * dist.get_world_size(), differ
    return all_gather_objects(mine), False


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
        records, differ = _failure_records(mine, digest)
    except Exception as exc:  # a peer died or hung past the timeout during this very step
        raise _postmortem(phase, step, LostPeer(f"agreeing on {phase}", exc)) from exc
    failures = {r: m for r, m in enumerate(records) if m is not None}
    if not failures:
        return differ
    if error is not None:
        # This rank failed itself: its own exception (type, traceback) is the most useful thing to raise.
        raise error
    raise rank_failure(phase, failures)


def run_phase(name: str, fn, *, digest=None):
    """Run one phase on this rank, then its agreement step; returns fn()'s result on every rank that got
    one. Whatever fn raised, this rank still reaches the agreement (so no peer waits for it) and then
    raises it; a rank that was fine raises RankFailure naming the ranks that failed.

    digest (the planning phase): a function of the result giving a non-negative int that must be equal
    on every rank; ranks holding different results are refused together (agree_on_planning)."""
    result, error = None, None
    try:
        result = fn()
    except BaseException as exc:  # every rank must reach the agreement step, whatever happened
        error = exc
    if digest is None:
        agree(name, error)
    else:
        agree_on_planning(error, result, digest, phase=name)
    return result


def rank_failure(phase: str, failures: dict[int, str]) -> RankFailure:
    """What every other rank raises when some failed `phase`: each message once, with the ranks that gave it."""
    by_message: dict[str, list[int]] = {}
    for r, m in sorted(failures.items()):
        by_message.setdefault(m, []).append(r)
    text = "; ".join(f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: {m}" for m, rs in by_message.items())
    return RankFailure(f"{phase} failed on {len(failures)} rank(s): {text}", failures)


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
    failed rank, and the largest and smallest plan digest); the digests themselves are gathered only when
    they differ, to say which ranks hold which plan."""
    # Every rank takes part in the same collective: a rank that failed contributes digest 0 (its failure wins).
    digest = digest(plan) if error is None and plan is not None else 0
    differ = agree(phase, error, digest=digest)
    if not differ:
        return
    digests = [f"{d:015x}" for d in gather_int64(digest)]
    groups: dict[str, list[int]] = {}
    for r, d in enumerate(digests):
        groups.setdefault(d, []).append(r)
    raise RankFailure("ranks computed different load plans (" + "; ".join(f"ranks {rs}: plan {d}" for d, rs in
                      groups.items()) + "): check that every node runs the same distload version, rules file "
                      "(--config) and options")


def verdict_everywhere(phase: str, scan, verdict) -> None:
    """Each rank runs `scan` (a phase) for its findings (a list, empty: nothing found); what every rank found makes
    one verdict (a message, None: fine), raised identically on every rank as a CheckpointError. When no rank found
    anything, one all-reduce says so; the findings themselves travel only when there are some."""
    found = run_phase(phase, scan)
    if count_over_ranks(1 if found else 0) == 0:
        return
    message = verdict(all_gather_objects(found))
    if message is not None:
        raise CheckpointError(message)
