"""What planning asks of a load's quantization, and the plain load's answer (UNQUANTIZED).

build_plan is handed a quantization object as it is handed rules: quant.for_load(config, quantize=,
dequantize=) makes it from config.json's quantization_config and the options (quant/ holds every format).
The plan never names a format; it asks the object three things, in order, and threads the answers through:

    view(targets, tensors, rules, config) -> View
        what planning cuts: the targets and the index (a packed format plans a float *logical* weight in place
        of its packed tensors) and the companions, the tensors that travel with a weight target (scales, packed
        words, zero points), which claim checkpoint tensors as targets do
    cut(view, planned, targets, layout, relayout) -> cuts
        each companion's per-rank (specs, layouts) into `planned`, cut from its weight's own (relayout(name, q):
        the weight's at group size q, to name the sizes that work); what finalize needs back (a packed format's
        logical weights, which it takes out of `planned`)
    finalize(view, staging, planned, cuts, targets) -> (final specs, post-load steps per rank, note)

and `weight_dtypes` (stored dtypes a quantized weight may have: the dtype policy accepts them), `key` (what the
plan's digest includes) and `describe()` (None: nothing to say). Why an object and not a flag: each format
differs in these answers only, so adding one never touches the planner (torchtitan's parallelize swaps a Float8
style into the same plan dict the same way).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import PlanError


@dataclass(frozen=True)
class View:
    """What planning cuts (see the module docstring)."""
    targets: list
    index: dict
    companions: tuple = ()       # each has .name, .weight (its weight target) and .sources (checkpoint names)

    def matched(self, targets: dict) -> "View":
        """Only the companions of matched weight targets (a non-strict load leaves some out)."""
        return View(self.targets, self.index, tuple(c for c in self.companions if c.weight in targets))


class Unquantized:
    """The plain load: the checkpoint as it is, nothing beside its weights, no post-load step."""

    key = "unquantized"
    weight_dtypes: tuple[str, ...] = ()

    def describe(self) -> str | None:
        return None

    def view(self, targets, tensors: dict, rules, config: dict) -> View:
        if config.get("quantization_config"):   # a caller that forgot quant.for_load would load raw codes
            raise PlanError("config.json declares a quantization_config, but the plan was handed no quantization: "
                            "plan it with quantization=distload.quant.for_load(config) (a bug in the caller)")
        return View(targets, tensors)

    def cut(self, view: View, planned: dict, targets: dict, layout, relayout) -> None:
        return None

    def finalize(self, view: View, staging, planned: dict, cuts, targets: dict):
        return staging, [() for _ in staging], None


UNQUANTIZED = Unquantized()
