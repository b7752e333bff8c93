"""Where a failing `distload verify` goes wrong: the first layer whose hidden states leave transformers'.

Wrong logits say only that some shard is wrong; a rules author needs the place. Both sides number hidden
states as transformers' output_hidden_states does: 0 the embeddings (the input of layer 0), i + 1 the output
of layer i, num_hidden_layers the final-normed output of the last layer. Pure: tensors in, a sentence out.
"""

from __future__ import annotations

import torch


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """max |ours - ref| / max |ref| (the measure verify prints for the logits); inf when they cannot agree."""
    if ours.shape != ref.shape:
        return float("inf")
    diff = (ours.float() - ref.float()).abs().max().item()
    scale = ref.abs().max().item()
    return diff / scale if scale > 0 else (0.0 if diff == 0 else float("inf"))


def first_divergence(ours: dict[int, torch.Tensor], ref: list[torch.Tensor],
                     tolerance: float) -> tuple[int | None, str]:
    """(the first layer whose output differs by more than `tolerance`, or None; a sentence saying where).

    ours: hidden-state index -> `[T, H]` (the forward's record); ref: transformers' hidden states, in order.
    """
    n_layers = len(ref) - 1
    agreed = None  # the last index that agreed, and its error
    for k in sorted(i for i in ours if i < len(ref)):
        rel = rel_err(ours[k], ref[k])
        if rel <= tolerance:  # False for NaN
            agreed = (k, rel)
            continue
        if k == 0:
            return None, f"the embeddings already differ from transformers' (max rel err {rel:.3e})"
        what = "final-normed output" if k == n_layers else "output"
        since = f", while its input agrees to {agreed[1]:.3e}" if agreed and agreed[0] == k - 1 else ""
        return k - 1, (f"hidden states first diverge at layer {k - 1} (its {what}: max rel err {rel:.3e} > "
                       f"{tolerance:.1e}{since})")
    if agreed is None:
        return None, "no hidden states to compare"
    return None, (f"hidden states agree with transformers' through the final norm (max rel err <= {tolerance:.1e}): "
                  "the lm_head or the logit scaling differs")
