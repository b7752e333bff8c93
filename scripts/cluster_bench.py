"""Multi-node load benchmark on an emulated cluster whose links and storage are the limit (scripts/cluster.py).

    python scripts/cluster_bench.py                  # BENCHMARKS.md's table (root; ~1 GiB checkpoint, about an hour)
    python scripts/cluster_bench.py --quick          # a few MB on 2 nodes x 1 rank, one setting (tests/jobs)
    python scripts/cluster_bench.py --scenarios 2x2 --storage per-node --read-ahead-kb 8192 --loaders distload

Each setting (nodes x ranks per node, shared or per-node storage, read-ahead) is one emulated cluster and one
torchrun job over its nodes (bench.py's worker: every loader, cold, alternating, fingerprints compared). Each
row puts the measured time beside two others: "by bytes", the time the bytes it moved need at the cluster's
rates (storage bytes and each node's link bytes, both counted for the row by the node's cgroup and NIC, the
slowest of the two: what no loader can beat), and, for distload and every-rank-reads, the predictor's time
(distload/plan/predict.py: from the plan and the cluster's description alone, before any byte moves).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))   # its neighbours, also under PYTHONSAFEPATH=1

import bench  # noqa: E402
import cluster  # noqa: E402

from distload.plan.predict import ClusterSpec, predict  # noqa: E402

LOADERS = ("distload", "every-rank-reads", "fastsafetensors", "dcp")


def make_copies(ckpt: Path, nodes: int) -> list[Path]:
    """One copy of the checkpoint per node (the page cache is global: only separate files are separate caches)."""
    copies = [ckpt] + [ckpt.with_name(f"{ckpt.name}-node{k}") for k in range(1, nodes)]
    for copy in copies[1:]:
        if not (copy / "model.safetensors.index.json").exists():
            shutil.copytree(ckpt, copy, dirs_exist_ok=True)
            os.sync()   # dirty pages cannot be evicted: a cold run must find the files on disk
    return copies


def run_setting(setting: dict, ckpt: Path, warm: Path, out: Path, args) -> Path:
    """One torchrun job over an emulated cluster; returns its runs (JSON lines)."""
    nodes, ranks = setting["nodes"], setting["ranks"]
    copies = make_copies(ckpt, nodes)
    mount = Path(args.workdir) / "node-mount"
    mount.mkdir(exist_ok=True)
    jsonl = out / f"runs-{setting['name']}.jsonl"
    jsonl.unlink(missing_ok=True)
    worker = bench.worker_args(str(mount), jsonl, argparse.Namespace(
        reps=args.reps, caches=args.caches, staging_mib=None, quick=False, device="cpu", tp=None, pp=1),
        args.loaders.split(","))
    worker += ["--probes", "0", "--warmup-checkpoint", str(warm)]
    with cluster.Cluster(nodes, rate=args.rate, storage=setting["storage"], storage_mbps=args.storage_mbps,
                         data=str(ckpt), read_ahead_kb=setting["read_ahead_kb"], prefix=args.prefix,
                         subnet=args.subnet, queue=args.queue) as c:
        setting["shape"] = c.describe()
        with open(out / f"log-{setting['name']}.txt", "w") as log:
            procs = []
            for i in range(nodes):
                counter = c.node_counter(i) if setting["storage"] == "per-node" or i == 0 else None
                env = {"DISTLOAD_BENCH_NIC": "eth0", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                       **({"DISTLOAD_BENCH_DISK": f"{counter} {c.disk}"} if counter else {}),
                       **({"PYTHONPATH": args.distload_from} if args.distload_from else {})}
                procs.append(c.popen(i, c.torchrun(i, ranks, worker), bind={copies[i]: mount}, env=env,
                                     stdout=log, stderr=subprocess.STDOUT))
            series = Sampler(c, procs)
            deadline = time.monotonic() + args.setting_timeout
            for p in procs:
                try:
                    setting["rc"] = max(setting.get("rc", 0), p.wait(timeout=max(1, deadline - time.monotonic())))
                except subprocess.TimeoutExpired:
                    setting["rc"] = 124
                    break
            setting["series"] = series.stop()
    return jsonl


class Sampler(threading.Thread):
    """Every node's storage and link counters every 50 ms while the job runs: when each resource was busy."""

    def __init__(self, c, procs):
        super().__init__(daemon=True)
        self.c, self.procs, self.rows, self.done = c, procs, [], threading.Event()
        self.start()

    def run(self):
        while not self.done.wait(0.05):
            self.rows.append((round(time.time(), 3), self.c.sample(self.procs)))

    def stop(self) -> list:
        self.done.set()
        self.join()
        return self.rows


