"""Refit side by side: distload's trainer-shard -> serving-shard refit against the broadcast baseline, one run.

    python scripts/refit_bench.py                       # ~1 GiB Llama-shaped bf16, trainer 4 -> serving 4 (tp 4)
    python scripts/refit_bench.py --quick --out r.json  # a few MB, trainer 2 -> serving 2 (the smoke test)

Two real jobs on this machine, each its own `torchrun` (gloo on CPU): a trainer job whose ranks hold FSDP2-like
Shard(0) pieces of every checkpoint tensor (`distload.refit.Piece`: rows [r*ceil(n/T), ...) of dim 0, read
from the checkpoint's safetensors), and a serving job that loaded the same checkpoint with `distload.load(tp=S)`.
Both jobs run both methods, one after the other, the same number of steps; each step the trainer negates its
weights (exact in bf16), so every step moves new bytes and the serving params must equal +-the loaded ones:

- distload:  `distload.join_refit` on both sides, `link.send(pieces)` / `link.receive()` per step (staged mode);
- broadcast: vLLM's `nccl` weight-transfer pattern, here on gloo: per checkpoint tensor, the trainer gathers
             the full tensor onto its rank 0 (over the trainer job's own group), rank 0 broadcasts it over a
             group of itself + every serving rank, and each serving rank cuts its tp shard out of the full tensor
             into its params (what vLLM's weight loaders do). Written here with plain torch.distributed.

Measured per method: seconds per step (slowest rank, from a barrier over both jobs to its step's end; median
of the steps after the first, and the first alone), bytes each serving rank receives (payload: distload's
report; the baseline: the full tensors broadcast to it), trainer peak RSS (VmHWM, reset before the steps) and
its rise over the RSS before them, and distload's plan seconds (first step against the later ones). After the
last step of each method every serving rank's params are fingerprinted: both methods must leave the same bytes.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402  (the checkpoint maker and the RSS / fingerprint probes)

REPO = Path(__file__).resolve().parent.parent
METHODS = ("distload", "broadcast")
AIM = {"seconds": 0.5, "bytes": 0.3}  # distload / baseline, the aims


# ----------------------------------------------------------------------------------------------------
# Both jobs' ranks


def groups(role: str, rank: int, trainers: int, servers: int, port: int, timeout: float):
    """(bench group over both jobs, broadcast group of trainer 0 + serving ranks or None), each a gloo group made
    from a prefix of one TCPStore that serving rank 0 hosts: the jobs' own default groups stay as they are."""
    import torch.distributed as dist

    td = datetime.timedelta(seconds=timeout)
    host = role == "serving" and rank == 0
    store = dist.TCPStore("127.0.0.1", port, trainers + servers, host, timeout=td, wait_for_workers=False)
    joined = rank if role == "trainer" else trainers + rank
    everyone = dist.ProcessGroupGloo(dist.PrefixStore("bench", store), joined, trainers + servers, td)
    if role == "trainer" and rank != 0:
        return everyone, None
    member = 0 if role == "trainer" else 1 + rank
    return everyone, dist.ProcessGroupGloo(dist.PrefixStore("broadcast", store), member, 1 + servers, td)


def barrier(pg) -> None:
    import torch

    pg.allreduce([torch.zeros(1)]).wait()


