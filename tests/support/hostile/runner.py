"""Run each case as a real `torchrun --standalone -m distload load ...` job and classify what happened.

Each rank runs under a two-line shell wrapper that only records the rank's own output and exit code
(torchrun reports the exit code of the first rank to fail, and SIGTERMs the rest; ignoring TERM in the
wrapper lets every rank end by itself, which is what distload promises). A rank lost before the
rendezvous is a process that never starts distload and waits until torchrun ends it; a rank with small
files may write none over 1 MiB (`ulimit -f`: a write past it fails with EFBIG, as on a full disk). torchrun's own output, with its
own traceback for a failed job, is kept apart from the ranks'.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from .case import Case

JOB_TIMEOUT_S = 20      # --timeout of every job (a case may pass its own after it)
GRACE_S = 30            # the bound: every job ends within --timeout + 30 s ...
STARTUP_S = 15          # ... plus torchrun's start on a busy machine; past that the job is a hang
ERROR_LINE = re.compile(r"^distload: error on rank (\d+): (.*)$", re.M)
VERDICT_LINE = re.compile(r"^error: (.*)$", re.M)   # `rules check` explains, then ends with its verdict line
REPO = Path(__file__).resolve().parents[3]

WRAPPER = """trap '' TERM
log="$HOSTILE_WS/rank$RANK"
if [ "$RANK" = "$HOSTILE_NEVER_STARTS" ]; then trap - TERM; exec sleep 600; fi
if [ "$RANK" = "$HOSTILE_SMALL_FILES_RANK" ]; then ulimit -f 1024; fi
"$HOSTILE_PY" -m distload "$@" > "$log.out" 2>&1
rc=$?
echo $rc > "$log.rc"
exit $rc
"""


@dataclass
class Result:
    case: Case
    outcome: str
    seconds: float
    detail: str = ""
    ranks: dict = field(default_factory=dict)   # rank -> (exit code or None, output)


def job_command(case: Case, args: list[str], wrapper: Path) -> list[str]:
    if case.command != "load":   # inspect, rules check: no process group, started as a user starts them
        return ["bash", str(wrapper), *case.command.split(), *args]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(case.nproc),
            "--no-python", "bash", str(wrapper), "load", "--timeout", str(JOB_TIMEOUT_S), "--no-progress", *args]


def job_env(case: Case, ws: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DISTLOAD_", "HOSTILE_"))}
    env.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1", HOSTILE_WS=str(ws),
               HOSTILE_PY=sys.executable, PYTHONPATH=str(REPO), **dict(case.env))
    if case.command != "load":
        env["RANK"] = "0"
    if case.lost_rank is not None and case.never_starts:
        env["HOSTILE_NEVER_STARTS"] = str(case.lost_rank)
    if case.small_files_rank is not None:
        env["HOSTILE_SMALL_FILES_RANK"] = str(case.small_files_rank)
    return env


def run_case(case: Case, root: Path, bases: dict) -> Result:
    ws = root / case.id
    ws.mkdir(parents=True)
    ckpt = ws / "ckpt"
    start = time.monotonic()
    try:
        if case.base:
            shutil.copytree(bases[case.base], ckpt)
        else:
            ckpt.mkdir()
        args = case.build(ckpt, ws)
    except Exception as exc:  # a builder bug fails this case, not the corpus
        return Result(case, "messy", 0.0, f"building the case failed: {exc!r}")
    wrapper = ws / "rank.sh"
    wrapper.write_text(WRAPPER)
    start = time.monotonic()
    proc = subprocess.Popen(job_command(case, args, wrapper), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env=job_env(case, ws), cwd=ws, start_new_session=True)
    hung = False
    try:
        agent_output, _ = proc.communicate(timeout=JOB_TIMEOUT_S + GRACE_S + STARTUP_S)
    except subprocess.TimeoutExpired:
        hung = True
        os.killpg(proc.pid, signal.SIGKILL)  # the job's session only: torchrun, its wrappers, their ranks
        agent_output, _ = proc.communicate()
    seconds = time.monotonic() - start
    (ws / "torchrun.out").write_bytes(agent_output or b"")
    ranks = {r: _rank_record(ws, r) for r in range(case.nproc)}
    outcome, detail = ("hang", "still running at the outer limit") if hung else classify(case, ranks)
    if outcome == "refused" and (ws / "out" / "manifest.json").exists():
        outcome, detail = "messy", "refused, yet out/ holds a manifest.json: a save that looks complete"
    return Result(case, outcome, seconds, detail, ranks)


def _rank_record(ws: Path, rank: int) -> tuple[int | None, str]:
    rc_file, out_file = ws / f"rank{rank}.rc", ws / f"rank{rank}.out"
    rc = int(rc_file.read_text().strip()) if rc_file.exists() else None
    return rc, out_file.read_text(errors="replace") if out_file.exists() else ""


def classify(case: Case, ranks: dict[int, tuple[int | None, str]]) -> tuple[str, str]:
    """(outcome, why) from every rank's exit code and output."""
    for r, (_, text) in sorted(ranks.items()):
        if "Traceback (most recent call last)" in text:
            return "traceback", f"rank {r}: " + text[text.index("Traceback"):][-300:].replace("\n", " | ")
    codes = {r: rc for r, (rc, _) in ranks.items()}
    if all(rc == 0 for rc in codes.values()) and ("distload: OK" in ranks[0][1] or case.command != "load"):
        return ("silent-wrong", "the job said OK") if case.expect == "refused" else ("ok", "")
    lines = {r: ERROR_LINE.findall(text) or _verdicts(case, r, text) for r, (_, text) in ranks.items()}
    problems = []
    for r in sorted(ranks):
        want = 0 if r == case.lost_rank else 1
        if codes[r] == 0 or (codes[r] is None and r != case.lost_rank):  # a lost rank may be killed
            problems.append(f"rank {r} exit code {codes[r]}")
        if len(lines[r]) != want and not (r == case.lost_rank and len(lines[r]) <= 1):
            problems.append(f"rank {r}: {len(lines[r])} error lines")
    if problems:
        return "messy", "; ".join(problems) + " | " + _first_line(ranks)
    messages = [m for found in lines.values() for _, m in found]
    missing = sorted({n for m in messages for n in case.names if n not in m})
    if missing:
        return "misnamed", f"message lacks {missing}: {messages[0][:300]}"
    return "refused", messages[0][:200]


