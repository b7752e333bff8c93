"""One rank of a refit fault job, started by torchrun (tests/jobs/test_refit_faults.py): a serving job that lives
through several refit rounds, or a trainer job that joins one round.

    torchrun ... refit_fault_job.py serving --model DIR --port P --plan "-|shape,-|+|+,-" --sync DIR
    torchrun ... refit_fault_job.py trainer --model DIR --port P --round R --steps "shape,-" --sync DIR

A plan is one '|'-separated entry per round (round R joins at tcp://127.0.0.1:P+R with a fresh trainer job), each
a ','-separated list of that round's steps: '+' / '-' the trainer sends the checkpoint's weights / their
negation (exact: the serving side knows what it must hold), 'shape' a wrong shape for one tensor. The
trainer's Shard(0) pieces are distload.refit.Piece. A fault (distload/faults.py) is armed with `--arm SPEC
--arm-at K:S`, just before round K's step S, so it counts passes from there. Before each join every rank of
both jobs waits for the others' files in --sync (torchrun starts take seconds here; the refit timeout stays short).

Every outcome is a line the test parses: `refit-job ROLE R round K step S: ok|refused|failed ...`; every
failure also `distload: error on rank R: MESSAGE`, once.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
import zlib
from pathlib import Path

import torch

READY_LIMIT_S = 240.0


def crc(params: dict) -> int:
    value = 0
    for name in sorted(params):
        t = params[name].detach().contiguous()
        value = zlib.crc32(memoryview(t.view(-1).view(torch.uint8).numpy()), zlib.crc32(name.encode(), value))
    return value


def wait_for_peers(sync: Path, round_: int, role: str, rank: int, trainers: int, servings: int) -> None:
    (sync / f"r{round_}-{role}-{rank}").touch()
    want = [sync / f"r{round_}-trainer-{t}" for t in range(trainers)] + \
           [sync / f"r{round_}-serving-{s}" for s in range(servings)]
    start = time.monotonic()
    while not all(p.exists() for p in want):
        if time.monotonic() - start > READY_LIMIT_S:
            raise SystemExit(f"refit-job {role} {rank} round {round_}: peers not ready in {READY_LIMIT_S}s")
        time.sleep(0.05)


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def error_line(rank: int, exc: Exception) -> None:
    sys.stderr.write(f"distload: error on rank {rank}: {exc}\n")
    sys.stderr.flush()


def trainer_pieces(model: Path, rank: int, world: int, sign: int, wrong_shape: bool) -> dict:
    from safetensors import safe_open

    from distload.refit import Piece

    out = {}
    for file in sorted(model.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for name in f.keys():
                full = f.get_tensor(name) * sign
                per = -(-full.shape[0] // world)
                a, b = min(rank * per, full.shape[0]), min((rank + 1) * per, full.shape[0])
                out[name] = Piece(full[a:b].contiguous(), (a,) + (0,) * (full.dim() - 1), tuple(full.shape))
    if wrong_shape:  # one tensor a row short, as a trainer with another config would send it
        name = "model.layers.0.self_attn.q_proj.weight"
        p = out[name]
        out[name] = Piece(p.local[:-1] if rank == world - 1 else p.local, p.offsets,
                          (p.global_shape[0] - 1,) + tuple(p.global_shape[1:]))
    return out


def arm_if_due(args, round_: int, step: int) -> None:
    from distload import faults

    if args.arm and args.arm_at == f"{round_}:{step}":
        faults.arm(args.arm)


def run_trainer(args, rank: int, world: int) -> int:
    import distload

    wait_for_peers(Path(args.sync), args.round, "trainer", rank, world, args.peers)
    address = f"tcp://127.0.0.1:{args.port + args.round}"
    link = distload.join_refit(address, role="trainer", config=args.model, timeout=args.timeout)
    for s, kind in enumerate(args.steps.split(","), 1):
        where = f"refit-job trainer {rank} round {args.round} step {s}"
        arm_if_due(args, args.round, s)
        tensors = trainer_pieces(Path(args.model), rank, world, -1 if kind.endswith("-") else 1, kind.startswith("shape"))
        start = time.monotonic()
        try:
            step = link.send(tensors)
        except distload.refit.RefitFailed as exc:
            error_line(rank, exc)
            say(f"{where}: failed after {time.monotonic() - start:.1f}s")
            return 1
        except distload.DistloadError as exc:
            error_line(rank, exc)
            say(f"{where}: refused after {time.monotonic() - start:.1f}s")
            continue
        say(f"{where}: ok version={step.version} bytes_sent={step.report['bytes_sent']}")
    link.close()
    return 0


def run_serving(args, rank: int, world: int) -> int:
    import distload

    result = distload.load(args.model, tp=world, progress=False)
    initial = {n: t.clone() for n, t in result.params.items()}
    rounds = [r.split(",") for r in args.plan.split("|")]
    for k, steps in enumerate(rounds):
        wait_for_peers(Path(args.sync), k, "serving", rank, args.peers, world)
        link = distload.join_refit(f"tcp://127.0.0.1:{args.port + k}", role="serving", config=args.model,
                                   target=result, timeout=args.timeout, staged=True)
        for s, kind in enumerate(steps, 1):
            arm_if_due(args, k, s)
            where = f"refit-job serving {rank} round {k} step {s}"
            before, start = crc(result.params), time.monotonic()
            try:
                step = link.receive()
            except distload.DistloadError as exc:
                error_line(rank, exc)
                failed = isinstance(exc, distload.refit.RefitFailed)
                say(f"{where}: {'failed' if failed else 'refused'} after {time.monotonic() - start:.1f}s "
                    f"unchanged={crc(result.params) == before} version={result.version}")
                if failed:
                    break
                continue
            sign = -1 if kind.endswith("-") else 1
            new = all(torch.equal(t, initial[n] * sign) for n, t in result.params.items())
            say(f"{where}: ok version={step.version} new_weights={new} "
                f"bytes_received={step.report['bytes_received']} own_shard_bytes={step.report['own_shard_bytes']}")
        link.close()
    return 0


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("role", choices=("trainer", "serving"))
    p.add_argument("--model", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--peers", type=int, required=True, help="the other job's world size")
    p.add_argument("--sync", required=True)
    p.add_argument("--timeout", type=float, default=10.0)
    p.add_argument("--round", type=int, default=0)
    p.add_argument("--steps", default="+")
    p.add_argument("--plan", default="+")
    p.add_argument("--arm", default=None)
    p.add_argument("--arm-at", default=None, help="K:S, round K's step S (from 1)")
    args = p.parse_args()
    import torch.distributed as dist
    import torch.distributed.nn.functional  # noqa: F401  (before the group: see distload.topology)

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    code = (run_trainer if args.role == "trainer" else run_serving)(args, rank, world)
    sys.stdout.flush()
    os._exit(code)  # a failed link's group may hold sockets to a dead peer: no teardown that could wait on it


if __name__ == "__main__":
    main()
