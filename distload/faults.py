"""Test-only fault injection: make one rank fail at a named point, so tests can prove the whole job ends.

Off unless the environment sets `DISTLOAD_FAULT=ACTION@[rankR:]POINT[:N]` (tests/test_faults.py does):
fire on rank R (default: any rank) at the N-th time (default 1) this process passes POINT.

    ACTION  read-error  an OSError(EIO) where the OS would raise it (the reader's pread)
            raise       a RuntimeError, as a bug or an unexpected condition would
            kill        SIGKILL this process (the OOM killer, a lost node): no cleanup, no message
            hang        sleep forever (a stuck file system): peers must give up at the timeout
            stop        SIGSTOP this process (a stalled rank: alive, its sockets open, silent)
    POINT   read        each pread of a checkpoint file (reader ranks)
            transfer    each bucket of the transfer loop, before the rank posts its part of it
            local-record  a rank's own reconciliation record, before the all-gather that shares it
            refit-send  each message a trainer rank sends in a refit step (distload/refit/trainer.py)
            refit-receive  each message a serving rank receives in a refit step (distload/refit/serving.py)
            <phase>     the agreement step that ends a phase: discover, planning, allocate, transfer,
                        reconcile, save-sharded (write), ... (see loader.py and sharded/save.py)

e.g. `read-error@rank0:read:3`, `raise@rank1:transfer:2`, `kill@rank1:save-sharded (write)`.
A long-lived process (a serving job through several refits) arms a fault for what comes next with `arm(spec)`.
"""

from __future__ import annotations

import errno
import functools
import os
import signal
import time

ACTIONS = ("read-error", "raise", "kill", "hang", "stop")
_passes: dict[str, int] = {}


@functools.lru_cache(maxsize=4)
def parse_spec(spec: str) -> tuple[str, int | None, str, int]:
    action, _, where = spec.partition("@")
    rank = None
    if where.startswith("rank") and ":" in where:
        head, _, where = where.partition(":")
        rank = int(head[4:])
    point, count = where, 1
    head, _, tail = where.rpartition(":")
    if head and tail.isdigit():
        point, count = head, int(tail)
    if action not in ACTIONS or not point:
        raise ValueError(f"DISTLOAD_FAULT={spec!r}: expected ACTION@[rankR:]POINT[:N], ACTION one of {ACTIONS}")
    return action, rank, point, count


def arm(spec: str) -> None:
    """Set DISTLOAD_FAULT=spec from here on, its pass counts starting now (N counts passes after this call)."""
    parse_spec(spec)
    os.environ["DISTLOAD_FAULT"] = spec
    _passes.clear()


def hit(point: str) -> None:
    """Pass `point`; fires the configured fault here if this is its rank and its N-th pass."""
    spec = os.environ.get("DISTLOAD_FAULT")
    if not spec:
        return
    action, rank, want, count = parse_spec(spec)
    me = int(os.environ.get("RANK", "0"))
    if want != point or (rank is not None and rank != me):
        return
    _passes[point] = _passes.get(point, 0) + 1
    if _passes[point] != count:
        return
    what = f"injected fault DISTLOAD_FAULT={spec} on rank {me}"
    if action == "read-error":
        raise OSError(errno.EIO, f"Input/output error ({what})")
    if action == "raise":
        raise RuntimeError(what)
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if action == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
        return  # continued (SIGCONT): go on as if nothing happened
    while True:  # hang
        time.sleep(60)
