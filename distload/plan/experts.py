"""Expert placement: which ranks host which experts of an MoE layer.

Experts are most of an MoE checkpoint's bytes (a handful of routed experts per layer, each a full MLP,
against one attention block), so the plan delivers an expert's tensors only to the ranks that host it:
a rank never receives, stages or holds an expert it does not serve. Placement follows vLLM's expert
parallelism: the world is `ep` expert groups; the ranks of one group host the same experts and split
each of them by TP. `linear` gives group k experts [k*E/ep, (k+1)*E/ep); `round_robin` gives it every
expert e with e % ep == k; an explicit map (EPLB) may host a hot expert on several groups.

What a rank holds of an expert param depends only on (the experts its group hosts, its rank in the group):
`Placement` names that pair per rank of one period of ranks, so expert layouts are cut once per distinct
pair (layouts.py), and groups that host the same experts at a regular stride are one RankValues group
whose members are replicas (fanned out like dense replicas), whatever the number of such groups.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from ..errors import PlanError
from ..topology import Layout


@dataclass(frozen=True)
class Placement:
    """Rank r (of `world`) hosts hosts[keys[r % period][0]] as rank keys[r % period][1] of its expert group."""
    world: int
    group_size: int                              # ranks per expert group (each expert TP-split that many ways)
    hosts: tuple[tuple[int, ...], ...]           # the distinct host sets, ascending ids
    keys: tuple[tuple[int, int], ...]            # per rank of one period: (host set, rank in expert group)

    @property
    def period(self) -> int:
        return len(self.keys)

    def of(self, rank: int) -> tuple[int, ...]:
        return self.hosts[self.keys[rank % self.period][0]]

    @functools.cached_property
    def hosting(self) -> list[tuple[tuple[int, int], ...]]:
        """Per expert, (value index, slot) for each index of the period whose host set holds it: which ranks
        take an expert's sources, without a pass over the ranks per source (expert_layouts.py)."""
        out: list[list] = [[] for _ in range(max((e for ids in self.hosts for e in ids), default=-1) + 1)]
        for i, (k, _) in enumerate(self.keys):
            for slot, e in enumerate(self.hosts[k]):
                out[e].append((i, slot))
        return [tuple(x) for x in out]

    @functools.cached_property
    def one_per_shape(self) -> tuple[int, ...]:
        """The first value index of each distinct (rank in expert group, number of experts hosted): one rank
        per shape of expert params, for checks that need one each (quant/block_grid.py), once per placement."""
        first: dict[tuple[int, int], int] = {}
        for i, (k, t) in enumerate(self.keys):
            first.setdefault((t, len(self.hosts[k])), i)
        return tuple(first.values())

    @functools.cached_property
    def memo(self) -> dict:
        """Takers of expert sources (and of their block scales) by cut template, expert and part: alike across
        layers (expert_layouts.py, quant/expert_companions.py)."""
        return {}

    def per_rank(self) -> list[tuple[int, ...]]:
        """Per rank, the global expert ids it hosts: O(world), for tools and checks (planning uses keys)."""
        return [self.of(r) for r in range(self.world)]


def expert_hosts(num_experts: int, layout: Layout) -> list[tuple[int, ...]]:
    """Per rank, the global expert ids it hosts, ascending (EPLB maps may repeat an id across ranks)."""
    return expert_placement(num_experts, layout).per_rank()


def expert_placement(num_experts: int, layout: Layout) -> Placement:
    """The placement, checked: ep divides the experts (or the explicit --expert-map is sound)."""
    if layout.expert_map is not None:
        group_hosts = _mapped_hosts(num_experts, layout)
    else:
        group_hosts = _placed_hosts(num_experts, layout)
    distinct: dict[tuple[int, ...], int] = {}
    for ids in group_hosts:
        distinct.setdefault(ids, len(distinct))
    keys = [(distinct[group_hosts[expert_group(layout, r)]], layout.rank_in_expert_group(r))
            for r in range(layout.world)]
    period = _period(keys)
    return Placement(layout.world, layout.expert_group_size, tuple(distinct), tuple(keys[:period]))


def expert_group(layout: Layout, rank: int) -> int:
    """`rank`'s expert group, numbered across the job: each pipeline stage has its own `ep` groups (vLLM forms
    the EP group from one stage's dp x tp ranks), so an EPLB map may place a stage's experts differently."""
    return layout.pp_rank(rank) * layout.ep + layout.ep_rank(rank)


def _period(keys: list) -> int:
    """The smallest p dividing len(keys) with keys[r] == keys[r % p] for every r."""
    n = len(keys)
    for p in range(1, n + 1):
        if n % p == 0 and all(keys[r] == keys[r % p] for r in range(p, n)):
            return p
    return n


def _placed_hosts(num_experts: int, layout: Layout) -> list[tuple[int, ...]]:
    """Per expert group, its experts under linear or round_robin placement."""
    if num_experts % layout.ep:
        ok = [e for e in range(1, layout.world + 1) if layout.world % e == 0 and num_experts % e == 0]
        raise PlanError(f"num_experts={num_experts}, ep={layout.ep}: ep must divide the number of experts "
                        f"(try --ep {', '.join(map(str, ok))})")
    per = num_experts // layout.ep
    if layout.expert_placement == "linear":
        groups = [tuple(range(k * per, (k + 1) * per)) for k in range(layout.ep)]
    else:
        groups = [tuple(range(k, num_experts, layout.ep)) for k in range(layout.ep)]
    return groups * layout.pp    # every stage places its layers' experts alike


def _mapped_hosts(num_experts: int, layout: Layout) -> list[tuple[int, ...]]:
    """An explicit --expert-map, checked: ids in range, every expert hosted on every pipeline stage (each stage
    serves its layers' experts), one id set per expert group. The map is a per-rank table by its nature (the user
    wrote one); it is checked once, and planning keeps one host set per expert group."""
    emap = layout.expert_map
    if len(emap) != layout.world:
        raise PlanError(f"--expert-map has {len(emap)} rank entries; the world size is {layout.world}")
    bad = sorted({e for ids in emap for e in ids if not 0 <= e < num_experts})
    if bad:
        raise PlanError(f"--expert-map names experts {bad} outside 0..{num_experts - 1}")
    for stage in range(layout.pp):
        ranks = [r for r in range(layout.world) if layout.pp_rank(r) == stage]
        unhosted = sorted(set(range(num_experts)) - {e for r in ranks for e in emap[r]})
        if unhosted:
            where = f" on pipeline stage {stage} (ranks {ranks})" if layout.pp > 1 else ""
            raise PlanError(f"--expert-map hosts no rank for experts {unhosted}{where}; every expert needs a host")
    first: dict[int, int] = {}
    for r in range(layout.world):
        lead = first.setdefault(expert_group(layout, r), r)
        if sorted(emap[r]) != sorted(emap[lead]):
            raise PlanError(f"--expert-map: ranks {lead} and {r} are in one expert group (size "
                            f"{layout.expert_group_size}, ep={layout.ep}) and split its experts by TP, so they "
                            f"must host the same ids")
        if len(set(emap[r])) != len(emap[r]):
            raise PlanError(f"--expert-map: rank {r} lists an expert twice: {list(emap[r])}")
    return [tuple(sorted(emap[first[g]])) for g in range(layout.pp * layout.ep)]
