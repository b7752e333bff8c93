"""join_refit and the Link: one refit step, collective over every rank of both jobs.

A step: (1) metadata: one all-reduce of [the trainers' holdings digests summed, versions, refusals] over the
joined group; (2) only when that sum is not the one the plan was made for (the first step, or the trainer's
names / shapes / dtypes / shards changed): the trainers put their holdings in the store, every serving rank
plans and puts each trainer its routes; (3) transfer: the routes' messages, raw uint8; (4) commit: one
all-reduce of every rank's success, then (staged) the swap and the new version. A refusal found on metadata
(1, 2) raises PlanError on every rank with the link usable; a failure in (3, 4) raises RefitFailed on every
live rank (a dead peer: within the timeout) and closes the link.
"""

from __future__ import annotations

import os
import re
import resource
import time

from ..errors import DistloadError, PlanError
from ..options import LoadOptions
from ..topology import torchrun_identity
from .group import Group
from .one_source import Refit, RefitFailed, destination
from .serving import ServingSide, commit
from .trainer import TrainerSide

NOTIFY_S = 2.0   # how long a failing rank waits to tell its peers (the ones still in the step's collective)


def join(address: str, role: str, *, config=None, target=None, rank: int | None = None, world: int | None = None,
         timeout: float = 60.0, backend: str | None = None, tp: int | None = None, ep: int = 1, pp: int = 1,
         pp_layers=None, quantize: str | None = None, dequantize: bool = False, staged: bool = True,
         staging_mib: int | None = None, rules: str | None = None, partial: bool = False) -> "Link":
    if role not in ("trainer", "serving"):
        raise DistloadError(f"join_refit: role={role!r}; pass role='trainer' or role='serving'")
    if backend not in (None, "gloo"):
        raise DistloadError(f"join_refit: backend={backend!r} is not supported yet; the transfer group is gloo "
                            "(CUDA tensors are copied through host buffers)")
    rank, world = _job_rank(rank, world)
    side = None
    if role == "serving":
        if target is None:
            raise DistloadError("join_refit(role='serving') needs target= (a LoadResult, a module or a dict of params)")
        loaded = getattr(target, "options", None)   # a LoadResult: refit into the quantization it was loaded with
        if loaded is not None and quantize is None and not dequantize:
            quantize, dequantize = loaded.quantize, loaded.dequantize
        # A module's or dict's layout is this job's rank / world as given: an engine's workers have no torchrun env.
        with torchrun_identity(rank, world):
            params, current, layout, hf_config, family, version = destination(
                target, config, LoadOptions(tp=tp, ep=ep, pp=pp, pp_layers=pp_layers), rules)
        side = ServingSide(params, current, layout, hf_config, family, rank, quantize=quantize,
                           dequantize=dequantize, staged=staged, staging_mib=staging_mib, partial=partial)
    try:
        group = Group(address, role, rank, world, timeout)
    except Exception as exc:
        raise RefitFailed(f"refit (join) failed on {role} rank {rank}: nobody answered at {address} within "
                          f"{timeout:g} s, or the group broke ({exc}); start both jobs with the same address") from exc
    return Link(group, side if side is not None else TrainerSide(rank), target, version if side else 0)


def _job_rank(rank, world) -> tuple[int, int]:
    import torch.distributed as dist

    if rank is None:
        rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))
    if world is None:
        world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))
    return rank, world


