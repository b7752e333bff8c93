"""Side-by-side loads from one S3 server, in the same run: distload against Run:ai's streamer and every rank fetching.

    python scripts/s3_bench.py                   # ~256 MiB Llama-shaped bf16 checkpoint, 1 node x 2 ranks and 2
                                                 # emulated nodes x 2 ranks, 3 repetitions
    python scripts/s3_bench.py --quick           # a few MB, 1 node x 2 ranks, 1 repetition (the smoke test)
    python scripts/s3_bench.py --size-mib 1024 --reps 5 --out DIR

The server: tests/support/s3_server.py (moto, with ranged GETs read from the range only: --fast-ranges) in a process of
its own, so its GIL is not the clients'. The checkpoint is uploaded once; every loader reads the same objects. Each
scenario is one job (torchrun; two emulated nodes are two torchrun node agents on this machine, one rendezvous) whose
ranks run every loader, alternating, --reps times. Loaders, each rank keeping 1/world of the bytes:

- distload:           distload.load(s3://...): each byte fetched once per job by the readers, ranks get their shards
                      over gloo;
- distload-cached:    the same with --cache-dir (filled by an untimed load first): what a second load on a node does;
- runai:              Run:ai's SafetensorsStreamer (runai-model-streamer-s3) on every rank, as vLLM's
                      load_format="runai_streamer" does: every rank streams every file;
- every-rank-fetches: every rank GETs every tensor whole (distload's client: 8 MiB ranged GETs, 8 in flight), as
                      vLLM's default loader reads each tensor whole from a mounted bucket.

Per row: median seconds (slowest rank, from a barrier to its bytes in place), bytes the server sent (GETs answered
200/206) and requests it answered, both from its request log, as multiples of the checkpoint too, and the peak RSS of
the largest rank (VmHWM, reset before each load). Outputs: OUT/results.json, OUT/results.md (printed too).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "scripts"), str(ROOT / "tests" / "support")]   # bench.py's helpers, the S3 server

from bench import free_port, make_checkpoint, peak_rss_bytes, reset_peak_rss  # noqa: E402

LOADERS = ("distload", "distload-cached", "runai", "every-rank-fetches")
BUCKET, PREFIX = "bench-models", "llama"
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "bench-key", "AWS_SECRET_ACCESS_KEY": "bench-secret", "AWS_REGION": "us-east-1",
               "AWS_EC2_METADATA_DISABLED": "true", "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING": "0"}


# -- the loaders (inside a worker rank) ------------------------------------------------------------------------

def load_distload(ctx: dict, cached: bool):
    import distload

    options = dict(tp=ctx["world"], progress=False)
    if cached:
        options["cache_dir"] = ctx["cache_dir"]
    return distload.load(ctx["url"], **options).params


def keep_share(tensor, rank: int, world: int):
    """1/world of a tensor's bytes, copied out (what a rank keeps of a tensor it read whole)."""
    flat = tensor.reshape(-1).view(-1)
    n = flat.numel() // world
    return flat[rank * n:(rank + 1) * n].clone()


def load_runai(ctx: dict):
    from runai_model_streamer import SafetensorsStreamer

    kept = {}
    with SafetensorsStreamer() as streamer:
        streamer.stream_files(ctx["file_urls"])
        for name, tensor in streamer.get_tensors():
            kept[name] = keep_share(tensor, ctx["rank"], ctx["world"])
    return kept


def load_every_rank(ctx: dict):
    import torch

    from distload.checkpoint.s3.fetch import Fetcher
    from distload.checkpoint.s3.client import Store
    from distload.checkpoint.s3.listing import discover_objects
    from distload.checkpoint.s3.pace import Pacer
    from distload.checkpoint.s3.url import ObjectUrl

    index = discover_objects(ctx["url"])            # each rank lists and reads the headers itself
    fetcher = Fetcher(Store(ObjectUrl.parse(ctx["url"])), None, Pacer(None))
    biggest = max(e.nbytes for e in index.tensors.values())
    buf = torch.empty(biggest, dtype=torch.uint8)
    kept = {}
    try:
        for name, e in index.tensors.items():
            view = buf[:e.nbytes]
            fetcher.fetch([(index.objects[e.file], e.offset, memoryview(view.numpy()))])
            kept[name] = keep_share(view, ctx["rank"], ctx["world"])
    finally:
        fetcher.close()
    return kept


