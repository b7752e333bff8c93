"""Refit planning at scale: one serving rank's first plan and a later step's check, from T FSDP2 trainer ranks.

    python scripts/refit_plan_scale.py                      # Llama-3-8B shapes, T = 4, 64, 1024, S = 4 (tp 4)
    python scripts/refit_plan_scale.py --trainers 4 --repeat 3

No processes and no bytes (tests/support/refit_scale.py): every trainer rank's Shard(0) holdings of the checkpoint's
real shapes, described as each describes its own per step; serving rank 1 of a tp S job plans from all of them as
the link's first step does (ServingSide.plan_for: the load's plan for the update, the mismatch check, the routes).
A later step replays that plan after one check, timed here as its two halves: a trainer rank describes its own
holdings and digests them (TrainerSide.describe), the serving rank compares the all-reduced digest sum with the
plan's (ServingRoutes.holds). The all-reduce itself (6 int64, at any world) is left to the jobs' reports
(scripts/refit_bench.py's "plan s (later)"). Prints a markdown table (BENCHMARKS.md, "Refit: planning").
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests" / "support")]   # the holdings and serving side the pure test plans

from refit_scale import digest_sum, llama_8b, serving_side, shard0_pieces, trainer_holdings  # noqa: E402

from distload.refit.trainer import TrainerSide  # noqa: E402


def median_seconds(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(trainers: int, servings: int, repeat: int) -> dict:
    config, shapes = llama_8b()
    holdings = trainer_holdings(shapes, trainers)
    total = digest_sum(holdings)
    side = serving_side(config, shapes, servings, rank=1)
    t0 = time.perf_counter()
    routes = side.plan_for(holdings, total)
    first = time.perf_counter() - t0
    last = trainers - 1   # the rank holding fewest rows: each holds one box per tensor at any world
    pieces = shard0_pieces(shapes, last, trainers)
    describe = median_seconds(lambda: TrainerSide(last).describe(pieces), repeat)
    check = median_seconds(lambda: routes.holds(total), max(repeat, 1000))
    moves = sum(len(msg) for msgs in routes.messages.values() for msg in msgs)
    return {"trainers": trainers, "servings": servings, "first_plan_s": first, "trainer_digest_s": describe,
            "serving_check_s": check, "senders": len(routes.messages),
            "messages": sum(len(m) for m in routes.messages.values()), "moves": moves,
            "received_over_own": routes.bytes_received / side.own_shard_bytes()}


def table(rows: list[dict]) -> str:
    import torch

    lines = ["| trainers T | serving S | first plan s (serving rank) | later step: trainer describe + digest ms | "
             "later step: serving check us | senders | messages | moves | received / own shard |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['trainers']} | {r['servings']} | {r['first_plan_s']:.3f} | "
                     f"{r['trainer_digest_s'] * 1e3:.2f} | {r['serving_check_s'] * 1e6:.2f} | {r['senders']} | "
                     f"{r['messages']} | {r['moves']} | {r['received_over_own']:.3f} |")
    lines.append(f"Llama-3-8B shapes (bf16, {len(llama_8b()[1])} tensors), FSDP2 Shard(0) trainers, serving tp S, "
                 f"serving rank 1; {platform.machine()}, {os.cpu_count()} CPU cores, torch {torch.__version__}")
    lines.append("Command: `python scripts/refit_plan_scale.py " + " ".join(sys.argv[1:]) + "`")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trainers", default="4,64,1024", help="comma-separated trainer worlds")
    p.add_argument("--servings", type=int, default=4, help="the serving job's world (tp)")
    p.add_argument("--repeat", type=int, default=20, help="per-step timings: the median of this many")
    args = p.parse_args(argv)
    rows = [measure(int(t), args.servings, args.repeat) for t in args.trainers.split(",")]
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
