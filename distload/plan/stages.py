"""The plan's name for distload.stages (vLLM's pipeline-stage layer split), which lives outside plan/ because
topology.Layout needs it and the plan package imports topology."""

from ..stages import PARTITION_ENV, parse_partition, pp_layer_range, pp_partition

__all__ = ["PARTITION_ENV", "parse_partition", "pp_layer_range", "pp_partition"]