def run_loader(ctx: dict, loader: str):
    if loader.startswith("distload"):
        return load_distload(ctx, cached=loader == "distload-cached")
    return load_runai(ctx) if loader == "runai" else load_every_rank(ctx)


# -- a worker rank ---------------------------------------------------------------------------------------------

def worker(args) -> int:
    import torch.distributed as dist

    import torch.distributed.nn.functional  # noqa: F401  (before the group: topology.init_process_group says why)
    from s3_server import clear_log, fetched_log

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    node = int(os.environ.get("GROUP_RANK", "0"))
    ctx = {"rank": rank, "world": world, "url": args.url, "cache_dir": f"{args.cache_root}/node{node}",
           "file_urls": [f"{args.url}/{f}" for f in args.files.split(",")]}
    loaders = args.loaders.split(",")
    if "distload-cached" in loaders:
        load_distload(ctx, cached=True)          # fills each node's cache (untimed)
    rows = []
    for rep in range(args.reps):
        for loader in loaders[rep % len(loaders):] + loaders[:rep % len(loaders)]:
            dist.barrier()
            if rank == 0:
                clear_log(args.server)
            dist.barrier()
            reset_peak_rss()
            start = time.time()
            params = run_loader(ctx, loader)
            end, peak = time.time(), peak_rss_bytes()
            timings = [None] * world
            dist.all_gather_object(timings, (start, end, peak))
            dist.barrier()
            if rank == 0:
                log = fetched_log(args.server)
                served = [e for e in log.entries if e.method == "GET" and e.key and e.status in (200, 206)]
                rows.append({"loader": loader, "rep": rep, "seconds": max(t[1] for t in timings) - min(t[0] for t in timings),
                             "bytes_served": sum(e.sent for e in served), "requests": len(log.entries),
                             "get_requests": len(log.gets()), "peak_rss_bytes": max(t[2] for t in timings)})
            del params
    if rank == 0:
        with open(args.jsonl, "a") as f:
            for row in rows:
                f.write(json.dumps({**row, "nodes": args.nodes, "world": world}) + "\n")
    dist.destroy_process_group()
    return 0


# -- the driver ------------------------------------------------------------------------------------------------

def start_server(size_hint: int):
    proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "support" / "s3_server.py"), "--fast-ranges"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONSAFEPATH": "1"})
    return proc, proc.stdout.readline().strip()


def upload(url: str, ckpt: Path) -> list[str]:
    import boto3

    s3 = boto3.client("s3", endpoint_url=url, region_name="us-east-1", aws_access_key_id="bench-key",
                      aws_secret_access_key="bench-secret")
    s3.create_bucket(Bucket=BUCKET)
    for p in sorted(ckpt.iterdir()):
        s3.upload_file(str(p), BUCKET, f"{PREFIX}/{p.name}")
    return sorted(p.name for p in ckpt.glob("*.safetensors"))


