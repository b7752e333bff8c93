"""The reference forward over pipeline stages, for `distload verify --pp` (issue 22).

Ranks in vLLM's order with one data-parallel replica: rank = pp_rank * tp + tp_rank. Each stage runs its
layers on its own TP group and hands its hidden states to the same TP rank of the next stage (forward.py);
then the last stage's logits and every stage's hidden states are shared with every rank, so the comparison
on rank 0 and the verdict work as without stages.
"""

from __future__ import annotations

import torch

from distload.transfer import all_gather_objects, broadcast_object
from distload.transfer.stage_links import new_groups


def forward_over_stages(run, params: dict, config: dict, input_ids: torch.Tensor, *, rank: int, tp: int, pp: int,
                        layers: range, **forward_kwargs) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """(logits `[T, vocab]` on every rank, hidden states of all stages by transformers' numbering) for the
    forward `run` (forward.forward's arguments) over this rank's stage `layers`. Collective over the world."""
    pp_rank = rank // tp
    groups = new_groups([list(range(s * tp, (s + 1) * tp)) for s in range(pp)])
    hidden: dict[int, torch.Tensor] = {}
    logits = run(params, config, input_ids, tp_rank=rank % tp, tp_size=tp, group=groups[pp_rank], layers=layers,
                 prev_rank=rank - tp if pp_rank > 0 else None, next_rank=rank + tp if pp_rank < pp - 1 else None,
                 hidden_states=hidden, **forward_kwargs)
    logits = broadcast_object(logits.cpu() if logits is not None else None, src=(pp - 1) * tp)
    merged: dict[int, torch.Tensor] = {}
    for stage_hidden in all_gather_objects({k: h.cpu() for k, h in hidden.items()} if rank % tp == 0 else {}):
        merged.update(stage_hidden)
    return logits, merged
