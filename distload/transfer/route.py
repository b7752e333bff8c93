"""How bytes reach this rank's params: one decision, with its reason, made before any byte moves.

- "owner-reads": every rank copies the pieces it keeps straight out of the checkpoint files
  (owner_reads.py): asked for with `--readers owners` (one node), and always alone (world 1), where the
  one reader is the one owner and it is the same contract, one copy fewer;
- "node-pulls": one node, params in host memory: every rank copies its pieces out of the files its
  reader opened, through descriptors it borrows (node_pull.py, pull.py): one copy per byte;
- "wire": the bucketed transfer (engine.py): readers stage byte ranges and send each rank what it keeps.

The two direct copies need bytes that can be copied from the files as they are: no post-load step
(quantization) on them, a source that stores raw bytes at known offsets (the source says why not), and
host params (a device param needs a host buffer between file and device). The load and `distload
inspect` both ask `choose_route`, so they tell the same route and reason.
"""

from __future__ import annotations

from dataclasses import dataclass

ROUTES = ("wire", "node-pulls", "owner-reads")
READING_EVERY_RANK = ("node-pulls", "owner-reads")   # every rank of the node reads the files itself


@dataclass(frozen=True)
class Route:
    kind: str     # one of ROUTES
    reason: str

    def as_dict(self) -> dict:
        return {"kind": self.kind, "reason": self.reason}

    def describe(self) -> str:
        return f"route {self.kind}: {self.reason}"


def copy_blocker(plan, device: str, source_blocker: str | None) -> str | None:
    """Why the bytes cannot be copied from the files into the params as they are (None: they can)."""
    if any(plan.post):
        return "post-load steps (quantization) run per bucket"
    if source_blocker is not None:
        return source_blocker
    if not device.startswith("cpu"):
        return f"params on {device} need a host buffer between the file and the device"
    return None


def choose_route(plan, *, device: str, source_blocker: str | None = None, pulls_refused: str | None = None) -> Route:
    """The route of this load (the same on every rank). source_blocker: the source's reason its bytes
    cannot be copied as they are; pulls_refused: why this node's ranks cannot borrow a reader's open
    files (tuning, O_DIRECT reads, the OS: pull.py), None when they can."""
    layout = plan.layout
    why = copy_blocker(plan, device, source_blocker)
    if layout.owner_reads or layout.world == 1:
        if why is None:
            if layout.world == 1:
                return Route("owner-reads", "one rank: it copies its pieces straight from the files")
            return Route("owner-reads", "owner reads (--readers owners): each rank copies its own pieces from "
                                        "the files; nothing is sent")
        if layout.world > 1:
            return Route("wire", f"--readers owners: not here ({why}); every rank reads its share of the buckets")
        return Route("wire", f"one rank, through staging buckets: {why}")
    if not layout.one_node:
        nodes = layout.world // layout.local_world
        return Route("wire", f"{nodes} nodes: each rank gets what it keeps over the process group")
    if why is not None:
        return Route("wire", f"one node, but no direct copies: {why}")
    if pulls_refused is not None:
        return Route("wire", f"one node, but no pulls from the reader's files: {pulls_refused}")
    return Route("node-pulls", "one node, params in host memory: each rank copies its pieces straight from "
                               "the files its reader opened (node pulls)")


def reading_ranks(kind: str, layout, rank: int) -> int:
    """How many ranks of this node read the files at once on this route (the read strategy asks)."""
    if kind in READING_EVERY_RANK:
        return layout.local_world or layout.world
    return len(layout.readers_on(layout.node(rank)))
