"""Who is who in the job: ranks, nodes, tp / ep groups, reader ranks, device and backend.

`Layout` is the pure part the plan needs (and `inspect` builds without processes); `Topology` adds this
process's identity, read once from torchrun's environment here and passed down, never re-read deep
inside helpers. `init_process_group` is the one place (with transfer/) that touches torch.distributed.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field

from .errors import DistloadError
from .options import LoadOptions

PLACEMENTS = ("linear", "round_robin")


@dataclass(frozen=True)
class Layout:
    """The shape of the job: what the plan depends on, identical on every rank."""
    world: int
    tp: int
    ep: int = 1
    readers: tuple[int, ...] = (0,)
    local_world: int = 0                                  # ranks per node (0: all on one node)
    expert_placement: str = "linear"
    expert_map: tuple[tuple[int, ...], ...] | None = None  # EPLB: per rank, the global expert ids it hosts
    owner_reads: bool = False                             # --readers owners asked for (route.py decides)

    def __post_init__(self):
        if self.world < 1:
            raise DistloadError(f"world size must be >= 1, got {self.world}")
        if self.tp < 1 or self.world % self.tp:
            ok = [t for t in range(1, self.world + 1) if self.world % t == 0]
            raise DistloadError(f"--tp {self.tp} must divide the world size {self.world} "
                                f"(ranks beyond tp hold data-parallel replicas); try --tp {', '.join(map(str, ok))}")
        if self.ep < 1 or self.world % self.ep:
            ok = [e for e in range(1, self.world + 1) if self.world % e == 0]
            raise DistloadError(f"--ep {self.ep} must divide the world size {self.world}; try --ep {', '.join(map(str, ok))}")
        if self.expert_placement not in PLACEMENTS:
            raise DistloadError(f"--expert-placement {self.expert_placement!r}: choose one of {', '.join(PLACEMENTS)}")
        bad = [r for r in self.readers if not 0 <= r < self.world]
        if not self.readers or bad or len(set(self.readers)) != len(self.readers):
            raise DistloadError(f"reader ranks {list(self.readers)} must be distinct ranks in 0..{self.world - 1}")
        if self.owner_reads and len(self.readers) != self.world:
            raise DistloadError("owner reads need every rank to be a reader")

    @property
    def one_node(self) -> bool:
        """Are all ranks on one node (one page cache)?"""
        return self.local_world in (0, self.world)

    def node(self, rank: int) -> int:
        """The node `rank` runs on (torchrun numbers ranks node by node)."""
        return rank // self.local_world if self.local_world else 0

    def readers_on(self, node: int) -> tuple[int, ...]:
        """The reader ranks of one node."""
        return tuple(r for r in self.readers if self.node(r) == node)

    @property
    def reader_nodes(self) -> tuple[int, ...]:
        """The nodes that have a reader."""
        return tuple(sorted({self.node(r) for r in self.readers}))

    @property
    def reads_by_node(self) -> bool:
        """Readers on more than one node: each reads the rows its own node's ranks keep (plan.py), skipping
        the rest of a tensor, so it reads exactly its ranges (no read-ahead into another node's rows)."""
        return len(self.reader_nodes) > 1

    def tp_rank(self, rank: int) -> int:
        return rank % self.tp

    @property
    def expert_group_size(self) -> int:
        """Ranks per expert-parallel group: inside it each expert is TP-split this many ways."""
        return self.world // self.ep

    def ep_rank(self, rank: int) -> int:
        return rank // self.expert_group_size

    def rank_in_expert_group(self, rank: int) -> int:
        return rank % self.expert_group_size


READER_CHOICES = "'per-node', 'owners' (one node only) or a number of readers"


def reader_ranks(world: int, local_world: int, readers: str | int) -> tuple[int, ...]:
    """'per-node': local rank 0 of each node; 'owners': every rank (transfer/owner_reads.py; one node only);
    N: N readers spread evenly over the nodes."""
    local_world = local_world or world
    nodes = max(1, world // local_world)
    if readers == "per-node":
        return tuple(n * local_world for n in range(nodes))
    if readers == "owners":
        if nodes > 1:
            raise DistloadError(f"--readers owners: each rank reads its own pieces, which on {nodes} nodes would "
                                f"read a tensor from storage once per node that needs it; use --readers per-node "
                                f"(one reader per node) or --readers {world} (every rank reads, each byte once)")
        return tuple(range(world))
    try:
        n = int(readers)
    except ValueError:
        raise DistloadError(f"--readers {readers!r}: choose {READER_CHOICES}") from None
    if not 1 <= n <= world:
        raise DistloadError(f"--readers {n}: must be between 1 and the world size {world}, or 'per-node'")
    # Round-robin over nodes first so that N readers use N nodes' storage links before doubling up.
    order = [node * local_world + i for i in range(local_world) for node in range(nodes)]
    return tuple(sorted(order[:n]))


def layout_for(world: int, local_world: int, options: LoadOptions) -> Layout:
    """The job's Layout for `options` (a LoadOptions) on `world` ranks, `local_world` per node."""
    return Layout(world=world, tp=options.tp or world, ep=options.ep,
                  readers=reader_ranks(world, local_world, options.readers), local_world=local_world,
                  expert_placement=options.expert_placement, owner_reads=options.readers == "owners",
                  expert_map=options.expert_map)


@dataclass(frozen=True)
class Topology:
    """This process in the job."""
    rank: int
    local_rank: int
    node: int
    layout: Layout
    device: str = "cpu"
    backend: str = "gloo"
    timeout_s: float = 600.0
    env: dict = field(default_factory=dict, compare=False)

    @property
    def world(self) -> int:
        return self.layout.world

    @property
    def is_reader(self) -> bool:
        return self.rank in self.layout.readers


def from_environment(options: LoadOptions | None = None) -> Topology:
    """This process in the job for `options` (default: LoadOptions()), from torchrun's environment (RANK,
    WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK)."""
    import torch

    options = options if options is not None else LoadOptions()
    env = os.environ
    rank = int(env.get("RANK", "0"))
    world = int(env.get("WORLD_SIZE", "1"))
    local_rank = int(env.get("LOCAL_RANK", str(rank)))
    local_world = int(env.get("LOCAL_WORLD_SIZE", str(world)))
    node = int(env.get("GROUP_RANK", str(rank // max(local_world, 1))))
    device = options.device
    if device is None:
        device = f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu"
    backend = options.backend
    if backend is None:
        backend = "nccl" if device.startswith("cuda") else "gloo"
    return Topology(rank=rank, local_rank=local_rank, node=node, layout=layout_for(world, local_world, options),
                    device=device, backend=backend, timeout_s=options.timeout_s)


def init_process_group(topo: Topology) -> bool:
    """Initialise the default process group from torchrun's env unless the caller already did.

    Returns True if distload created it (and so should destroy it).
    """
    import torch
    import torch.distributed as dist
    # torch.distributed.nn.functional binds `group=group.WORLD` as default arguments when first imported:
    # imported after a process group exists (transformers' model construction does, in `verify`), it holds
    # the group forever, destroy_process_group cannot free it, and gloo's worker threads outlive the
    # interpreter - a worker finishing its last op during interpreter shutdown aborts the process
    # ("terminate called without an active exception", SIGABRT after a successful run). Imported before
    # the group is made, its defaults are None. (A caller that makes its own group imports it first.)
    import torch.distributed.nn.functional  # noqa: F401

    if dist.is_initialized():
        return False
    if topo.device.startswith("cuda"):
        torch.cuda.set_device(topo.device)
    kwargs = dict(backend=topo.backend, rank=topo.rank, world_size=topo.world,
                  timeout=datetime.timedelta(seconds=topo.timeout_s))
    if topo.backend == "nccl":
        kwargs["device_id"] = torch.device(topo.device)
    if "MASTER_ADDR" not in os.environ and topo.world == 1:
        kwargs["store"] = dist.HashStore()  # a plain `python -m distload load` needs no rendezvous
    dist.init_process_group(**kwargs)
    return True
