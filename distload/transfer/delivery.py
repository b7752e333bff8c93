"""The transfer phase, shared by the load pipeline (loader.py) and a live refit (refit.py): move the bytes
by the chosen route (transfer/route.py), zero the padding, and agree.
"""

from __future__ import annotations

import torch

from ..plan import LoadPlan
from .progress import Progress, mode_of
from . import NodePulls, Transfer, zero_padding
from .agreement import run_phase
from .owner_reads import OwnerReads
from .route import Route


WIRE = Route("wire", "the bucketed transfer")


def transfer_phase(plan: LoadPlan, rank: int, params: dict[str, torch.Tensor], device, *, route: Route = WIRE,
                   open_reader=None, progress: bool | str = False, on_bucket_done=None, after_transfer=None,
                   phase: str = "transfer", shm: bool = True, clock=None):
    """The transfer on this rank, ended by its agreement step: a rank with files to read opens its reader
    (open_reader()), the bytes move by `route`, padding is zeroed, after_transfer(reader) runs. Returns
    (reader, mover: its .stats, route taken); shm: the wire may stage through a node's shared memory
    (options.Tuning.shm); progress: the option (progress.mode_of: a bar or log lines on rank 0, on every route);
    clock: told how long the agreement waited (report.PhaseClock). A node-pulls route whose handover of the
    reader's files fails (every rank learns it together) takes the wire instead, with that reason."""
    reader, mover, taken = None, None, route
    mode = mode_of(progress, rank)
    # Rank 0's bar: on owner reads its own pieces (every rank copies its own alike); else its place in the plan's
    # buckets (its block's part: build_plan's rank mode), which node pulls walk on every rank together.
    total = plan.owned_bytes(rank) if route.kind == "owner-reads" and mode else sum(b.read_bytes for b in plan.buckets)
    bar = Progress(total, mode)

    def move():
        nonlocal reader, mover, taken
        if route.kind != "wire" or any(b.reader == rank for b in plan.buckets):
            reader = open_reader()  # node pulls: the other ranks read through descriptors they borrow
        if route.kind == "owner-reads":
            mover = OwnerReads(plan, rank, params, reader, progress=bar)
        elif route.kind == "node-pulls":
            pulls = NodePulls(plan, rank, params, reader, progress=bar)
            why = pulls.handover()
            if why is None:
                mover = pulls
            else:
                taken = Route("wire", f"one node, but the handover of the reader's files failed: {why}")
        if mover is None:
            mover = Transfer(plan, rank, params, reader=reader, device=device,
                             progress=bar if mode else None, on_bucket_done=on_bucket_done, shm=shm)
        try:
            mover.run()
        finally:
            bar.close()
        zero_padding(params, plan.staging_specs(rank), mover.stats)
        if mover.error is not None:
            raise mover.error
        if after_transfer is not None:
            after_transfer(reader)

    try:
        run_phase(phase, move, clock=clock)
    finally:
        if reader is not None:
            reader.close()
    return reader, mover, taken