def by_bytes(row: dict, setting: dict) -> dict:
    """What the row's measured bytes need at the cluster's rates: storage (all nodes' bytes through one cap, or
    each node's through its own) and links (each node's bytes sent and received, L2, at the tbf rate)."""
    nodes = [p["node"] for p in row["per_rank"] if p.get("node")]
    stored = [n["storage_bytes"] for n in nodes if "storage_bytes" in n]
    link = max((max(n["sent_bytes"], n["received_bytes"]) for n in nodes), default=0)
    cap = setting["shape"]["storage_bytes_per_s"]
    storage_s = (max(stored) if setting["storage"] == "per-node" else sum(stored)) / cap if cap else 0.0
    link_s = link / (cluster.rate_bits(setting["shape"]["rate"]) / 8)
    return {"storage_bytes": sum(stored), "link_bytes_max": link, "storage_s": storage_s, "link_s": link_s,
            "seconds": max(storage_s, link_s), "bound": "storage" if storage_s >= link_s else "links"}


def tcp_timeouts(row: dict, series: list) -> int:
    """TCP retransmission timeouts on all nodes during the row (each stalls its flow for 200 ms or more)."""
    inside = [s for t, s in series if row["started_at"] <= t <= row["started_at"] + row["seconds"]]
    if len(inside) < 2:
        return 0
    return sum(last[3] - first[3] for first, last in zip(inside[0], inside[-1]))


def predictions(ckpt: Path, setting: dict) -> dict:
    """The predictor's times for this setting, from the plan and the cluster's description alone."""
    import distload

    nodes, ranks = setting["nodes"], setting["ranks"]
    plan = distload.inspect(ckpt, tp=nodes * ranks, world=nodes * ranks, local_world=ranks)
    shape = setting["shape"]
    spec = ClusterSpec(nodes=nodes, gpus_per_node=ranks, storage=setting["storage"],
                       storage_gbps=shape["storage_bytes_per_s"] / 1e9, nic_gbps=shape["link_goodput_bytes"] / 1e9,
                       read_ahead_kib=setting["read_ahead_kb"], broadcast="star")
    return {name: p.as_dict() for name, p in predict(plan, spec).items()}


def summarize(setting: dict, rows: list[dict], predicted: dict) -> list[dict]:
    out = []
    groups: dict[tuple, list] = {}
    for r in rows:
        groups.setdefault((r["loader"], r["cache"]), []).append(r)
    for (loader, cache), rs in sorted(groups.items(), key=lambda kv: (LOADERS + (kv[0][0],)).index(kv[0][0])):
        ok = [r for r in rs if not any(p["error"] for p in r["per_rank"])]
        errors = sorted({p["error"] for r in rs for p in r["per_rank"] if p["error"]})
        bytes_ = [by_bytes(r, setting) for r in ok]
        med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
        out.append({"setting": setting["name"], "nodes": setting["nodes"], "ranks": setting["ranks"],
                    "storage": setting["storage"], "read_ahead_kb": setting["read_ahead_kb"], "loader": loader,
                    "cache": cache, "seconds": med([r["seconds"] for r in ok]),
                    "seconds_all": [round(r["seconds"], 2) for r in ok],
                    "by_bytes_s": med([b["seconds"] for b in bytes_]),
                    "bound": bytes_[0]["bound"] if bytes_ else None,
                    "storage_bytes": med([b["storage_bytes"] for b in bytes_]),
                    "link_bytes_max": med([b["link_bytes_max"] for b in bytes_]),
                    "checkpoint_bytes": rs[0]["checkpoint_bytes"], "predicted": predicted.get(loader),
                    "tcp_timeouts": med([tcp_timeouts(r, setting.get("series", [])) for r in ok]),
                    "errors": errors})
    return out