def run_scenario(nodes: int, ranks: int, server: str, files: list[str], args, jsonl: Path, log) -> int:
    port = free_port()
    worker_cmd = [str(Path(__file__).resolve()), "--worker", "--url", f"s3://{BUCKET}/{PREFIX}", "--server", server,
                  "--files", ",".join(files), "--reps", str(args.reps), "--loaders", args.loaders,
                  "--jsonl", str(jsonl), "--nodes", str(nodes), "--cache-root", str(args.out / "cache")]
    env = {**os.environ, **CREDENTIALS, "AWS_ENDPOINT_URL": server, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    procs = []
    for node in range(nodes):
        agent = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes), "--node-rank", str(node),
                 "--nproc-per-node", str(ranks), "--rdzv-backend", "static", "--rdzv-endpoint", f"127.0.0.1:{port}"]
        procs.append(subprocess.Popen(agent + worker_cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
    return max(p.wait(timeout=args.timeout) for p in procs)


def summarize(rows: list[dict], checkpoint_bytes: int) -> list[dict]:
    out = []
    for key in sorted({(r["nodes"], r["world"], r["loader"]) for r in rows}, key=lambda k: (k[0], LOADERS.index(k[2]))):
        runs = [r for r in rows if (r["nodes"], r["world"], r["loader"]) == key]
        med = {k: statistics.median(r[k] for r in runs) for k in ("seconds", "bytes_served", "requests",
                                                                   "get_requests", "peak_rss_bytes")}
        out.append({"nodes": key[0], "world": key[1], "loader": key[2], "reps": len(runs),
                    "runs_s": [round(r["seconds"], 3) for r in runs], "median_s": med.pop("seconds"), **med,
                    "bytes_x_checkpoint": med["bytes_served"] / checkpoint_bytes})
    return out


def markdown(summary: list[dict], checkpoint_bytes: int, meta: str) -> str:
    lines = [meta, "", "| nodes x ranks | loader | seconds (median) | GB from the server | × checkpoint | requests "
             "(GETs) | peak RSS MiB |", "|---|---|---|---|---|---|---|"]
    for s in summary:
        lines.append(f"| {s['nodes']} x {s['world'] // s['nodes']} | {s['loader']} | {s['median_s']:.2f} "
                     f"({s['reps']} reps) | "
                     f"{s['bytes_served'] / 1e9:.3f} | {s['bytes_x_checkpoint']:.2f} | {s['requests']:.0f} "
                     f"({s['get_requests']:.0f}) | {s['peak_rss_bytes'] / 2**20:.0f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for name in ("url", "server", "files", "jsonl", "cache-root"):
        p.add_argument(f"--{name}", help=argparse.SUPPRESS)
    p.add_argument("--nodes", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--quick", action="store_true", help="a few MB, one node, one repetition (the smoke test)")
    p.add_argument("--size-mib", type=int, default=256, help="checkpoint size (default 256)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--loaders", default=",".join(LOADERS))
    p.add_argument("--out", type=Path, default=None, help="results folder (default: a temporary one)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds one scenario may take")
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)
    if args.quick:
        args.size_mib, args.reps = 8, 1
    args.out = (args.out or Path(tempfile.mkdtemp(prefix="distload-s3-bench-"))).absolute()
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="s3-bench-ckpt-"))
    ckpt = make_checkpoint(work / "ckpt", args.size_mib << 20, files=4, quick=args.quick)
    checkpoint_bytes = sum(p.stat().st_size for p in ckpt.glob("*.safetensors"))
    server, url = start_server(checkpoint_bytes)
    jsonl, status = args.out / "rows.jsonl", 0
    try:
        files = upload(url, ckpt)
        with open(args.out / "jobs.log", "w") as log:
            for nodes in ((1,) if args.quick else (1, 2)):
                status = max(status, run_scenario(nodes, 2, url, files, args, jsonl, log))
    finally:
        server.stdin.close()
        server.wait(timeout=60)
        shutil.rmtree(work, ignore_errors=True)
    rows = [json.loads(line) for line in jsonl.read_text().splitlines()] if jsonl.exists() else []
    summary = summarize(rows, checkpoint_bytes)
    meta = (f"checkpoint {checkpoint_bytes / 1e9:.3f} GB in {len(files)} files (Llama-shaped, bf16); "
            f"{os.cpu_count()} CPUs; server: moto (tests/support/s3_server.py --fast-ranges), its own process")
    text = markdown(summary, checkpoint_bytes, meta)
    (args.out / "results.json").write_text(json.dumps({"checkpoint_bytes": checkpoint_bytes, "rows": rows,
                                                       "summary": summary}, indent=1))
    (args.out / "results.md").write_text(text + "\n")
    print(text)
    print(f"(results in {args.out}; jobs' output in {args.out / 'jobs.log'})")
    return status or (0 if summary else 1)


if __name__ == "__main__":
    sys.exit(main())