class Link:
    def __init__(self, group: Group, side, target, version: int):
        self.group, self.side, self.target, self.version = group, side, target, version
        self.expected: int | None = None   # the digest sum the current plan was made for
        self.generation = 0
        self.steps = 0

    @property
    def trainer(self) -> bool:
        return isinstance(self.side, TrainerSide)

    def send(self, tensors, version: int | None = None) -> Refit:
        if not self.trainer:
            raise DistloadError("send() is the trainer's; a serving rank calls receive()")
        return self._step(tensors, version)

    def receive(self) -> Refit:
        if self.trainer:
            raise DistloadError("receive() is the serving rank's; a trainer rank calls send(tensors)")
        return self._step(None, None)

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
        self.group = None
        if self.trainer:
            self.side.release()

    def _step(self, tensors, version):
        if self.group is None:
            raise DistloadError("this refit link is closed (after a failure, or close()); join_refit again")
        g, start, report = self.group, time.perf_counter(), {}
        self.steps += 1
        tensors, held, digest, why = self._describe(tensors)
        lead = g.rank == 0   # the version is trainer rank 0's: summed over the group, every rank's would add up
        mine = [digest, int(version is not None and lead), (version or 0) if lead else 0, 0, 0, int(why is not None)]
        if not self.trainer:
            mine[3:5] = [self.version, self.version * self.version]
        total, given, wanted, versions, squares, refusals = self._collective("metadata", mine)
        self._refuse_if(refusals, why, "metadata")
        if g.servings * squares != versions * versions:
            raise PlanError("refit refused: the serving ranks are at different versions (one missed an update)")
        current = versions // g.servings
        new = wanted if given else current + 1
        if new <= current:
            raise PlanError(f"refit version {new} is not newer than the serving job's current version {current}")
        plan_start = time.perf_counter()
        if total != self.expected:
            self._plan(held, total)
        report["plan_seconds"] = round(time.perf_counter() - plan_start, 6)
        staged = self._transfer(tensors, report)
        ok, = self._collective("commit", [0])
        if ok:
            self._fail("commit", f"{ok} rank(s) failed the transfer")
        if not self.trainer:
            commit(staged)
            self.version = new
            if hasattr(self.target, "version"):
                self.target.version = new
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        report.update(version=new, seconds=round(time.perf_counter() - start, 6), peak_rss_bytes=rss)
        params = 0 if self.trainer else len(self.side.plan.specs[self.side.rank])
        return Refit(version=new, params=params, report=report)

    def _describe(self, tensors):
        if not self.trainer:
            return None, None, 0, None
        try:
            return (*self.side.describe(tensors), None)
        except DistloadError as exc:
            self.group.compare_set_why(self.steps, f"trainer rank {self.side.rank}: {exc}")
            return None, None, 0, str(exc)

    def _collective(self, phase: str, values: list[int]) -> list[int]:
        try:
            self.group.arrive(self.steps, phase)
            return self.group.allreduce(values)
        except Exception as exc:
            absent = self.group.absent(self.steps, phase, NOTIFY_S) if self.group.store is not None else []
            if absent:
                exc = f"no word from {', '.join(map(self.group.who, absent))} ({exc})"
            self._fail(phase, exc)

    def _refuse_if(self, count: int, mine: str | None, phase: str) -> None:
        if not count:
            return
        if mine is not None:
            raise PlanError(mine)
        try:
            why = self.group.why(self.steps)
        except Exception as exc:
            self._fail(phase, exc)
        raise PlanError(f"refit refused before any byte moved, by {why}")

    def _plan(self, held, total: int) -> None:
        g, step, why = self.group, self.steps, None
        try:
            if self.trainer:
                g.put(f"hold/{step}/{self.side.rank}", held)
            else:
                holdings = [g.get(f"hold/{step}/{t}") for t in range(g.trainers)]
                try:
                    routes = self.side.plan_for(holdings, total)
                except DistloadError as exc:
                    why = str(exc)
                    g.compare_set_why(step, f"serving rank {self.side.rank}: {exc}")
                else:
                    for t in range(g.trainers):
                        g.put(f"routes/{step}/{self.side.rank}/{t}", routes.messages.get(t, []))
        except Exception as exc:
            self._fail("plan", exc)
        refusals, = self._collective("plan", [int(why is not None)])
        self._refuse_if(refusals, why, "plan")
        if self.trainer:
            try:
                got = {s: g.get(f"routes/{step}/{s}/{self.side.rank}") for s in range(g.servings)}
            except Exception as exc:
                self._fail("plan", exc)
            self.side.messages = {s: msgs for s, msgs in got.items() if msgs}
        self.expected, self.generation = total, self.generation + 1

    def _transfer(self, tensors, report: dict):
        try:
            if self.trainer:
                return self.side.send(self.group, tensors, self.group.servings, report)
            return self.side.receive(self.group, self.group.trainers, self.group.servings, report)
        except Exception as exc:
            try:   # tell the live peers now rather than at their timeout; briefly: a stalled peer never joins
                self.group.note_failure(f"{self._who()}: {exc}")
                self.group.arrive(self.steps, "commit")   # the step's last collective: the peers wait there
                self.group.allreduce([1], timeout=min(NOTIFY_S, self.group.timeout))
            except Exception:
                pass
            self._fail("transfer", exc)

    def _who(self) -> str:
        return self.group.who(self.group.rank)

    def _fail(self, phase: str, cause) -> None:
        g = self.group
        message = f"refit (phase {phase}) failed on {self._who()}: {_plain(cause)}"
        first = _plain(g.first_failure() or "")
        g.note_failure(message)
        g.close(failed=True)
        self.group = None
        state = ("the serving params are unchanged" if self.trainer or self.side.staged else
                 "the params are partly updated (in place): refit again or reload before serving")
        extra = f"; the first failure: {first}" if first and first not in message else ""
        raise RefitFailed(f"{message}{extra}; versions unchanged, {state}; the link is closed: join_refit again")


def _plain(cause) -> str:
    """gloo's error text without its source location and its boilerplate advice (the line names the rank)."""
    text = re.sub(r"\[/[^\]]*\.(?:cc|cpp|hpp):\d+\] ", "", str(cause))
    return re.sub(r"\. This is typically caused by .*?GLHF!(?: [^\s;]+)?", "", text)
