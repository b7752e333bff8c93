"""Refit jobs as a user starts them: each its own `torchrun` of tests/support/refit_fault_job.py, all started at
once (they meet round by round through files), each ended with its whole session when the run is over."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

JOB = Path(__file__).resolve().parent / "refit_fault_job.py"
ERROR_LINE = re.compile(r"^distload: error on rank (\d+): (.*)$", re.M)
OUTCOME = re.compile(r"^refit-job (\w+) (\d+) round (\d+) step (\d+): (\w+) (.*)$", re.M)


@dataclass
class Job:
    name: str
    proc: subprocess.Popen
    log: Path
    rc: int | None = None
    output: str = ""

    def errors(self) -> dict[int, list[str]]:
        """Each rank's `distload: error on rank R: ...` lines."""
        out: dict[int, list[str]] = {}
        for rank, message in ERROR_LINE.findall(self.output):
            out.setdefault(int(rank), []).append(message)
        return out

    def outcomes(self) -> dict[tuple[int, int, int], tuple[str, str]]:
        """(rank, round, step) -> (ok | refused | failed, the rest of the line)."""
        return {(int(r), int(k), int(s)): (what, rest) for _, r, k, s, what, rest in OUTCOME.findall(self.output)}


def free_ports(n: int) -> int:
    """A base port with the n ports from it free on 127.0.0.1 now."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n < 65536 and all(_free(base + i) for i in range(1, n)):
            return base
    raise RuntimeError(f"no {n} consecutive free ports")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def start(name: str, nproc: int, args: list[str], work: Path, fault: str | None = None) -> Job:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           str(JOB), *args]
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISTLOAD_")}
    env.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1")
    if fault:
        env["DISTLOAD_FAULT"] = fault
    log = work / f"{name}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    return Job(name, proc, log)


def finish(jobs: list[Job], first: Job, limit_s: float, grace_s: float) -> None:
    """Wait for `first` up to limit_s, for the others grace_s more; then SIGKILL whatever is left of every job's
    session (a stopped rank, a worker its agent left behind). rc None: the job was still running."""
    deadline = time.monotonic() + limit_s
    for job in [first] + [j for j in jobs if j is not first]:
        try:
            job.rc = job.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            job.rc = None
        if job is first:
            deadline = time.monotonic() + grace_s
    for job in jobs:
        for pid in [*children(job.proc.pid), job.proc.pid]:  # torchrun starts each worker in a session of its own
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        job.proc.wait()
        job.output = job.log.read_text()


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (a torchrun agent's workers), from /proc."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out
