"""One hostile case: how to build it from a base checkpoint and what a correct loader must do with it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

OUTCOMES = ("ok", "refused", "traceback", "hang", "silent-wrong", "misnamed", "messy")


@dataclass(frozen=True)
class Case:
    """build(ckpt, ws) -> the arguments after `distload load` (ckpt: a fresh copy of the base, ws: scratch).

    expect: "ok" (a valid load) or "refused" (every rank one `distload: error on rank R:` line, exit code
    nonzero on every rank, no traceback). names: strings every rank's message must hold (the cause named).
    """
    id: str
    build: Callable
    expect: str = "refused"
    names: tuple[str, ...] = ()
    base: str = "demo"       # a key of bases.BASES ("" = an empty directory)
    nproc: int = 2
    after: str = ""          # id of a case whose workspace (a sharded save) this one copies from
    lost_rank: int | None = None   # this rank is lost (prints nothing; must still end nonzero), the others name it
    never_starts: bool = False     # the lost rank's process never starts distload (never reaches the rendezvous)
    small_files_rank: int | None = None  # this rank may write no file over 1 MiB (a save that fails mid-write)
    env: tuple[tuple[str, str], ...] = ()
    command: str = "load"    # "load" runs under torchrun; "inspect" / "rules check" run as a user runs them: one
                             # process, no torchrun (nproc 1, its rank 0)
