"""Expert placement: which ranks host which experts of an MoE layer.

Experts are most of an MoE checkpoint's bytes (a handful of routed experts per layer, each a full MLP,
against one attention block), so the plan delivers an expert's tensors only to the ranks that host it:
a rank never receives, stages or holds an expert it does not serve. Placement follows vLLM's expert
parallelism: the world is `ep` expert groups; the ranks of one group host the same experts and split
each of them by TP. `linear` gives group k experts [k*E/ep, (k+1)*E/ep); `round_robin` gives it every
expert e with e % ep == k; an explicit map (EPLB) may host a hot expert on several groups.
"""

from __future__ import annotations

from ..errors import PlanError
from ..topology import Layout


def expert_hosts(num_experts: int, layout: Layout) -> list[tuple[int, ...]]:
    """Per rank, the global expert ids it hosts, ascending (EPLB maps may repeat an id across ranks)."""
    if layout.expert_map is not None:
        return _mapped_hosts(num_experts, layout)
    if num_experts % layout.ep:
        ok = [e for e in range(1, layout.world + 1) if layout.world % e == 0 and num_experts % e == 0]
        raise PlanError(f"num_experts={num_experts}, ep={layout.ep}: ep must divide the number of experts "
                        f"(try --ep {', '.join(map(str, ok))})")
    per = num_experts // layout.ep
    hosts = []
    for r in range(layout.world):
        k = layout.ep_rank(r)
        if layout.expert_placement == "linear":
            hosts.append(tuple(range(k * per, (k + 1) * per)))
        else:
            hosts.append(tuple(e for e in range(num_experts) if e % layout.ep == k))
    return hosts


def _mapped_hosts(num_experts: int, layout: Layout) -> list[tuple[int, ...]]:
    """An explicit --expert-map, checked: every expert hosted, ids in range, one id set per expert group."""
    emap = layout.expert_map
    if len(emap) != layout.world:
        raise PlanError(f"--expert-map has {len(emap)} rank entries; the world size is {layout.world}")
    bad = sorted({e for ids in emap for e in ids if not 0 <= e < num_experts})
    if bad:
        raise PlanError(f"--expert-map names experts {bad} outside 0..{num_experts - 1}")
    unhosted = sorted(set(range(num_experts)) - {e for ids in emap for e in ids})
    if unhosted:
        raise PlanError(f"--expert-map hosts no rank for experts {unhosted}; every expert needs a host")
    g = layout.expert_group_size
    for r in range(layout.world):
        if sorted(emap[r]) != sorted(emap[r - r % g]):
            raise PlanError(f"--expert-map: ranks {r - r % g} and {r} are in one expert group (size {g}, "
                            f"ep={layout.ep}) and split its experts by TP, so they must host the same ids")
        if len(set(emap[r])) != len(emap[r]):
            raise PlanError(f"--expert-map: rank {r} lists an expert twice: {list(emap[r])}")
    return [tuple(sorted(ids)) for ids in emap]