def markdown(summary: list[dict], meta: dict) -> str:
    lines = [f"Checkpoint: {meta['checkpoint_desc']}. Machine: {meta['machine']}. Links: {meta['links']}. "
             f"Storage: {meta['storage']}.", "", f"Command: `{meta['command']}`", "",
             "| nodes x ranks | storage | read-ahead | loader | load s | vs every-rank-reads | by bytes s (bound) "
             "| load / by bytes | predicted s (bottleneck) | load / predicted | storage bytes / checkpoint "
             "| max node link MB | TCP timeouts |",
             "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    base = {(s["setting"], s["cache"]): s["seconds"] for s in summary if s["loader"] == "every-rank-reads"}
    for s in summary:
        head = f"| {s['nodes']} x {s['ranks']} | {s['storage']} | {s['read_ahead_kb']} KiB | {s['loader']} |"
        if s["seconds"] is None:
            lines.append(f"{head} failed: {'; '.join(s['errors'])[:100]} | | | | | | | | |")
            continue
        b = base.get((s["setting"], s["cache"]))
        p = s["predicted"]
        lines.append(f"{head} {s['seconds']:.2f} | {s['seconds'] / b:.2f}x |" if b else f"{head} {s['seconds']:.2f} | - |")
        lines[-1] += (f" {s['by_bytes_s']:.2f} ({s['bound']}) | {s['seconds'] / s['by_bytes_s']:.2f}x |"
                      if s["by_bytes_s"] else " - | - |")
        lines[-1] += (f" {p['seconds']:.2f} ({p['resource']}) | {s['seconds'] / p['seconds']:.2f}x |" if p
                      else " - | - |")
        lines[-1] += (f" {s['storage_bytes'] / s['checkpoint_bytes']:.2f}x | {s['link_bytes_max'] / 1e6:.0f} | "
                      f"{s.get('tcp_timeouts') or 0:.0f} |")
    return "\n".join(lines) + "\n"


SHARED_AIMS = {2: 0.55, 4: 0.30, 8: 0.17}   # distload / every-rank-reads, shared storage, several-MiB read-ahead


def checks(summary: list[dict]) -> list[str]:
    """Issue 39's must-show list, evaluated on this run: one line each, saying whether it holds."""
    at = {(s["setting"], s["loader"]): s for s in summary if s["seconds"]}
    out = []

    def line(claim, rows, bad):
        out.append(f"- {'holds' if rows and not bad else 'DOES NOT HOLD'}: {claim} ({len(rows)} rows"
                   + (f"; not: {'; '.join(bad)})" if bad else ")"))

    ours = [s for s in summary if s["loader"] == "distload" and s["seconds"]]
    shared = [s for s in ours if s["storage"] == "shared" and s["read_ahead_kb"] >= 1024 and s["nodes"] in SHARED_AIMS]
    bad = []
    for s in shared:
        base = at.get((s["setting"], "every-rank-reads"))
        if base is None or s["seconds"] / base["seconds"] > SHARED_AIMS[s["nodes"]]:
            bad.append(f"{s['setting']} {s['seconds'] / base['seconds']:.2f}x" if base else f"{s['setting']} no baseline")
    line("shared storage, several-MiB read-ahead: distload <= 0.55x / 0.30x / 0.17x every-rank-reads at 2 / 4 / 8 "
         "nodes", shared, bad)
    line("distload within 1.15x of its byte-count time", ours,
         [f"{s['setting']} {s['seconds'] / s['by_bytes_s']:.2f}x" for s in ours if s['seconds'] > 1.15 * s['by_bytes_s']])
    line("distload's storage bytes 1.00x the checkpoint", ours,
         [f"{s['setting']} {s['storage_bytes'] / s['checkpoint_bytes']:.3f}x" for s in ours
          if round(s["storage_bytes"] / s["checkpoint_bytes"], 2) > 1.00])
    predicted = [s for s in summary if s["predicted"] and s["seconds"]]
    line("the predictor within +-25% of the measured time", predicted,
         [f"{s['setting']} {s['loader']} {s['seconds'] / s['predicted']['seconds']:.2f}x" for s in predicted
          if not 0.75 <= s["seconds"] / s["predicted"]["seconds"] <= 1.25])
    return out


def settings(args) -> list[dict]:
    out = []
    for ra in map(int, args.read_ahead_kb.split(",")):
        for storage in args.storage.split(","):
            for sc in args.scenarios.split(","):
                nodes, ranks = map(int, sc.split("x"))
                out.append({"name": f"{nodes}x{ranks}-{storage}-ra{ra}", "nodes": nodes, "ranks": ranks,
                            "storage": storage, "read_ahead_kb": ra})
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenarios", default="2x2,4x1,8x1", help="nodes x ranks per node, comma-separated")
    p.add_argument("--storage", default="shared,per-node")
    p.add_argument("--read-ahead-kb", default="8192,128", help="the disk's read_ahead_kb per setting")
    p.add_argument("--rate", default="400mbit", help="each node's link (tbf rate, both directions)")
    p.add_argument("--storage-mbps", type=float, default=100, help="the storage cap, MB/s (shared: for all nodes)")
    p.add_argument("--queue", default="20ms", help="each link's queue, as the time it takes to drain (tbf latency)")
    p.add_argument("--size-gib", type=float, default=1.0)
    p.add_argument("--files", type=int, default=4)
    p.add_argument("--loaders", default=",".join(LOADERS))
    p.add_argument("--caches", default="cold")
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--workdir", default="/tmp/distload-cluster")
    p.add_argument("--out", default=None)
    p.add_argument("--setting-timeout", type=float, default=1800)
    p.add_argument("--quick", action="store_true", help="a few MB, 2 nodes x 1 rank, shared, one read-ahead")
    p.add_argument("--publish", action="store_true", help="write the table into BENCHMARKS.md and benchmarks/cluster/")
    p.add_argument("--distload-from", default=None, metavar="DIR",
                   help="the nodes' jobs import distload from this checkout (another commit, side by side; the "
                        "predictions stay this one's)")
    p.add_argument("--prefix", default="dlb", help="of the namespaces and cgroup (two runs side by side: two prefixes)")
    p.add_argument("--subnet", default="10.78.0", help="the nodes' /24 (two runs side by side: two subnets)")
    args = p.parse_args(argv)
    ok, why = cluster.can_shape(args.workdir if Path(args.workdir).exists() else "/tmp")
    if not ok:
        print(f"[cluster-bench] cannot emulate a shaped cluster here: {why}", flush=True)
        return 2
    if args.quick:
        args.scenarios, args.storage, args.read_ahead_kb = "2x1", "shared", "128"
    work = Path(args.workdir)
    out = Path(args.out) if args.out else work / "results"
    out.mkdir(parents=True, exist_ok=True)
    size = (6 << 20) if args.quick else int(args.size_gib * 2**30)
    ckpt = bench.make_checkpoint(work / f"llama-{size >> 20}mib-{args.files}files", size, args.files, quick=args.quick)
    warm = bench.make_checkpoint(work / "warmup", 6 << 20, args.files, quick=True)
    t0 = time.perf_counter()
    summary, done = [], []
    for setting in settings(args):
        print(f"[cluster-bench] {setting['name']}: {args.loaders}", flush=True)
        jsonl = run_setting(setting, ckpt, warm, out, args)
        rows = [json.loads(line) for line in jsonl.read_text().splitlines()] if jsonl.exists() else []
        rows_summary = summarize(setting, rows, predictions(ckpt, setting))
        summary += rows_summary
        done.append({**setting, "runs": rows, "fingerprints": bench.fingerprints_agree(rows)})
        for s in rows_summary:
            print(f"[cluster-bench]   {s['loader']:17s} {s['seconds'] or 0:.2f}s  by bytes {s['by_bytes_s'] or 0:.2f}s "
                  f"({s['bound']})  predicted {(s['predicted'] or {}).get('seconds', 0):.2f}s", flush=True)
    cfg = json.loads((ckpt / "config.json").read_text())
    ckpt_bytes = sum((ckpt / f).stat().st_size for f in bench.weight_files(ckpt))
    command = "python scripts/cluster_bench.py" + "".join(f" {a}" for a in (argv if argv is not None else sys.argv[1:]))
    meta = {"command": command, "machine": bench.machine(), "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "checkpoint_desc": f"Llama-shaped bf16, {ckpt_bytes / 2**30:.2f} GiB in {args.files} files (hidden "
                               f"{cfg['hidden_size']}, {cfg['num_hidden_layers']} layers), tp = nodes x ranks",
            "links": f"{args.rate} per node each way (tbf; {cluster.goodput_bytes(args.rate) / 1e6:.1f} MB/s TCP "
                     f"goodput), no added delay (no netem)",
            "storage": f"{args.storage_mbps:g} MB/s read cap (blkio; shared: one cap for all nodes, per-node: each "
                       f"node its own)", "seconds": round(time.perf_counter() - t0)}
    problems = [f"{d['name']}: {x}" for d in done for x in d["fingerprints"]]
    problems += [f"{d['name']}: torchrun exited {d['rc']}" for d in done if d.get("rc")]
    md = markdown(summary, meta) + "\nMust show (issue 39), evaluated on this run:\n\n" + "\n".join(checks(summary)) + "\n"
    md += "\nProblems: " + "; ".join(problems) + "\n" if problems else ""
    (out / "results.json").write_text(json.dumps({"meta": meta, "summary": summary, "settings": done}, indent=1))
    (out / "results.md").write_text(md)
    print(md, flush=True)
    if args.publish:
        dest = bench.REPO / "benchmarks" / "cluster"
        dest.mkdir(parents=True, exist_ok=True)
        shutil.copy(out / "results.md", dest / "results.md")
        slim = [{k: v for k, v in d.items() if k != "series"} for d in done]   # the 50 ms samples stay in OUT
        (dest / "results.json").write_text(json.dumps({"meta": meta, "summary": summary, "settings": slim}, indent=1))
        bench.publish_block("cluster", f"Latest run ({meta['date']}, {meta['seconds'] / 60:.0f} min):\n\n{md}")
        print(f"[cluster-bench] updated BENCHMARKS.md and {dest}", flush=True)
    return 1 if problems or not summary else 0


if __name__ == "__main__":
    sys.exit(main())
