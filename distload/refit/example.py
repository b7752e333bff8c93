"""`python -m distload.refit.example`: a trainer job refits a serving job, each its own torchrun, in two terminals
(README "Refit from a trainer job"; CPU, gloo):

    torchrun --standalone --nproc-per-node 2 -m distload.refit.example --role serving --address tcp://H:P --model DIR
    torchrun --standalone --nproc-per-node 2 -m distload.refit.example --role trainer --address tcp://H:P --model DIR

The trainer ranks hold the checkpoint at DIR as FSDP2 does (Shard(0) rows, as `distload.refit.Piece`s) and send it
--steps times, step k perturbed by k * 1e-3 * sin(global element index): the same weights at any trainer world, new
ones each step. The serving ranks load DIR (tp = their world) and receive. Every rank prints a line per step; the
checksum (every checkpoint element's bits summed, each element once over its job) is the same on both sides when
the serving job holds exactly what the trainers sent.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.nn.functional  # noqa: F401  (before any group: topology.init_process_group says why)

from ..errors import DistloadError
from ..plan.shard import view2d
from .group import parse_address
from .holdings import Piece
from .link import join

INTEGER_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):   # one line per rank, as every bad input (argparse's usage block interleaves)
        raise DistloadError(f"{self.prog}: {message} (see `python -m distload.refit.example --help`)")


def parse(argv) -> argparse.Namespace:
    p = _Parser(prog="distload.refit.example", description=__doc__.split("\n")[0])
    p.add_argument("--role", required=True, choices=["trainer", "serving"])
    p.add_argument("--address", required=True, help="tcp://HOST:PORT; serving rank 0 hosts it")
    p.add_argument("--model", required=True, help="a Hugging Face checkpoint directory (e.g. `distload demo DIR`'s)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--timeout", type=float, default=60.0, help="seconds any wait on the other job may take")
    args = p.parse_args(argv)
    try:
        parse_address(args.address)
    except DistloadError:
        raise DistloadError(f"--address {args.address!r} is not tcp://HOST:PORT; pass the same one to both jobs, "
                            f"e.g. --address tcp://127.0.0.1:29600") from None
    model = Path(args.model)
    if not (model / "config.json").is_file() or not any(model.glob("*.safetensors")):
        raise DistloadError(f"--model {args.model}: no config.json and *.safetensors there; pass a Hugging Face "
                            f"checkpoint directory (make one: torchrun --nproc-per-node 2 -m distload demo DIR)")
    if args.steps < 1:
        raise DistloadError(f"--steps {args.steps}: pass 1 or more")
    return args


def say(line: str) -> None:
    sys.stdout.write(line + "\n")   # one write per line: the job's ranks share the terminal
    sys.stdout.flush()


def bits(t: torch.Tensor) -> int:
    """The sum of a tensor's elements' bit patterns as integers: exact, in any order of summing."""
    t = t.detach().contiguous()
    return int(t.view(INTEGER_OF_SIZE[t.element_size()]).to(torch.int64).sum())


def job_sum(value: int) -> int:
    total = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(total)
    return int(total)


def shard0(model: Path, rank: int, world: int) -> dict:
    """name -> (this rank's rows of the tensor, its first row, the global shape), read from the checkpoint."""
    from safetensors import safe_open

    out = {}
    for file in sorted(model.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for name in f.keys():
                sl = f.get_slice(name)
                shape = tuple(sl.get_shape())
                per = -(-shape[0] // world)
                a, b = min(shape[0], rank * per), min(shape[0], (rank + 1) * per)
                out[name] = (sl[a:b].contiguous(), a, shape)
    return out


def perturbed(local: torch.Tensor, row0: int, shape: tuple, step: int) -> torch.Tensor:
    start = row0 * math.prod(shape[1:])
    index = torch.arange(start, start + local.numel(), dtype=torch.float64).reshape(local.shape)
    return (local.double() + step * 1e-3 * torch.sin(index)).to(local.dtype)


def run_trainer(args, rank: int, world: int) -> None:
    held = shard0(Path(args.model), rank, world)
    link = join(args.address, "trainer", config=args.model, timeout=args.timeout)
    for step in range(1, args.steps + 1):
        pieces = {n: Piece(perturbed(t, a, shape, step), (a,) + (0,) * (len(shape) - 1), shape)
                  for n, (t, a, shape) in held.items()}
        got = link.send(pieces)
        r, checksum = got.report, job_sum(sum(bits(p.local) for p in pieces.values()))
        say(f"trainer rank {rank}: version {got.version}, {r['seconds']:.3f} s (planning {r['plan_seconds']:.4f} s), "
            f"sent {r['bytes_sent']:,} B; checksum {checksum}")
    link.close()


def shard_checksum(result, rank: int) -> int:
    """The job's checksum of the checkpoint elements its params hold, by the load's plan: each region of a
    checkpoint tensor counted by the lowest rank it lands on (tp beyond the kv heads lands k / v on several)."""
    mine = 0
    for source in result.plan.sources.values():
        lowest: dict[tuple, int] = {}
        for share in source.shares:
            key = (share.piece.rows, share.piece.cols)
            lowest[key] = min(lowest.get(key, share.ranks.first), share.ranks.first)   # Ranks: first, step, count
        for share in source.shares:
            p, dst = share.piece, result.params[share.param]
            if rank in share.ranks and lowest.pop((p.rows, p.cols), None) == rank:
                rows, cols = p.rows[1] - p.rows[0], p.cols[1] - p.cols[0]
                mine += bits(dst.reshape(view2d(tuple(dst.shape)))[p.dst_row:p.dst_row + rows,
                                                                   p.dst_col:p.dst_col + cols])
    return job_sum(mine)


def run_serving(args, rank: int, world: int) -> None:
    from ..loader import run_load
    from ..options import LoadOptions

    result = run_load(args.model, LoadOptions.from_kwargs(tp=world, progress=False))
    say(f"serving rank {rank}: loaded {args.model} (tp {world}), version {result.version}; checksum "
        f"{shard_checksum(result, rank)}")
    link = join(args.address, "serving", target=result, timeout=args.timeout)
    for _ in range(args.steps):
        got = link.receive()
        r = got.report
        say(f"serving rank {rank}: version {got.version}, {r['seconds']:.3f} s (planning {r['plan_seconds']:.4f} s), "
            f"received {r['bytes_received']:,} B, its shard {r['own_shard_bytes']:,} B; checksum "
            f"{shard_checksum(result, rank)}")
    link.close()


def main(argv=None) -> int:
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    try:
        args = parse(argv)
        if "MASTER_ADDR" in os.environ:   # under torchrun; a plain `python -m` is a job of one rank
            dist.init_process_group("gloo")
        else:
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        (run_trainer if args.role == "trainer" else run_serving)(args, rank, world)
        dist.destroy_process_group()
    except DistloadError as exc:
        sys.stderr.write(f"distload: error on rank {rank}: {exc}\n")
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(1)   # a group joined with the other job may hold sockets: no teardown that could wait on it
    return 0


if __name__ == "__main__":
    sys.exit(main())
