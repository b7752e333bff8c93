"""When a peer is gone: the process group cannot tell who or why, the rendezvous store still can.

A killed rank (OOM killer, lost node) leaves its peers with "Connection closed by peer" from gloo (NCCL:
a timeout), and a hung one with a timeout, neither naming a rank. Every rank that fails posts its
reason to the job's store (torchrun's agent holds it; without torchrun, rank 0); a rank whose collective
broke then waits a moment for its peers' reasons and names the ranks that stayed silent.

Bounded whatever the world: the store is one server every rank talks to, so each rank costs it O(1)
operations per poll. Ranks count themselves in (`reported`); the first few causes go to numbered slots
(`causes/slot-1..DETAILS`); the first broken rank to arrive (`lost` == 1) is the collector: it alone waits for
the count, looks up which ranks stayed silent (once, O(world)) and posts their names; the other broken
ranks wait for that one key. Messages name at most DETAILS causes and SHOWN silent ranks, with totals.
"""

from __future__ import annotations

import re
import time

DETAILS = 4          # causes named in full (a job whose ranks fail alike says the same thing each time)
SHOWN = 16           # silent ranks named; the rest are counted
WAIT_S = 3.0         # how long the collector waits for its peers' reasons: they break at about the same time
_reported: set[tuple[int, int]] = set()   # (step, rank) this process has counted in


def first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    line = text[0] if text else type(error).__name__
    # gloo: "[.../gloo/transport/tcp/pair.cc:553] Connection closed by peer [addr]:port. This is typically ..."
    line = re.sub(r"^\[[^\]]*\]\s*", "", line).split(". This is typically")[0]
    return line[:300]


def _key(step: int, what: str) -> str:
    return f"distload/agreement-{step}/{what}"


def _count_in(store, step: int, rank: int, message: str) -> None:
    store.set(_key(step, f"rank-{rank}"), message[:4000])
    if (step, rank) not in _reported:
        _reported.add((step, rank))
        store.add(_key(step, "reported"), 1)


def tell(store, step: int, rank: int, message: str) -> None:
    """A rank that failed with a cause posts it (before the collective, which may break)."""
    _count_in(store, step, rank, message)
    post(store, _key(step, "causes"), rank, message[:4000].encode())


def causes(store, step: int) -> dict[int, str]:
    """The first DETAILS causes posted in this step, by rank."""
    return {r: m.decode(errors="replace") for r, m in posted(store, _key(step, "causes"))[0].items()}


def post(store, prefix: str, rank: int, payload: bytes) -> None:
    """Count this rank in under `prefix`; the first DETAILS ranks to arrive also leave their payload."""
    slot = store.add(prefix + "/count", 1)
    if slot <= DETAILS:
        store.set(f"{prefix}/slot-{slot}", str(rank).encode() + b"\n" + payload)


def posted(store, prefix: str) -> tuple[dict[int, bytes], int]:
    """(the payloads left under `prefix`, by rank; how many ranks were counted in): O(DETAILS) store reads at any
    world. Read only once every poster is known to have posted (after a collective they posted before)."""
    count = store.add(prefix + "/count", 0)
    few = {}
    for slot in range(1, min(DETAILS, count) + 1):
        rank, _, payload = store.get(f"{prefix}/slot-{slot}").partition(b"\n")
        few[int(rank)] = payload
    return few, count


def _counter(store, step: int, what: str) -> int:
    return store.add(_key(step, what), 0)


def _silent_ranks(store, step: int, me: int, world: int) -> list[int]:
    """The ranks that posted nothing in this step (the collector asks once per rank)."""
    return [r for r in range(world) if r != me and not store.check([_key(step, f"rank-{r}")])]


def _wait(deadline: float, done) -> None:
    while not done() and time.monotonic() < deadline:
        time.sleep(0.05)


def gather(store, step: int, me: int, world: int, lost: str) -> tuple[dict[int, str], list[int], int]:
    """(causes by rank, at most SHOWN silent ranks, how many are silent) as this broken rank can learn them."""
    _count_in(store, step, me, f"LostPeer: {lost}")
    collector = store.add(_key(step, "lost"), 1) == 1
    silent_key = _key(step, "silent")
    if collector:
        _wait(time.monotonic() + WAIT_S, lambda: _counter(store, step, "reported") >= world)
        silent = _silent_ranks(store, step, me, world)
        store.set(silent_key, ",".join(map(str, [len(silent)] + silent[:SHOWN])))
    else:  # the collector posts the names a moment after its wait
        _wait(time.monotonic() + WAIT_S + 2.0, lambda: store.check([silent_key]))
    if store.check([silent_key]):
        count, *silent = map(int, store.get(silent_key).decode().split(","))
    else:  # the collector is gone too: count only
        silent, count = [], max(0, world - _counter(store, step, "reported"))
    named = causes(store, step)
    if me in silent:  # this rank arrived after the collector looked
        silent, count = [r for r in silent if r != me], count - 1
    return named, [r for r in silent if r not in named], count


def describe(phase: str, me: int, error: BaseException, named: dict[int, str], silent: list[int], count: int,
             store_error: BaseException | None) -> tuple[str, dict[int, str]]:
    """(the message a broken rank raises, failures by rank) from what gather() learnt."""
    parts = [f"{phase} failed: rank {me} {error}"]
    parts += [f"rank {r} failed: {m}" for r, m in sorted(named.items())]
    if count:
        shown = ", ".join(map(str, silent)) + (f" ... ({count} in all)" if count > len(silent) else "")
        who = f"rank{'s' if count > 1 else ''} {shown}" if silent else f"{count} rank(s)"
        parts.append(f"no word from {who} within {WAIT_S:.0f} s (killed, crashed or hung: see "
                     f"{'their' if count > 1 else 'its'} log or the launcher's report; a rank still waiting on the "
                     "lost one cannot answer either)")
    if store_error is not None:
        parts.append(f"the job's store is unreachable too ({first_line(store_error)}): whoever held it is gone "
                     "(rank 0 without torchrun, else torchrun's agent)")
    failures = {**{r: "no word (vanished)" for r in silent}, **named, me: str(error)}
    return "; ".join(parts), failures