def shard0_range(n: int, rank: int, world: int) -> tuple[int, int]:
    """FSDP2's Shard(0): torch.chunk's rows, ceil(n / world) each (the last ranks may hold fewer or none)."""
    per = -(-n // world)
    return min(n, rank * per), min(n, (rank + 1) * per)


def trainer_pieces(model: Path, rank: int, world: int) -> dict:
    """name -> (local rows, row offset, global shape) of this trainer rank, read from the checkpoint."""
    from safetensors import safe_open

    index = json.loads((model / "model.safetensors.index.json").read_text())
    pieces = {}
    for file in sorted(set(index["weight_map"].values())):
        with safe_open(str(model / file), "pt") as f:
            for name in f.keys():
                sl = f.get_slice(name)
                shape = tuple(sl.get_shape())
                a, b = shard0_range(shape[0], rank, world)
                # cloned: private memory, as a trainer's weights are (file pages would turn private at the first
                # update, inside the measured steps)
                pieces[name] = (sl[a:b].clone(), a, shape)
    return dict(sorted(pieces.items()))


def as_refit_tensors(pieces: dict) -> dict:
    from distload.refit import Piece

    return {n: Piece(t, (a,) + (0,) * (len(shape) - 1), shape) for n, (t, a, shape) in pieces.items()}


def baseline_send(pieces: dict, bcast, rank: int, world: int) -> int:
    """Per tensor: gather the Shard(0) pieces onto trainer rank 0 (over the trainer job's own group), which
    broadcasts the full tensor. Returns the bytes rank 0 broadcast (0 elsewhere)."""
    import torch
    import torch.distributed as dist

    sent = 0
    for name, (local, a, shape) in pieces.items():
        per = -(-shape[0] // world)
        padded = torch.zeros((per,) + shape[1:], dtype=local.dtype)
        padded[:local.shape[0]] = local
        chunks = [torch.empty_like(padded) for _ in range(world)] if rank == 0 else None
        dist.gather(padded, chunks, dst=0)
        if rank == 0:
            full = torch.cat(chunks)[:shape[0]].contiguous()
            bcast.broadcast(full, 0).wait()
            sent += full.numel() * full.element_size()
            del full, chunks
    return sent


def baseline_receive(entries: list, result, bcast, tp_rank: int, tp: int) -> int:
    """Receive each full tensor (allocated per tensor, as vLLM's receiver does) and cut this rank's shard out."""
    import torch

    got = 0
    for name, shape, dtype in entries:
        full = torch.empty(shape, dtype=dtype)
        bcast.broadcast(full, 0).wait()
        got += full.numel() * full.element_size()
        cut_into(result.params, result.config, name, full, tp_rank, tp)
    return got


def cut_into(params: dict, config: dict, name: str, full, r: int, p: int) -> None:
    """vLLM's Llama weight loaders at tp p, rank r: full checkpoint tensor -> this rank's serving param."""
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    d = config["hidden_size"] // heads
    prefix, _, leaf = name.rpartition(".")[0].rpartition(".")
    if leaf in ("q_proj", "k_proj", "v_proj"):
        dst = params[f"{prefix}.qkv_proj.weight"]
        q_rows = heads // p * d
        kv_rows = max(1, kv_heads // p) * d
        kv_head0 = r * kv_heads // p if p <= kv_heads else r // (p // kv_heads)
        start, at = {"q_proj": (r * q_rows, 0), "k_proj": (kv_head0 * d, q_rows),
                     "v_proj": (kv_head0 * d, q_rows + kv_rows)}[leaf]
        rows = q_rows if leaf == "q_proj" else kv_rows
        dst[at:at + rows].copy_(full[start:start + rows])
    elif leaf in ("gate_proj", "up_proj"):
        dst = params[f"{prefix}.gate_up_proj.weight"]
        rows = full.shape[0] // p
        at = 0 if leaf == "gate_proj" else rows
        dst[at:at + rows].copy_(full[r * rows:(r + 1) * rows])
    elif leaf in ("o_proj", "down_proj"):
        dst = params[name]
        cols = full.shape[1] // p
        dst.copy_(full[:, r * cols:(r + 1) * cols])
    elif leaf in ("embed_tokens", "lm_head"):
        dst = params[name]
        rows = dst.shape[0]  # the padded vocab block; rows past the vocab stay as loaded (zeros)
        part = full[r * rows:(r + 1) * rows]
        dst[:part.shape[0]].copy_(part)
    else:  # norms: replicated
        params[name].copy_(full)


def negate(params: dict) -> None:
    seen = set()
    for t in params.values():
        if id(t) not in seen:
            seen.add(id(t))
            t.neg_()


def check_params(params: dict, initial: dict, sign: int, what: str) -> None:
    import torch

    wrong = [n for n, t in params.items() if not torch.equal(t, initial[n] if sign > 0 else -initial[n])]
    if wrong:
        raise SystemExit(f"refit_bench: {what}: serving params differ from the trainer's weights: {wrong[:3]}")


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.nn.functional  # noqa: F401  (before the group: see distload.topology)

    import distload

    role, rank, world = args.worker, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    trainers, servers = (world, args.peers) if role == "trainer" else (args.peers, world)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    everyone, bcast = groups(role, rank, trainers, servers, args.bench_port, args.timeout)
    model = Path(args.model)
    out = {"role": role, "rank": rank, "steps": {m: [] for m in args.methods}}
    if role == "trainer":
        pieces = trainer_pieces(model, rank, world)
        local = {n: t for n, (t, _, _) in pieces.items()}
        out["held_bytes"] = sum(t.numel() * t.element_size() for t in local.values())
    else:
        result = distload.load(str(model), tp=world, progress=False)
        initial = {n: t.clone() for n, t in result.params.items()}
        out["own_shard_bytes"] = sum(t.numel() * t.element_size() for t in initial.values())
        index = json.loads((model / "model.safetensors.index.json").read_text())
        from safetensors import safe_open
        entries = []
        for file in sorted(set(index["weight_map"].values())):
            with safe_open(str(model / file), "pt") as f:
                entries += [(n, tuple(f.get_slice(n).get_shape()), torch.bfloat16) for n in f.keys()]
        entries.sort()
    sign = 1
    for method in args.methods:
        if method == "distload":
            kw = dict(config=str(model), timeout=args.timeout)
            link = (distload.join_refit(args.address, role="trainer", **kw) if role == "trainer" else
                    distload.join_refit(args.address, role="serving", target=result, **kw))
        bench.reset_peak_rss()
        rss_before = bench.rss_bytes()
        for step in range(args.steps):
            if role == "trainer":
                negate(local)  # the trainer's new weights: every step moves other bytes
            sign = -sign
            barrier(everyone)
            t0 = time.perf_counter()
            row = {}
            if method == "distload":
                refit = link.send(as_refit_tensors(pieces)) if role == "trainer" else link.receive()
                row.update({k: refit.report.get(k) for k in ("plan_seconds", "bytes_received", "bytes_sent",
                                                             "own_shard_bytes", "staging_bytes")})
            elif role == "trainer":
                row["bytes_sent"] = baseline_send(pieces, bcast, rank, world)
            else:
                row["bytes_received"] = baseline_receive(entries, result, bcast, rank, world)
            row["seconds"] = time.perf_counter() - t0
            row["rss_rise_bytes"] = bench.peak_rss_bytes() - rss_before   # the high-water mark so far: which step set it
            out["steps"][method].append(row)
            if role == "serving":
                check_params(result.params, initial, sign, f"{method} step {step + 1}")
        if method == "distload":
            link.close()
        out[method] = {"peak_rss_bytes": bench.peak_rss_bytes(), "rss_before_bytes": rss_before}
        if role == "serving":
            out[method]["fingerprint"] = bench.fingerprint(result.params)
    barrier(everyone)
    Path(args.results, f"{role}-{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # the joined groups hold sockets to the other job: no teardown that could wait on it


# ----------------------------------------------------------------------------------------------------
# The run: a checkpoint, two jobs, a table


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_jobs(args, ckpt: Path, results: Path) -> None:
    address, bench_port = f"tcp://127.0.0.1:{free_port()}", free_port()
    procs = []
    for role, n, peers in (("serving", args.serving, args.trainer), ("trainer", args.trainer, args.serving)):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n),
               str(Path(__file__).resolve()), "--worker", role, "--peers", str(peers), "--model", str(ckpt),
               "--address", address, "--bench-port", str(bench_port), "--steps", str(args.steps),
               "--methods", ",".join(args.methods),
               "--timeout", str(args.timeout), "--results", str(results)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONUNBUFFERED": "1"}
        log = open(results / f"{role}.log", "w")
        procs.append((role, subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                                             start_new_session=True)))
    deadline = time.monotonic() + args.job_timeout
    for role, proc in procs:
        try:
            proc.wait(timeout=max(1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for _, p in procs:
                os.killpg(p.pid, 9)
            raise SystemExit(f"refit_bench: the jobs ran past {args.job_timeout}s; logs in {results}")
        if proc.returncode:
            tail = (results / f"{role}.log").read_text()[-4000:]
            raise SystemExit(f"refit_bench: the {role} job failed ({proc.returncode}):\n{tail}")


def summarize(ranks: list[dict], args, ckpt_bytes: int) -> dict:
    serving = [r for r in ranks if r["role"] == "serving"]
    trainer = [r for r in ranks if r["role"] == "trainer"]
    rows = {}
    for m in args.methods:
        per_step = [max(r["steps"][m][k]["seconds"] for r in ranks) for k in range(args.steps)]
        later = per_step[1:] or per_step
        recv = [r["steps"][m][-1]["bytes_received"] for r in serving]
        row = {"first_step_seconds": per_step[0], "step_seconds": statistics.median(later), "per_step": per_step,
               "bytes_received_per_serving_rank": recv, "max_bytes_received": max(recv),
               "own_shard_bytes": [r["own_shard_bytes"] for r in serving],
               "trainer_peak_rss_bytes": [r[m]["peak_rss_bytes"] for r in trainer],
               "trainer_rss_rise_bytes": [r[m]["peak_rss_bytes"] - r[m]["rss_before_bytes"] for r in trainer],
               "trainer_rss_rise_by_step": [[row["rss_rise_bytes"] for row in r["steps"][m]] for r in trainer],
               "serving_peak_rss_bytes": [r[m]["peak_rss_bytes"] for r in serving],
               "fingerprints": [r[m]["fingerprint"] for r in serving]}
        if m == "distload":
            plans = [[r["steps"][m][k]["plan_seconds"] for r in ranks] for k in range(args.steps)]
            row["plan_seconds_first"] = max(plans[0])
            row["plan_seconds_later"] = max(max(p) for p in plans[1:]) if len(plans) > 1 else None
            row["trainer_bytes_sent"] = [r["steps"][m][-1]["bytes_sent"] for r in trainer]
            row["trainer_held_bytes"] = [r["held_bytes"] for r in trainer]
            row["trainer_staging_bytes"] = [max(s["staging_bytes"] for s in r["steps"][m]) for r in trainer]
        rows[m] = row
    out = {"meta": meta(args, ckpt_bytes), "methods": rows}
    if len(rows) == len(METHODS):
        d, b = rows["distload"], rows["broadcast"]
        out["ratios"] = {"seconds": d["step_seconds"] / b["step_seconds"],
                         "bytes": d["max_bytes_received"] / b["max_bytes_received"]}
        out["aims_met"] = {k: out["ratios"][k] <= AIM[k] for k in AIM}
        out["same_params"] = d["fingerprints"] == b["fingerprints"]
    if d := rows.get("distload"):
        out["bytes_over_own_shard"] = max(x / y for x, y in zip(d["bytes_received_per_serving_rank"],
                                                               d["own_shard_bytes"]))
    return out


def meta(args, ckpt_bytes: int) -> dict:
    import torch

    return {"command": "python scripts/refit_bench.py " + " ".join(sys.argv[1:]), "trainer_ranks": args.trainer,
            "serving_ranks": args.serving, "tp": args.serving, "steps": args.steps, "checkpoint_bytes": ckpt_bytes,
            "backend": "gloo", "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, torch {torch.__version__}",
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


def table(s: dict) -> str:
    mib = 1 << 20
    lines = ["| method | s/step (median, steps 2..) | first step s | MiB received per serving rank (max) | "
             "trainer peak RSS MiB (max) | trainer RSS rise MiB (max) | plan s (first / later) |",
             "|---|---|---|---|---|---|---|"]
    for m, r in s["methods"].items():
        plan = (f"{r['plan_seconds_first']:.3f} / {r['plan_seconds_later']:.4f}"
                if r.get("plan_seconds_later") is not None else "-")
        lines.append(f"| {m} | {r['step_seconds']:.2f} | {r['first_step_seconds']:.2f} | "
                     f"{r['max_bytes_received'] / mib:.1f} | {max(r['trainer_peak_rss_bytes']) / mib:.0f} | "
                     f"{max(r['trainer_rss_rise_bytes']) / mib:.0f} | {plan} |")
    if q := s.get("ratios"):
        lines.append(f"\ndistload / broadcast: {q['seconds']:.2f}x the time (aim <= {AIM['seconds']}x), "
                     f"{q['bytes']:.2f}x the bytes per serving rank (aim <= {AIM['bytes']}x); "
                     f"received / own shard <= {s['bytes_over_own_shard']:.3f}; same params: {s['same_params']}")
    if d := s["methods"].get("distload"):
        rises = ", ".join("/".join(f"{b / mib:.0f}" for b in steps) for steps in d["trainer_rss_rise_by_step"])
        lines.append(f"distload trainer: staging (its message buffer) {max(d['trainer_staging_bytes']) / mib:.0f} MiB; "
                     f"RSS rise MiB after each step, per trainer rank: {rises}")
    m = s["meta"]
    lines.append(f"{m['checkpoint_bytes'] / mib:.0f} MiB bf16 Llama, trainer {m['trainer_ranks']} -> serving "
                 f"{m['serving_ranks']} (tp {m['tp']}), {m['steps']} steps, gloo; {m['machine']}; {m['date']}")
    lines.append(f"Command: `{m['command']}`")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size-mib", type=int, default=1024)
    p.add_argument("--quick", action="store_true", help="a few MB, trainer 2 -> serving 2")
    p.add_argument("--trainer", type=int, default=None)
    p.add_argument("--serving", type=int, default=None)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--methods", default=",".join(METHODS), help=f"a subset of {','.join(METHODS)}")
    p.add_argument("--workdir", default="/tmp/distload-refit-bench")
    p.add_argument("--out", default=None, help="write the results JSON here")
    p.add_argument("--timeout", type=float, default=600.0, help="each refit's and group's timeout")
    p.add_argument("--job-timeout", type=float, default=1800.0)
    for hidden in ("--worker", "--peers", "--model", "--address", "--bench-port", "--results"):
        p.add_argument(hidden, help=argparse.SUPPRESS, type=int if hidden in ("--peers", "--bench-port") else str)
    args = p.parse_args(argv)
    args.methods = [m for m in METHODS if m in args.methods.split(",")]
    args.trainer = args.trainer or (2 if args.quick else 4)
    args.serving = args.serving or (2 if args.quick else 4)
    args.steps = args.steps or 4
    if args.steps % 2:  # each method must end on the same sign for the fingerprints to compare
        p.error("--steps must be even")
    if args.worker:
        worker(args)
        return 0
    work = Path(args.workdir)
    ckpt = bench.make_checkpoint(work / ("llama-quick" if args.quick else f"llama-{args.size_mib}m"),
                                 (6 << 20) if args.quick else args.size_mib << 20, quick=args.quick)
    ckpt_bytes = json.loads((ckpt / "model.safetensors.index.json").read_text())["metadata"]["total_size"]
    results = work / f"run-{os.getpid()}"
    results.mkdir(parents=True)
    run_jobs(args, ckpt, results)
    ranks = [json.loads(f.read_text()) for f in sorted(results.glob("*-*.json"))]
    summary = summarize(ranks, args, ckpt_bytes)
    print(table(summary))
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
