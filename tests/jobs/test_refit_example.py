"""README "Refit from a trainer job": the two-terminal example (`python -m distload.refit.example`) as the README's
commands start it, a serving torchrun and a trainer torchrun of 2 ranks each; and its refusals of bad input."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from distload.demo import make_demo_checkpoint
from readme_blocks import command
from spawn import free_port

README_MODEL, README_ADDRESS = "/tmp/distload-demo", "tcp://127.0.0.1:29600"
LINE = re.compile(r"^(trainer|serving) rank (\d+): (?:version (\d+)|loaded .*version 0)\b.*; checksum (-?\d+)$", re.M)
RECEIVED = re.compile(r"received ([\d,]+) B, its shard ([\d,]+) B")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONUNBUFFERED": "1"}


def readme_job(block: str, model: Path, address: str, nproc: int) -> subprocess.Popen:
    """The README's command, its checkpoint, address and ranks replaced, torchrun run by this interpreter."""
    text = command(block)
    assert text.startswith("torchrun ") and README_MODEL in text and README_ADDRESS in text, text
    text = text.replace(README_MODEL, str(model)).replace(README_ADDRESS, address)
    argv = shlex.split(text.replace("--nproc-per-node 2", f"--nproc-per-node {nproc}"))
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *argv[1:]], env=ENV, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)


@pytest.mark.parametrize("trainers,servings", [(2, 2), (1, 4)])   # tp 4 > 2 kv heads: k / v land on 2 ranks each
def test_the_readme_example_refits_the_serving_job_and_both_checksums_match(tmp_path, trainers, servings):
    model = make_demo_checkpoint(tmp_path / "demo")
    address = f"tcp://127.0.0.1:{free_port()}"
    jobs = [readme_job("refit-example-serving", model, address, servings),
            readme_job("refit-example-trainer", model, address, trainers)]
    try:
        serving, trainer = (j.communicate(timeout=240)[0] for j in jobs)
    except subprocess.TimeoutExpired:
        for j in jobs:
            os.killpg(j.pid, signal.SIGKILL)
        pytest.fail("the example's jobs ran past 240 s")
    assert [j.returncode for j in jobs] == [0, 0], serving[-3000:] + trainer[-3000:]
    sums: dict[tuple[str, int], set] = {}
    for role, rank, version, checksum in LINE.findall(serving + trainer):
        sums.setdefault((role, int(version or 0)), set()).add((int(rank), int(checksum)))
    steps = int(re.search(r"--steps (\d+)", command("refit-example-trainer")).group(1))
    for version in range(steps + 1):
        got = {c for _, c in sums[("serving", version)]}
        assert len(sums[("serving", version)]) == servings and len(got) == 1, (version, sums)   # the job's one sum
        if version:
            assert len(sums[("trainer", version)]) == trainers, (version, sums)
            assert {c for _, c in sums[("trainer", version)]} == got, (version, sums)
    per_version = [next(iter(sums[("serving", v)]))[1] for v in range(steps + 1)]
    assert len(set(per_version)) == steps + 1, per_version   # the serving params changed at every step
    received = [(int(a.replace(",", "")), int(b.replace(",", ""))) for a, b in RECEIVED.findall(serving)]
    assert len(received) == servings * steps and all(0 < got <= own for got, own in received), received


@pytest.mark.parametrize("args,says", [
    (["--role", "train", "--address", README_ADDRESS], "argument --role: invalid choice: 'train'"),
    (["--role", "trainer", "--address", "127.0.0.1:29600"], "--address '127.0.0.1:29600' is not tcp://HOST:PORT"),
    (["--role", "serving", "--address", README_ADDRESS], "--model /nonexistent/ckpt: no config.json and *.safetensors"),
])
def test_bad_input_is_one_line_naming_the_option(args, says):
    proc = subprocess.run([sys.executable, "-m", "distload.refit.example", *args, "--model", "/nonexistent/ckpt"],
                          capture_output=True, text=True, env=ENV, timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("distload: error on rank 0: ") and says in lines[0], lines
