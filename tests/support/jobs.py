"""Whole jobs as a user starts them: `torchrun -m distload ...` and `distload verify` under torchrun, each
killed with its workers on a hang."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest


def torchrun(nproc: int, *args: str, env: dict | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           "-m", "distload", *args]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env)


ROOT = Path(__file__).resolve().parents[2]


def torchrun_verify(nproc: int, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           "-m", "distload", "verify", *args, "--no-progress"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    # Own session: on a hang, kill the workers too, not only torchrun (they would outlive the test).
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"torchrun verify {' '.join(args)} hung for 180 s:\n{out}\n{err}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def torchrun_on_a_terminal(nproc: int, *args: str, env: dict | None = None, timeout: float = 300) -> tuple[int, str]:
    """(exit status, everything written) of `torchrun -m distload ARGS` with stdout and stderr on a
    pseudo-terminal, as in a user's shell."""
    import pty
    import select

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           "-m", "distload", *args]
    controller, terminal = pty.openpty()
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=terminal, stderr=terminal,
                            env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}, start_new_session=True)
    os.close(terminal)
    chunks = []
    try:
        while True:
            ready, _, _ = select.select([controller], [], [], timeout)
            if not ready:
                os.killpg(proc.pid, signal.SIGKILL)
                pytest.fail(f"torchrun {' '.join(args)} wrote nothing for {timeout} s:\n{b''.join(chunks).decode()}")
            try:
                data = os.read(controller, 65536)
            except OSError:  # EIO: every writer closed the terminal
                break
            if not data:
                break
            chunks.append(data)
    finally:
        os.close(controller)
    return proc.wait(timeout=60), b"".join(chunks).decode(errors="replace")


def torchrun_job(nproc: int, args: list[str], env: dict, cwd=None, timeout: float = 150) -> subprocess.CompletedProcess:
    """`torchrun -m distload ARGS` on one node with exactly `env` (no inherited AWS_* or DISTLOAD_*), stdout and
    stderr together; on a hang its whole session (the workers too) is killed and rc is None."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           "-m", "distload", *args]
    base = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "DISTLOAD_"))}
    full_env = {**base, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONUNBUFFERED": "1", **env}
    proc = subprocess.Popen(cmd, cwd=cwd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        rc = None
    return subprocess.CompletedProcess(cmd, rc, out, "")
