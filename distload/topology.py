"""Who is who in the job: ranks, nodes, dp x pp x tp coordinates, ep groups, reader ranks, device and backend.

`Layout` is the pure part the plan needs (and `inspect` builds without processes); `Topology` adds this
process's identity, read once from torchrun's environment here and passed down, never re-read deep
inside helpers. `init_process_group` is the one place (with transfer/) that touches torch.distributed.
"""

from __future__ import annotations

import datetime
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

from .errors import DistloadError, RankFailure
from .options import LoadOptions
from .stages import PARTITION_ENV, parse_partition, pp_partition

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
    pp: int = 1                                           # pipeline stages
    pp_layers: tuple[int, ...] | None = None              # layers per stage as given (None: vLLM's default split)
    pp_layers_from: str = "--pp-layers"                   # where pp_layers came from: the option, the env, default

    def __post_init__(self):
        if self.world < 1:
            raise DistloadError(f"world size must be >= 1, got {self.world}")
        if self.tp < 1 or self.world % self.tp:
            ok = [t for t in range(1, self.world + 1) if self.world % t == 0]
            raise DistloadError(f"--tp {self.tp} must divide the world size {self.world} "
                                f"(ranks beyond tp hold data-parallel replicas); try --tp {', '.join(map(str, ok))}")
        if self.pp < 1 or self.world % (self.pp * self.tp):
            ok = [p for p in range(1, self.world // self.tp + 1) if self.world % (p * self.tp) == 0]
            raise DistloadError(f"world size {self.world} is not divisible by --pp {self.pp} x --tp {self.tp} = "
                                f"{self.pp * self.tp} (ranks are dp x pp x tp); at --tp {self.tp} try --pp "
                                f"{', '.join(map(str, ok))}, or run on a multiple of {self.pp * self.tp} ranks")
        if self.ep < 1 or self.stage_world % self.ep:
            ok = [e for e in range(1, self.stage_world + 1) if self.stage_world % e == 0]
            within = f" ranks of one pipeline stage ({self.world} / --pp {self.pp})" if self.pp > 1 else " world size"
            raise DistloadError(f"--ep {self.ep} must divide the{within} {self.stage_world}; "
                                f"try --ep {', '.join(map(str, ok))}")
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

    def same_node(self, a: int, b: int) -> bool:
        return self.node(a) == self.node(b)

    def readers_on(self, node: int) -> tuple[int, ...]:
        """The reader ranks of one node."""
        return self.readers_by_node().get(node, ())

    def readers_by_node(self) -> dict[int, tuple[int, ...]]:
        """Per node with a reader, its readers in rank order (one pass over the readers)."""
        out: dict[int, list[int]] = {}
        for r in self.readers:
            out.setdefault(self.node(r), []).append(r)
        return {n: tuple(rs) for n, rs in sorted(out.items())}

    @property
    def reader_nodes(self) -> tuple[int, ...]:
        """The nodes that have a reader."""
        return tuple(sorted({self.node(r) for r in self.readers}))

    @property
    def reads_by_node(self) -> bool:
        """Readers on more than one node: each reads the rows its own node's ranks keep (plan/spans.py), skipping
        the rest of a tensor, so it reads exactly its ranges (no read-ahead into another node's rows)."""
        return len(self.reader_nodes) > 1

    def tp_rank(self, rank: int) -> int:
        return rank % self.tp

    def pp_rank(self, rank: int) -> int:
        """The pipeline stage of `rank` (vLLM's order: rank = (dp * pp + pp_rank) * tp + tp_rank)."""
        return (rank // self.tp) % self.pp

    def stage_partition(self, num_layers: int) -> tuple[int, ...]:
        """Layers per stage: pp_layers when given (checked against num_layers), else vLLM's split."""
        return pp_partition(num_layers, self.pp, self.pp_layers, source=self.pp_layers_from)

    def stage_layers(self, pp_rank: int, num_layers: int) -> range:
        """The decoder layers stage `pp_rank` holds, as vLLM's get_pp_indices assigns them."""
        parts = self.stage_partition(num_layers)
        start = sum(parts[:pp_rank])
        return range(start, start + parts[pp_rank])

    def stage_record(self, rank: int) -> dict:
        """A rank's pipeline stage and the decoder layers it holds ([first, end); None when the plan had no layer
        loop to split), as the report and a save's manifest record them."""
        pp_rank = self.pp_rank(rank)
        layers = self.stage_layers(pp_rank, sum(self.pp_layers)) if self.pp_layers else None
        return {"pp_rank": pp_rank, "layers": [layers.start, layers.stop] if layers is not None else None}

    @property
    def stage_world(self) -> int:
        """Ranks per pipeline stage (its dp x tp ranks)."""
        return self.world // self.pp

    def rank_in_stage(self, rank: int) -> int:
        """`rank`'s place among its stage's ranks, dp-major (vLLM's expert-parallel group order)."""
        return (rank // (self.pp * self.tp)) * self.tp + rank % self.tp

    @property
    def expert_group_size(self) -> int:
        """Ranks per expert-parallel group: inside it each expert is TP-split this many ways. The expert
        groups split one stage's ranks (vLLM forms its EP group from a stage's dp x tp ranks)."""
        return self.stage_world // self.ep

    def ep_rank(self, rank: int) -> int:
        return self.rank_in_stage(rank) // self.expert_group_size

    def rank_in_expert_group(self, rank: int) -> int:
        return self.rank_in_stage(rank) % self.expert_group_size


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


def check_world(world, local_world) -> None:
    """The job's ranks and ranks per node, as torchrun gives them (WORLD_SIZE, LOCAL_WORLD_SIZE) or `inspect` is
    told (--world, --local-world): whole numbers >= 1, the world a whole number of nodes."""
    for what, value in (("world size", world), ("ranks per node", local_world)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise DistloadError(f"the {what} must be a whole number of at least 1, got {value!r} ({WORLD_SOURCES})")
    if world % local_world:
        raise DistloadError(f"the world size {world} is not a whole number of nodes of {local_world} ranks "
                            f"({WORLD_SOURCES}); every node runs the same number of ranks")


WORLD_SOURCES = "torchrun's WORLD_SIZE and LOCAL_WORLD_SIZE; inspect's --world and --local-world"


def layout_for(world: int, local_world: int, options: LoadOptions, env=None) -> Layout:
    """The job's Layout for `options` (a LoadOptions) on `world` ranks, `local_world` per node. Without
    --pp-layers the partition is VLLM_PP_LAYER_PARTITION's from `env` (default os.environ), as vLLM's."""
    env = os.environ if env is None else env
    check_world(world, local_world)
    pp_layers, source = options.pp_layers, "--pp-layers"
    if pp_layers is None and options.pp > 1:
        pp_layers, source = parse_partition(env.get(PARTITION_ENV), PARTITION_ENV), PARTITION_ENV
    return Layout(world=world, tp=options.tp or max(1, world // options.pp), ep=options.ep,
                  readers=reader_ranks(world, local_world, options.readers), local_world=local_world,
                  expert_placement=options.expert_placement, owner_reads=options.readers == "owners",
                  expert_map=options.expert_map, pp=options.pp, pp_layers=pp_layers,
                  pp_layers_from=source if pp_layers is not None else "--pp-layers")


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
    check_launched(options, env)
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


def check_launched(options: LoadOptions, env) -> None:
    """A job of several ranks started as one plain process (no torchrun environment, no process group) is refused
    with the command that starts it."""
    import torch.distributed as dist

    needed = (options.tp or 1) * options.pp
    if needed > 1 and "WORLD_SIZE" not in env and not (dist.is_available() and dist.is_initialized()):
        flags = f"--tp {options.tp}" + (f" --pp {options.pp}" if options.pp > 1 else "")
        raise DistloadError(f"{flags} needs {needed} ranks, and this is one process that torchrun did not start "
                            f"(WORLD_SIZE is unset): start the job with torchrun --nproc-per-node {needed} -m "
                            f"distload load ... (your own script: torchrun --nproc-per-node {needed} script.py)")


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
    # the group is made, its defaults are None. A caller that makes its own group imports it first (README):
    # imported here, after that group exists, it would pin the caller's group.
    if dist.is_initialized():
        return False
    import torch.distributed.nn.functional  # noqa: F401
    if topo.device.startswith("cuda"):
        torch.cuda.set_device(topo.device)
    timeout = datetime.timedelta(seconds=topo.timeout_s)
    kwargs = dict(backend=topo.backend, rank=topo.rank, world_size=topo.world, timeout=timeout)
    if topo.backend == "nccl":
        kwargs["device_id"] = torch.device(topo.device)
    if "MASTER_ADDR" not in os.environ and topo.world == 1:
        # A plain `python -m distload load` needs no rendezvous.
        dist.init_process_group(store=dist.HashStore(), **kwargs)
        return True
    store = rendezvous_store(topo, timeout)
    arrived = f"distload/arrived/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"  # a restart's own keys
    store.set(arrived + str(topo.rank), "1")
    started = time.monotonic()
    try:
        # The prefix torch gives the store it makes itself, so the keys are the ones it would use.
        dist.init_process_group(store=dist.PrefixStore("default_pg", store), **kwargs)
    except dist.DistError as exc:
        raise not_arrived(store, arrived, topo, time.monotonic() - started, exc) from None
    return True


def rendezvous_store(topo: Topology, timeout: datetime.timedelta):
    """The job's store (torchrun's agent store, or rank 0's), reached from MASTER_ADDR / MASTER_PORT."""
    import torch.distributed as dist

    started = time.monotonic()
    try:
        store, _, _ = next(dist.rendezvous("env://", topo.rank, topo.world, timeout=timeout))
    except (dist.DistError, ValueError) as exc:
        where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
        raise RankFailure(f"rendezvous: rank {topo.rank} could not meet the other {topo.world - 1} rank(s) at {where} "
                          f"(gave up after {time.monotonic() - started:.0f} s: {first_line(exc)}); check that every "
                          "rank was started (same torchrun command on every node), that MASTER_ADDR:MASTER_PORT is reachable "
                          "from this node, and --timeout") from None
    store.set_timeout(timeout)
    return store


def not_arrived(store, prefix: str, topo: Topology, waited_s: float, exc: BaseException) -> RankFailure:
    """The rendezvous's failure, naming the ranks that never reached it (each rank marks its arrival)."""
    try:
        missing = [r for r in range(topo.world) if not store.check([prefix + str(r)])]
    except Exception:  # the store went with the node hosting it: nobody left to ask
        missing = None
    if missing:
        shown = ", ".join(map(str, missing[:16])) + (f" ... ({len(missing)} in all)" if len(missing) > 16 else "")
        return RankFailure(f"rendezvous: rank{'s' if len(missing) > 1 else ''} {shown} of {topo.world} did not arrive "
                           f"within --timeout {topo.timeout_s:g} s (rank {topo.rank} waited {waited_s:.0f} s); check "
                           "that they started (their logs: a crash before distload ran, a node that is down or ran "
                           "another command)",
                           {r: "never reached the rendezvous" for r in missing})
    whom = "every rank reached the rendezvous, but" if missing == [] else "the rendezvous store is gone, and"
    return RankFailure(f"rendezvous: {whom} the process group could not connect the {topo.world} ranks within "
                       f"{waited_s:.0f} s ({first_line(exc)}); check the network between the nodes "
                       "(GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME) and --timeout")


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else type(exc).__name__


@contextmanager
def torchrun_identity(rank: int, world: int):
    """RANK / WORLD_SIZE / LOCAL_RANK for distload's topology, which reads torchrun's environment
    (an engine's workers may set only LOCAL_WORLD_SIZE, as vLLM's do); restored afterwards."""
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    saved = {k: os.environ.get(k) for k in keys}
    local_world = int(saved["LOCAL_WORLD_SIZE"] or world)
    if world % local_world:
        local_world = world
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank % local_world),
                      LOCAL_WORLD_SIZE=str(local_world))
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
