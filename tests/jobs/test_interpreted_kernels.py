"""Every Triton kernel against its torch twin under the Triton interpreter, on CPU: the `interpreted` tests of
tests/pure/test_kernels.py and test_kernels_4bit.py, run in one pytest process of their own, because triton reads
TRITON_INTERPRET when it is first imported (and the pure run has imported it already)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from distload import kernels

ROOT = Path(__file__).resolve().parents[2]
MODULES = ("tests/pure/test_kernels.py", "tests/pure/test_kernels_4bit.py")


@pytest.mark.skipif(not kernels.HAVE_TRITON, reason="triton is not installed")
def test_triton_kernels_match_their_torch_twins_under_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", DISTLOAD_FORCE_TRITON="1")
    cmd = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", *MODULES, "-k", "interpreted"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout, proc.stdout[-3000:]
    for module in MODULES:   # each module's kernels ran
        assert any(line.startswith(module) and "PASSED" in line for line in proc.stdout.splitlines()), module
