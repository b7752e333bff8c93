"""Reconciliation: all ranks agree that every param was loaded exactly once (DESIGN §2 step 7).

Each rank checks what it *actually wrote* (the rectangles the transfer recorded, not the plan's
intent): every element of every declared param written exactly once. The ranks then exchange a summary
of fixed size (`SUMMARY_BYTES`, whatever the model and the world): its problem count, a digest of its
replicated params' names and one of their fingerprints, and its load-report numbers, in ONE all-gather.
Only when some summary shows a problem, an error, or replicas that may differ, a second all-gather carries
the detailed records, so the verdict names params and ranks exactly: missing, unexpected, written twice,
never written, replicas that differ. Identical on every rank, since every rank decides from the same bytes.
"""

from __future__ import annotations

import hashlib
import logging
import pickle
import struct
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from . import faults
from .rules import names
from .errors import DistloadError
from .plan.shard import view2d
from .transfer import all_gather_cat, all_gather_objects
from .transfer.agreement import rank_failure
from .transfer.collectives import object_device

log = logging.getLogger("distload")

# Per rank on the success path: 8 int64 words, then the report's values (pickled; its keys travel as a
# digest, since every rank builds the same keys). 256 B keeps 1024 ranks' summaries at 256 KiB received.
SUMMARY_BYTES = 256
_HEADER = struct.Struct("<7q8x")
_REPORT_ROOM = SUMMARY_BYTES - _HEADER.size


class Summary(NamedTuple):
    """One rank's summary as received (the header's words, then the report's pickled values)."""
    error: int               # 1: this rank could not make its record (the details say why)
    params: int
    problems: int            # params written twice or not fully, undeclared params
    names: int               # digest of its replicated params' names
    fingerprints: int        # digest of their (name, fingerprint) pairs
    keys: int                # digest of its report's keys
    report_len: int          # bytes of report values; -1: they did not fit (the details carry them)
    report: bytes


def coverage(rects: list[tuple[int, int, int, int]], rows: int, cols: int) -> tuple[int, int]:
    """(elements covered at least once, elements covered more than once) of a rows x cols grid.

    Exact for any set of axis-aligned rectangles (row0, row1, col0, col1); sweep over row boundaries.
    """
    bounds = sorted({r for r0, r1, _, _ in rects for r in (max(0, r0), min(rows, r1))})
    covered = twice = 0
    for lo, hi in zip(bounds, bounds[1:]):
        spans = sorted((c0, c1) for r0, r1, c0, c1 in rects if r0 <= lo and r1 >= hi)
        reach = 0
        for c0, c1 in spans:
            c0, c1 = max(c0, 0), min(c1, cols)
            if c0 < reach:
                twice += (min(c1, reach) - c0) * (hi - lo)
            if c1 > reach:
                covered += (c1 - max(c0, reach)) * (hi - lo)
                reach = c1
    return covered, twice


@dataclass
class Verdict:
    ok: bool
    params: int
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    written_twice: list[str] = field(default_factory=list)
    never_written: list[str] = field(default_factory=list)
    replicas_differ: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    rank_reports: list = field(default_factory=list)  # each rank's `report_record`, by rank (see reconcile)

    def summary(self) -> str:
        parts = []
        for label, items in (("missing", self.missing), ("unexpected", self.unexpected),
                             ("written twice", self.written_twice), ("never fully written", self.never_written),
                             ("replicas differ", self.replicas_differ)):
            if items:
                parts.append(f"{label}: {names.describe(items)}")
        return "; ".join(parts) if parts else "every param loaded exactly once"


def local_record(specs: dict, params: dict[str, torch.Tensor], written: dict, fingerprints) -> dict:
    """This rank's compact record: its problems and the fingerprints of its replicated params
    (`fingerprints`: tensors -> their fingerprints, kernels.fingerprints)."""
    twice, never, replicated = [], [], []
    for name, spec in sorted(specs.items()):
        if spec.alias_of:
            if params.get(name) is not params.get(spec.alias_of):
                never.append(f"{name} (tied alias of {spec.alias_of} is a separate tensor)")
            continue
        rows, cols = view2d(spec.local_shape)
        covered, doubled = coverage(written.get(name, []), rows, cols)
        if doubled:
            twice.append(f"{name} ({doubled} elements)")
        if covered != rows * cols:
            never.append(f"{name} ({rows * cols - covered} of {rows * cols} elements)")
        if spec.style == "replicate":
            replicated.append(name)
    fps = {name: tuple(int(x) for x in fp.tolist())
           for name, fp in zip(replicated, fingerprints([params[n] for n in replicated]))}
    extra = sorted(set(params) - set(specs))
    return {"params": len(specs), "twice": twice, "never": never, "fingerprints": fps, "undeclared": extra}


def _digest(obj) -> int:
    """A signed 64-bit digest of a picklable value (equal values, equal digests, on every rank)."""
    return int.from_bytes(hashlib.blake2b(pickle.dumps(obj), digest_size=8).digest(), "little", signed=True)