def _verdicts(case: Case, rank: int, text: str) -> list[tuple[str, str]]:
    """`rules check`'s refusal of a rules file it explained: its last line, `error: ...` (exit code 1)."""
    return [(str(rank), m) for m in VERDICT_LINE.findall(text)] if case.command == "rules check" else []


def _first_line(ranks) -> str:
    for _, (_, text) in sorted(ranks.items()):
        for line in text.splitlines():
            if line.strip() and not line.startswith("[distload rank"):
                return line[:300]
    return "(no output)"


def run_corpus(cases: list[Case], root: Path, bases: dict, jobs: int = 4) -> list[Result]:
    """Every case, `jobs` at a time (torchrun mostly waits); a case that copies another's output waits for it."""
    by_id, futures = {c.id: c for c in cases}, {}
    needed = {c.after for c in cases if c.after}
    with ThreadPoolExecutor(jobs) as pool:
        for case in sorted((c for c in cases if not c.after), key=lambda c: c.id not in needed):
            futures[case.id] = pool.submit(run_case, case, root, bases)
        for case in (c for c in cases if c.after):
            if case.after in futures:
                futures[case.after].result()
            futures[case.id] = pool.submit(run_case, case, root, bases)
        return [futures[c.id].result() for c in cases if c.id in by_id]


def table(results: list[Result]) -> str:
    rows = [f"{'case':36s} {'expected':9s} {'outcome':13s} {'seconds':>7s}  detail"]
    for r in results:
        mark = "" if r.outcome == r.case.expect else " !"
        rows.append(f"{r.case.id:36s} {r.case.expect:9s} {r.outcome + mark:13s} {r.seconds:7.1f}  {r.detail[:150]}")
    return "\n".join(rows)
