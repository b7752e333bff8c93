"""The tensors that travel with a weight, for every format: found beside it by suffix, all parts or none.

No family file names a scale or a packed tensor. A quantized linear `X.weight` has companions in the checkpoint
as `X.<suffix>` (`X.weight_scale`, `X.input_scale`, `X.qzeros`, ...), one per part of the weight target for the
suffixes the format implies; a layer left unquantized (lm_head, `ignore`d modules) has none. Each companion is a
serving param named like its weight ('weight' -> the suffix) and is cut from the weight's own layout, so weight
and companion shards always match.
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass

from ..errors import PlanError
from ..rules import names

_WEIGHT = len("weight")
INPUT_SCALE = "input_scale"


@dataclass(frozen=True)
class Companion:
    """A tensor that travels with its weight target, cut from the weight's own layout."""
    name: str                                # serving name: the weight's name with 'weight' -> the suffix
    weight: str                              # the weight target it belongs to
    suffix: str
    scale_of: tuple[tuple[str, str], ...]    # (weight source, its companion source), in the weight's source order
    cut: object = None                       # packed formats: how it lies over its logical weight (packed.Cut)
    check_only: bool = False                 # read for a step's value check only, never a final param

    @functools.cached_property   # asked for per planning pass; computed once
    def sources(self) -> tuple[str, ...]:
        return tuple(s for _, s in self.scale_of)

    @property
    def is_input(self) -> bool:
        """A static activation scale (one value per part), not the weight's own scale."""
        return self.suffix == INPUT_SCALE


def with_suffix(weight_name: str, suffix: str) -> str:
    return weight_name[:-_WEIGHT] + suffix


def by_weight(companions, weights=None) -> dict[str, list[Companion]]:
    """The companions grouped by the weight they travel with (only those in `weights`, when given)."""
    out: dict[str, list[Companion]] = {}
    for c in companions:
        if weights is None or c.weight in weights:
            out.setdefault(c.weight, []).append(c)
    return out


_is_weight = operator.methodcaller("endswith", ".weight")


def linear_targets(targets, tensors: dict):
    """The targets that are linear weights in the checkpoint: named X.weight, every part an X.weight present."""
    for t in targets:
        sources = t.sources
        if t.name.endswith("weight") and all(map(_is_weight, sources)) and all(map(tensors.__contains__, sources)):
            yield t


def scale_companions(targets, tensors: dict, suffixes: tuple[str, ...], static_input: bool, where: str):
    """(target, its companions, whether its weight is quantized) per linear target: its parts' `X.<suffix>` for
    each of `suffixes` (the weight's scale first) and `X.input_scale`, each all or none."""
    kinds = [(suffix, any(map(operator.methodcaller("endswith", "." + suffix), tensors)))
             for suffix in (*suffixes, INPUT_SCALE)]
    # A suffix no checkpoint name ends with (dynamic activations' input_scale) has nothing to look up per source.
    for t in linear_targets(targets, tensors):
        sources, found, quantized = t.sources, [], False
        for suffix, anywhere in kinds:
            scales = [s[:-_WEIGHT] + suffix for s in sources]   # with_suffix, inline: thousands per target
            present = list(filter(tensors.__contains__, scales)) if anywhere else []
            if not present:
                if suffix == INPUT_SCALE and quantized and static_input:
                    raise PlanError(f"{t.name}: {where} says activation_scheme static, but the checkpoint "
                                    f"has no {names.describe(scales)}; re-export the checkpoint with its input "
                                    f"scales or set activation_scheme to dynamic")
                continue
            if len(present) != len(scales):
                raise PlanError(f"{t.name}: the checkpoint has {names.describe(present)} but not "
                                f"{names.describe(sorted(set(scales) - set(present)))}; every part of one param "
                                f"is quantized alike: the checkpoint is incomplete")
            quantized = quantized or suffix != INPUT_SCALE
            found.append(Companion(with_suffix(t.name, suffix), t.name, suffix, tuple(zip(sources, scales))))
        yield t, found, quantized
