"""The load report (DESIGN §4.4): JSON for `--report FILE`, and one summary line on rank 0."""

from __future__ import annotations

import json
import os
import resource
import time
from pathlib import Path

import torch

from .transfer.progress import rate, size


class PhaseClock:
    """Seconds per phase and in total, in the order the phases ran; of each phase, the seconds this rank spent
    waiting for the others (the rendezvous, each phase's agreement step) apart from its own work, so that a slow
    or late rank shows as waiting on the others, not as work of theirs (`waiting` in the report)."""

    def __init__(self):
        self.start = time.perf_counter()
        self.seconds: dict[str, float] = {}
        self.waits: dict[str, float] = {}
        self._last = self.start
        self._waited = 0.0

    def waiting(self, seconds: float) -> None:
        """Part of the running phase was spent waiting for other ranks (transfer.agreement.run_phase says how long)."""
        self._waited += seconds

    def lap(self, phase: str, waited: bool = False) -> None:
        """The phase since the last lap ends; waited: all of it was waiting for the other ranks (the rendezvous)."""
        now = time.perf_counter()
        elapsed = now - self._last
        wait = elapsed if waited else min(self._waited, elapsed)
        self.seconds[phase] = round(self.seconds.get(phase, 0.0) + elapsed - wait, 6)
        if wait:
            self.waits[phase] = round(self.waits.get(phase, 0.0) + wait, 6)
        self._last, self._waited = now, 0.0

    def as_dict(self) -> dict[str, float]:
        """Each phase's own seconds, and `total` (wall time: the phases plus `waiting_dict`'s)."""
        return {**self.seconds, "total": round(time.perf_counter() - self.start, 6)}

    def waiting_dict(self) -> dict[str, float]:
        return dict(self.waits)


def process_io_read_bytes() -> int | None:
    """Bytes this process caused to be fetched from storage (/proc/self/io read_bytes), if readable."""
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def rank_record(rank: int, stats, reader, device: str) -> dict:
    peak_device = 0
    if device.startswith("cuda"):
        peak_device = int(torch.cuda.max_memory_allocated(torch.device(device)))
    return {
        "rank": rank,
        "device": device,
        "bytes_read": int(reader.bytes_read) if reader is not None else 0,
        "files_opened": len(reader.files_opened) if reader is not None else 0,
        "bytes_received": int(stats.bytes_received),
        "bytes_from_other_nodes": int(stats.bytes_from_other_nodes),
        "bytes_sent": int(stats.bytes_sent),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "peak_device_bytes": peak_device,
        "io_read_bytes": process_io_read_bytes(),
        "transfer_path": stats.path,
        "read_strategy": getattr(reader, "strategy", None),  # None: this rank opened no weight file
    }


def build_report(plan, per_rank: list[dict], seconds: dict, verdict, source: str, extra: dict | None = None,
                 waiting: dict | None = None) -> dict:
    layout = plan.layout
    per_rank = [{**r, **layout.stage_record(r["rank"])} for r in per_rank]
    return {
        "ok": verdict is not None and verdict.ok,
        "source": source,
        "family": plan.family,
        "world_size": layout.world,
        "tp": layout.tp,
        "ep": layout.ep,
        "pp": layout.pp,
        "pp_layers": list(layout.pp_layers) if layout.pp_layers else None,
        "pp_layers_from": layout.pp_layers_from if layout.pp_layers else None,   # --pp-layers, the env, or default
        "readers": list(layout.readers),
        "checkpoint_bytes": plan.checkpoint_bytes,
        # What this rank planned: its block's part of the job (rank mode: "rank" names it) or the whole job (None).
        "plan_part": {"rank": plan.planned_for, "sources": len(plan.sources), "buckets": len(plan.buckets)},
        "storage_bytes_read": sum(r["bytes_read"] for r in per_rank),
        "seconds": seconds,
        "waiting": waiting or {},
        "per_rank": per_rank,
        "params": verdict.params if verdict is not None else 0,
        "missing": list(plan.missing),
        "unexpected": list(plan.unexpected),
        "ignored": list(plan.ignored),
        "verdict": verdict.summary() if verdict is not None else None,
        **(extra or {}),
    }


def write_report(report: dict, path: str | os.PathLike) -> None:
    tmp = Path(f"{path}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(report, indent=2, sort_keys=True))
    os.replace(tmp, path)


def summary_line(report: dict) -> str:
    """Rank 0's one line. param_shards: the params the ranks hold, summed over the ranks (a param cut over tp 2 is
    2 shards; a pipeline stage's layers are held by its ranks only): the report's `params`."""
    total = report["seconds"]["total"]
    read = report["storage_bytes_read"]
    peak = max(r["peak_rss_bytes"] for r in report["per_rank"])
    peak_device = max(r.get("peak_device_bytes", 0) for r in report["per_rank"])
    on_device = f" peak_device={size(peak_device)}" if peak_device else ""
    waited = sum((report.get("waiting") or {}).values())
    waiting = f", {waited:.2f}s of it waiting for other ranks" if waited >= 0.005 else ""
    pp = f" pp={report['pp']}" if report.get("pp", 1) > 1 else ""
    mtp = report.get("mtp") or {}   # sources' report_extra: the MTP layers (mtp.report_fields)
    draft = f" mtp={mtp['mode']}(layers {','.join(map(str, mtp['layers']))})" if mtp.get("stage") is not None else ""
    store = report.get("object_store")   # an s3:// checkpoint: the job's traffic with the store
    fetched = (f" store: {size(store['bytes_fetched'])} in {store['requests']} requests, {store['retries']} retries, "
               f"{size(store['bytes_from_cache'])} from the node cache;" if store else "")
    return (f"distload: {'OK' if report['ok'] else 'NOT OK'} {report['family']} "
            f"world={report['world_size']} tp={report['tp']}{pp} ep={report['ep']} readers={len(report['readers'])} "
            f"param_shards={report['params']} (over {report['world_size']} ranks){draft} "
            f"checkpoint={size(report['checkpoint_bytes'])} read={size(read)} "
            f"in {total:.2f}s ({rate(report['checkpoint_bytes'], total)}{waiting}) peak_rss={size(peak)}{on_device};"
            f"{fetched} {report['verdict']}")


def saved_line(report: dict, serves: str | None = None) -> str:
    """Where a --save-sharded load put its files, what reloads them, and (--for) what serves them."""
    out = report["saved_to"]
    return (f"distload: saved {report['world_size']} rank files and manifest.json to {out} (reload: distload load "
            f"{out})" + (f"; {serves}" if serves else ""))
