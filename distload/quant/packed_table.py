"""One row of a packed format's table: how a packed tensor lies over its logical weight [out, in] (packed.py)."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import PlanError

OUT, IN, ONE = "out", "in", "one"
INT_FLOAT_DTYPES = ("F16", "BF16", "F32")


@dataclass(frozen=True)
class Cut:
    """How one packed tensor's 2-D view lies over its logical weight [out, in]."""
    rows: tuple[str, int]            # (logical axis, logical values per row)
    cols: tuple[str, int]
    dtypes: tuple[str, ...]
    optional: bool = False           # some checkpoints of the format do without it (all parts alike)
    per_part: bool = False           # not cut: every rank holds every part's
    whole_in: bool = False           # when the input is cut, every rank still holds all of it (GPTQ desc_act)
    flat: bool = False               # stored flat (bitsandbytes): planned as its [rows, cols] view
    scalar: bool = False             # one number per part (NVFP4's global scale): shape [] or [1]


def expected_view(cut: Cut, out_f: int, in_f: int) -> tuple[int, int]:
    """The packed tensor's 2-D view over a logical [out_f, in_f]."""
    sizes = {OUT: out_f, IN: in_f, ONE: 1}
    return tuple(-(-sizes[axis] // unit) for axis, unit in (cut.rows, cut.cols))


def parse_group(value, where: str) -> int:
    """config.json's group_size: values per scale group, 0 for one group over the whole input (-1, 0, None)."""
    if value in (-1, 0, None):
        return 0
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise PlanError(f"{where}: group_size {value!r} must be a positive integer or -1; fix config.json")
    return value
