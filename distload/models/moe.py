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

    w13, w2 = local_experts(params, prefix, local_expert_ids)
    out = routed_experts(x, chosen, weights, local_expert_ids, counted,
                         lambda slot, tokens: swiglu(tokens, w13[slot], w2[slot]))

    if shared_expert:
        # Qwen2-MoE: a dense expert, TP-split over the world, scaled by a per-token sigmoid gate. The gate is
        # replicated and the scaling linear, so scaling this rank's partial is the same as scaling the sum.
        gate = torch.sigmoid(F.linear(x, params[prefix + "shared_expert_gate.weight"].to(x.dtype)))
        out += gate * swiglu(x, params[prefix + "shared_expert.gate_up_proj.weight"],
                             params[prefix + "shared_expert.down_proj.weight"])
    return out


def expert_placement(local_expert_ids: list[int] | None, n_experts: int, *, tp_rank: int, tp_size: int,
                     ep_size: int, device, group=None) -> tuple[list[int], list[bool]]:
    """This rank's expert ids (default: the contiguous placement), checked ascending and distinct, and for each
    whether this rank's group counts it (counted_experts). Collective: every rank must call it."""
    if local_expert_ids is None:
        local_expert_ids = default_expert_ids(n_experts, tp_rank, tp_size, ep_size)
    if list(local_expert_ids) != sorted(set(local_expert_ids)):
        raise DistloadError(f"local_expert_ids {local_expert_ids} must be ascending and distinct: "
                            "w13_weight/w2_weight hold the local experts in ascending global id")
    counted = counted_experts(list(local_expert_ids), n_experts, tp_rank=tp_rank, tp_size=tp_size, ep_size=ep_size,
                              device=device, group=group)
    return list(local_expert_ids), counted


def local_experts(params: dict, prefix: str, local_expert_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """w13_weight and w2_weight of the block at `prefix`, checked to hold one matrix per local expert."""
    w13, w2 = params[prefix + "experts.w13_weight"], params[prefix + "experts.w2_weight"]
    if w13.shape[0] != len(local_expert_ids) or w2.shape[0] != len(local_expert_ids):
        raise DistloadError(f"{prefix}experts: w13_weight {tuple(w13.shape)} / w2_weight {tuple(w2.shape)} do not "
                            f"hold the {len(local_expert_ids)} local experts {local_expert_ids}")
    return w13, w2


def routed_experts(x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, local_expert_ids: list[int],
                   counted: list[bool], expert) -> torch.Tensor:
    """Per token, the sum of weight * expert(slot, its x) over the counted local experts it chose (a partial
    sum: the world's sum is the block's output). chosen / weights `[T, k]`: global expert ids and their weights."""
    out = torch.zeros_like(x)
    for slot, expert_id in enumerate(local_expert_ids):
        if not counted[slot]:
            continue
        token, k = torch.where(chosen == expert_id)
        if token.numel():
            out.index_add_(0, token, (expert(slot, x[token]) * weights[token, k, None]).to(x.dtype))
    return out


def in_top_groups(scores: torch.Tensor, n_group: int, topk_group: int, group_score) -> torch.Tensor:
    """bool [T, E]: the experts of the topk_group groups (of n_group contiguous groups) that `group_score`
    ([T, n_group, E / n_group] -> [T, n_group]) ranks highest, per token."""
    tokens, n_experts = scores.shape
    if n_experts % n_group:
        raise DistloadError(f"n_group={n_group} must divide the {n_experts} routed experts (config.json)")
    per_group = n_experts // n_group
    group_scores = group_score(scores.view(tokens, n_group, per_group))
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    return group_mask.unsqueeze(-1).expand(tokens, n_group, per_group).reshape(tokens, n_experts).bool()


def grouped_topk_route(x: torch.Tensor, gate_weight: torch.Tensor, correction_bias: torch.Tensor, *, top_k: int,
                       n_group: int, topk_group: int, norm_topk: bool,
                       scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 / GLM-4.5 router as transformers computes it, in float32: sigmoid scores; the choice adds the
    correction bias and keeps only the topk_group groups whose two best biased scores sum highest; the weights
    are the unbiased scores of the top_k chosen, renormalised if asked, times routed_scaling_factor.
    Returns (weights float32 [T, k], chosen ids [T, k])."""
    scores = F.linear(x.float(), gate_weight.float()).sigmoid()
    choice = scores + correction_bias.float()
    keep = in_top_groups(choice, n_group, topk_group, lambda g: g.topk(min(2, g.shape[-1]), dim=-1)[0].sum(dim=-1))
    choice = choice.masked_fill(~keep, float("-inf"))
    chosen = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, chosen)
    if norm_topk:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling, chosen


def softmax_topk_route(x: torch.Tensor, gate_weight: torch.Tensor, *, top_k: int, method: str, n_group: int,
                       topk_group: int, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V2's router as transformers computes it, in float32: softmax scores; `greedy` takes the top_k,
    `group_limited_greedy` only from the topk_group groups with the highest best score; the weights (never
    renormalised) times routed_scaling_factor. Returns (weights float32 [T, k], chosen ids [T, k])."""
    scores = F.linear(x.float(), gate_weight.float()).softmax(dim=-1)
    if method == "group_limited_greedy":
        keep = in_top_groups(scores, n_group, topk_group, lambda g: g.max(dim=-1).values)
        scores = scores.masked_fill(~keep, 0.0)
    elif method != "greedy":
        raise DistloadError(f"topk_method={method!r}: the DeepSeek-V2 reference forward implements 'greedy' and "
                            "'group_limited_greedy'")
    weights, chosen = torch.topk(scores, k=top_k, dim=-1, sorted=False)
    return weights * scaling, chosen
