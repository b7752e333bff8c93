"""The sparse MoE block of the reference forward, over the expert-parallel serving layout (DESIGN §4.2).

The world of W ranks is cut into `ep_size` contiguous groups of g = W / ep_size ranks; a group hosts some
experts and splits each of them g ways like a dense MLP (gate/up by rows, down by columns), so the g
partial outputs of a group sum to the expert's output. Every rank returns its partial sum and the caller
all-reduces once over the world. With EPLB replicas an expert is hosted by several groups; summing all of
them would count it several times, so only the *first* group hosting it (lowest ranks) contributes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from distload.errors import DistloadError
from distload.transfer import all_gather_cat


def swiglu(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """down(silu(gate(x)) * up(x)) with w13 = cat[gate, up] on dim 0 (a TP slice gives a partial sum)."""
    gate, up = F.linear(x, w13.to(x.dtype)).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, w2.to(x.dtype))


def default_expert_ids(n_experts: int, tp_rank: int, tp_size: int, ep_size: int) -> list[int]:
    """The plain placement: group k of ep_size hosts experts [k*n/ep_size, (k+1)*n/ep_size)."""
    if tp_size % ep_size or n_experts % ep_size:
        raise DistloadError(f"ep_size={ep_size} must divide the world size {tp_size} and the number of "
                            f"experts {n_experts}")
    per_group = n_experts // ep_size
    group = tp_rank // (tp_size // ep_size)
    return list(range(group * per_group, (group + 1) * per_group))


def counted_experts(local_expert_ids: list[int], n_experts: int, *, tp_rank: int, tp_size: int, ep_size: int,
                    device, group=None) -> list[bool]:
    """For each local expert: does this rank's group count it? (the first group hosting it does).

    Every rank tells the others what it hosts with one all-gather of a 0/1 mask, so the caller passes only
    its own ids. Collective: every rank must call it.
    """
    if tp_size % ep_size:
        raise DistloadError(f"ep_size={ep_size} must divide the world size {tp_size}")
    g = tp_size // ep_size
    hosted = torch.zeros(1, n_experts, device=device)
    hosted[0, local_expert_ids] = 1.0
    table = all_gather_cat(hosted, dim=0, group=group).bool()  # [W, n_experts]
    missing = [e for e in range(n_experts) if not table[:, e].any()]
    if missing:
        raise DistloadError(f"experts {missing} are hosted by no rank (ep_size={ep_size}, world {tp_size})")
    owner_group = (table.int().argmax(dim=0) // g).tolist()  # argmax: the first rank hosting the expert
    for e, k in enumerate(owner_group):
        if not table[k * g:(k + 1) * g, e].all():
            raise DistloadError(f"expert {e}: only part of EP group {k} (ranks {k * g}..{(k + 1) * g - 1}) hosts "
                                "it; every rank of a group must host the same experts")
    return [owner_group[e] == tp_rank // g for e in local_expert_ids]


def sparse_moe(params: dict, prefix: str, x: torch.Tensor, *, local_expert_ids: list[int], counted: list[bool],
               top_k: int, norm_topk: bool, shared_expert: bool) -> torch.Tensor:
    """This rank's partial MoE output for x `[T, H]` (to be summed over the world by the caller).

    Router: softmax over all experts (float32, as transformers), top-k, optionally renormalised.
    """
    router_logits = F.linear(x, params[prefix + "gate.weight"].to(x.dtype))
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, chosen = torch.topk(probs, top_k, dim=-1)  # [T, k]
    if norm_topk:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    weights = weights.to(x.dtype)

    w13, w2 = params[prefix + "experts.w13_weight"], params[prefix + "experts.w2_weight"]
    if w13.shape[0] != len(local_expert_ids) or w2.shape[0] != len(local_expert_ids):
        raise DistloadError(f"{prefix}experts: w13_weight {tuple(w13.shape)} / w2_weight {tuple(w2.shape)} do not "
                            f"hold the {len(local_expert_ids)} local experts {local_expert_ids}")
    out = torch.zeros_like(x)
    for slot, expert in enumerate(local_expert_ids):
        if not counted[slot]:
            continue
        token, k = torch.where(chosen == expert)
        if token.numel():
            out.index_add_(0, token, swiglu(x[token], w13[slot], w2[slot]) * weights[token, k, None])

    if shared_expert:
        # Qwen2-MoE: a dense expert, TP-split over the world, scaled by a per-token sigmoid gate. The gate is
        # replicated and the scaling linear, so scaling this rank's partial is the same as scaling the sum.
        gate = torch.sigmoid(F.linear(x, params[prefix + "shared_expert_gate.weight"].to(x.dtype)))
        out += gate * swiglu(x, params[prefix + "shared_expert.gate_up_proj.weight"],
                             params[prefix + "shared_expert.down_proj.weight"])
    return out
