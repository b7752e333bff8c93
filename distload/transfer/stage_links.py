"""Point-to-point links between pipeline stages, and the groups of ranks that compute together.

The reference forward (distload/models/forward.py) runs a stage's layers on its own TP group and hands the
hidden states to the next stage's rank of the same TP rank: one blocking send / receive per stage boundary.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .collectives import require_contiguous


def send_tensor(t: torch.Tensor, dst: int) -> None:
    """Send `t` to global rank `dst` (blocking; the peer calls recv_tensor with the same shape and dtype)."""
    require_contiguous(t, "send_tensor")
    dist.send(t, dst)


def recv_tensor(shape: tuple[int, ...], dtype: torch.dtype, device, src: int) -> torch.Tensor:
    """Receive the tensor global rank `src` sends with send_tensor."""
    t = torch.empty(shape, dtype=dtype, device=device)
    dist.recv(t, src)
    return t


def new_groups(rank_lists: list[list[int]]) -> list:
    """One process group per list of global ranks, in order. Collective: every rank of the world creates every
    group, in the same order (new_group's rule), also those it is not in."""
    return [dist.new_group(ranks=list(ranks)) for ranks in rank_lists]