def summary_of(record: dict, report_record: dict | None) -> bytes:
    """This rank's fixed-size summary: SUMMARY_BYTES whatever the model and the world."""
    if "error" in record:
        return _HEADER.pack(1, 0, 0, 0, 0, 0, -1).ljust(SUMMARY_BYTES, b"\0")
    fps = sorted(record["fingerprints"].items())
    keys = tuple(report_record) if report_record is not None else None
    values = pickle.dumps(tuple(report_record.values()) if report_record is not None else None)
    fits = len(values) <= _REPORT_ROOM
    header = _HEADER.pack(0, record["params"], len(record["twice"]) + len(record["never"]) + len(record["undeclared"]),
                          _digest([n for n, _ in fps]), _digest(fps), _digest(keys), len(values) if fits else -1)
    return (header + (values if fits else b"")).ljust(SUMMARY_BYTES, b"\0")


def _exchange_summaries(summary: bytes) -> list[Summary]:
    """Every rank's summary, in rank order: one all-gather."""
    mine = torch.frombuffer(bytearray(summary), dtype=torch.uint8).to(object_device())
    every = all_gather_cat(mine, 0).cpu().numpy().tobytes()
    out = []
    for r in range(len(every) // SUMMARY_BYTES):
        slot = every[r * SUMMARY_BYTES:(r + 1) * SUMMARY_BYTES]
        words = _HEADER.unpack_from(slot)
        out.append(Summary(*words, slot[_HEADER.size:_HEADER.size + max(words[-1], 0)]))
    return out


def _needs_details(summaries: list[Summary], layout) -> bool:
    """Does any summary leave the verdict open? A problem or an error; replicas whose fingerprint digests
    differ, or ranks of one pipeline stage holding different replicated names (compared per name, as the
    details allow; stages hold different layers by design); report numbers that did not fit or whose keys
    differ."""
    per_stage: dict[int, set] = {}
    for r, s in enumerate(summaries):
        per_stage.setdefault(layout.pp_rank(r), set()).add((s.names, s.fingerprints))
    return (any(s.error or s.problems or s.report_len < 0 for s in summaries)
            or any(len(seen) > 1 for seen in per_stage.values()) or len({s.keys for s in summaries}) > 1)


def reconcile(plan, rank: int, params: dict[str, torch.Tensor], written: dict, strict: bool = True,
              fingerprints=None, report_record: dict | None = None) -> Verdict:
    """Agree on the load, identically everywhere; raise when strict and not ok. One all-gather of
    fixed-size summaries when all is well; a second, of the detailed records, only when something differs.
    report_record: what this rank puts in the load report (report.rank_record), carried by the same
    all-gather (one collective less per load: each one waits for the slowest rank); every rank's comes
    back in the verdict's rank_reports."""
    if fingerprints is None:
        from .kernels import fingerprints
    own_error = None
    try:
        faults.hit("local-record")  # test hook (DISTLOAD_FAULT), a no-op otherwise
        mine = local_record(plan.specs[rank], params, written, fingerprints)
    except Exception as exc:  # the peers are already in the all-gather below: take part, then raise
        own_error, mine = exc, {"error": f"{type(exc).__name__}: {exc}"}
    summaries = _exchange_summaries(summary_of(mine, report_record))
    if _needs_details(summaries, plan.layout):
        records = all_gather_objects({**mine, "report": report_record})
        if own_error is not None:
            raise own_error
    else:  # every rank clean and its replicas equal: the records the details would have said
        keys = tuple(report_record) if report_record is not None else None
        records = [{"params": s.params, "twice": [], "never": [], "undeclared": [], "fingerprints": {},
                    "report": dict(zip(keys, pickle.loads(s.report))) if keys is not None else None}
                   for s in summaries]
    return _verdict_from_records(plan, records, strict)


def _verdict_from_records(plan, records: list[dict], strict: bool) -> Verdict:
    """The verdict from every rank's record (local_record's, with its report), naming each param and rank."""
    failed = {r: rec["error"] for r, rec in enumerate(records) if "error" in rec}
    if failed:
        raise rank_failure("reconciliation", failed)
    v = Verdict(ok=True, params=sum(r["params"] for r in records),
                missing=list(plan.missing), unexpected=list(plan.unexpected),
                rank_reports=[r["report"] for r in records])
    for r, rec in enumerate(records):
        v.written_twice += [f"rank {r}: {x}" for x in rec["twice"]]
        v.never_written += [f"rank {r}: {x}" for x in rec["never"]]
        v.never_written += [f"rank {r}: {x} (no rule delivers it)" for x in rec["undeclared"]]
    by_name: dict[str, dict[tuple, list[int]]] = {}
    for r, rec in enumerate(records):
        for name, fp in rec["fingerprints"].items():
            by_name.setdefault(name, {}).setdefault(fp, []).append(r)
    for name, groups in sorted(by_name.items()):
        if len(groups) > 1:
            v.replicas_differ.append(f"{name} (rank groups {sorted(groups.values())})")
    v.ok = not (v.missing or v.unexpected or v.written_twice or v.never_written or v.replicas_differ)
    if not v.ok and strict:
        raise DistloadError(f"reconciliation failed: {v.summary()} (pass --no-strict to keep the loaded params anyway)")
    if not v.ok:
        log.warning("reconciliation (not strict): %s", v.summary())
    return v
