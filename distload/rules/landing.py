"""What a param's values go through between the checkpoint and the served tensor, beyond the cut: rule keys
`stored_shape`, `permute` and `transform` (plan/landing.py carries them out).

Each exists because a serving engine does the same while it loads (vLLM 0.32), and a load that skipped it would
have the right names, shapes and dtypes and the wrong values:

    stored_shape = ["1", "experts"]   the checkpoint stores the param in another shape of the same elements, row
                                      major (Ernie-4.5-MoE's e_score_correction_bias [1, E], served [E]): read as
                                      stored, cut and served as `shape`
    permute = "rotary_halves"         inside every head, the rows stored in rotary pairs (0, 1), (2, 3), ... are
                                      served as halves: rows 0, 2, 4, ..., then 1, 3, 5, ... (Llama-4's q and k:
                                      vLLM permutes them for its neox-style rotary); on a qkv param the q and k
                                      heads, never v
    transform = "neg_exp"             each value x is served as -exp(x) (Jamba's mamba A from A_log), computed on
                                      the delivered dtype (`dtype = "float32"`: in float32, as vLLM does)

The permutation and the transform run on each rank after its shard has landed (post-load steps), so the transfer
still moves plain rectangles of the stored tensor.
"""

from __future__ import annotations

from ..errors import RuleError
from . import dims as dim_expr

# permute value -> the styles it applies to (a cut that keeps whole heads of head_dim rows)
PERMUTES = {"rotary_halves": ("qkv", "kv", "column")}
# transform value -> what it serves
TRANSFORMS = {"neg_exp": "-exp(x)"}
KEYS = ("stored_shape", "permute", "transform")


def expressions(table: dict, key: str, target: str, where: str, dims: dict) -> tuple[str, ...]:
    """A shape key (`shape = ["hidden", "heads * head_dim"]`, stored_shape): one expression of [dims] names per axis."""
    shape = table.get(key, [])
    if not isinstance(shape, list) or not all(isinstance(d, str) for d in shape):
        raise RuleError(f"{where}: params.{target!r}: {key} must be a list of dim expressions, got {shape!r}")
    for expr in shape:
        unknown = dim_expr.names_in(expr) - set(dims)
        if unknown:
            raise RuleError(f"{where}: params.{target!r}: {key} entry {expr!r} names {sorted(unknown)}, "
                            f"not in [dims]; define them there (shapes use dim names, not config.json keys)")
    return tuple(shape)


def parse_landing(table: dict, target: str, style: str, where: str, dims: dict) -> dict:
    """The landing keys of a param table, validated: stored_shape (dim expressions), permute, transform."""
    stored = expressions(table, "stored_shape", target, where, dims)
    if stored and not table.get("shape"):
        raise RuleError(f"{where}: params.{target!r}: stored_shape needs shape (the served shape of the same "
                        f"elements)")
    if stored and (style == "expert" or len(table.get("parts", [target])) != 1):
        raise RuleError(f"{where}: params.{target!r}: stored_shape takes one source (not experts)")
    permute = table.get("permute")
    if permute is not None and permute not in PERMUTES:
        raise RuleError(f"{where}: params.{target!r}: permute {permute!r}; allowed: {', '.join(PERMUTES)}")
    if permute is not None and style not in PERMUTES[permute]:
        raise RuleError(f"{where}: params.{target!r}: permute = {permute!r} takes style "
                        f"{' / '.join(PERMUTES[permute])} (whole heads per rank), not {style}")
    if permute is not None and "head_dim" not in dims:
        raise RuleError(f"{where}: params.{target!r}: permute = {permute!r} needs dim head_dim in [dims]")
    transform = table.get("transform")
    if transform is not None and transform not in TRANSFORMS:
        raise RuleError(f"{where}: params.{target!r}: transform {transform!r}; allowed: "
                        + ", ".join(f"{k} ({v})" for k, v in TRANSFORMS.items()))
    return dict(stored_shape=stored, permute=permute, transform=transform)
