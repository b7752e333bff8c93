"""The transfer group of a trainer job and a serving job: joined once over tcp://HOST:PORT.

Serving rank 0 hosts a TCPStore there; every rank of both jobs connects, the two jobs' sizes are exchanged
through it, and a gloo ProcessGroup is made directly over a PrefixStore of it: joined ranks are trainer
0..T-1, then serving T..T+S-1. It is not registered as the default group, so each job's own groups stay as
they are. The store also carries the small control messages (holdings, routes, why a rank refused).
Every wait is bounded by `timeout`: a dead or stalled peer ends the wait, never hangs it.
"""

from __future__ import annotations

import pickle
import time
from datetime import timedelta
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from ..errors import DistloadError


def parse_address(address: str) -> tuple[str, int]:
    url = urlparse(str(address))
    if url.scheme != "tcp" or not url.hostname or not url.port:
        raise DistloadError(f"join_refit: address {address!r} is not tcp://HOST:PORT (e.g. tcp://127.0.0.1:29600)")
    return url.hostname, url.port


_LINGERING: dict[tuple[str, int], object] = {}   # (host, port) -> the store a failed link's host keeps up


class Group:
    """This rank in the joined group: its store, its gloo group, both jobs' sizes."""

    def __init__(self, address: str, role: str, rank: int, world: int, timeout: float):
        host, port = parse_address(address)
        self.role, self.job_rank, self.timeout = role, rank, timeout
        wait = timedelta(seconds=timeout)
        hosting = role == "serving" and rank == 0
        self.hosted = (host, port) if hosting else None
        if hosting:
            _LINGERING.pop(self.hosted, None)   # a failed link's store on this address: shut it, free the port
        self.store = dist.TCPStore(host, port, is_master=hosting, wait_for_workers=False, timeout=wait,
                                   use_libuv=False)
        if rank == 0:
            self.store.set(f"size/{role}", str(world))
        self.trainers = int(self.store.get("size/trainer"))
        self.servings = int(self.store.get("size/serving"))
        self.rank = rank if role == "trainer" else self.trainers + rank
        self.world = self.trainers + self.servings
        self.pg = dist.ProcessGroupGloo(dist.PrefixStore("refit/pg", self.store), self.rank, self.world, wait)

    def serving_rank(self, s: int) -> int:
        return self.trainers + s

    def allreduce(self, values: list[int], timeout: float | None = None) -> list[int]:
        t = torch.tensor(values, dtype=torch.int64)
        opts = dist.AllreduceOptions()
        if timeout is not None:
            opts.timeout = timedelta(seconds=timeout)
        self.pg.allreduce([t], opts).wait()
        return t.tolist()

    def send(self, buf: torch.Tensor, to: int) -> None:
        self.pg.send([buf], to, 0).wait()

    def recv(self, buf: torch.Tensor, frm: int) -> None:
        self.pg.recv([buf], frm, 0).wait()

    def who(self, joined: int) -> str:
        if joined < self.trainers:
            return f"trainer rank {joined} (joined rank {joined})"
        return f"serving rank {joined - self.trainers} (joined rank {joined})"

    def arrive(self, step: int, phase: str) -> None:
        """This rank reached `phase` of `step`: after a failure there, the ranks that never did are named."""
        self.store.set(f"at/{step}/{phase}/{self.rank}", "1")

    def absent(self, step: int, phase: str, wait_s: float) -> list[int]:
        """The joined ranks that have not reached `phase` of `step` within wait_s more: the dead or stalled ones
        (a live peer that is merely slower gets the moment to arrive). Only after a failure: one check per rank."""
        deadline = time.monotonic() + wait_s
        try:
            self.store.set_timeout(timedelta(seconds=max(wait_s, 1.0)))
            while True:
                missing = [r for r in range(self.world) if not self.store.check([f"at/{step}/{phase}/{r}"])]
                if not missing or time.monotonic() >= deadline:
                    return missing
                time.sleep(0.05)
        except Exception:  # the store's host is gone: nobody can be named
            return []

    def put(self, key: str, obj) -> None:
        self.store.set(key, pickle.dumps(obj))

    def get(self, key: str):
        return pickle.loads(self.store.get(key))

    def compare_set_why(self, step: int, message: str) -> None:
        """The first refusal of step `step` (what every other rank's PlanError names)."""
        self.store.compare_set(f"why/{step}", "", message)

    def why(self, step: int) -> str:
        return self.store.get(f"why/{step}").decode()

    def note_failure(self, message: str) -> None:
        """Best effort: the first failure's cause, for the peers' messages (the store may be gone)."""
        try:
            self.store.compare_set("failed", "", message)
        except Exception:  # the store's host died: the peers time out on their own
            pass

    def first_failure(self) -> str | None:
        try:
            self.store.set_timeout(timedelta(seconds=1))
            return self.store.get("failed").decode() if self.store.check(["failed"]) else None
        except Exception:
            return None

    def close(self, failed: bool = False) -> None:
        """Drop the group. After a failure the hosting rank keeps its store serving until the next join on this
        address (or the process ends): the live peers still read the first failure and who is absent there."""
        if failed and self.hosted and self.store is not None:
            _LINGERING[self.hosted] = self.store
        self.pg = self.store = None
