"""Pipeline stages: which decoder layers each of P stages holds, exactly as vLLM assigns them.

vLLM (`vllm/distributed/utils.py` get_pp_indices) gives each stage L // P layers and the remainder one each to
the stages before the last, counting back from the second-to-last (the last stage also computes the head), or
takes `VLLM_PP_LAYER_PARTITION` ("a,b,c") as given. A loader that splits differently would hand a stage layers
its engine never asks for, so this is the one place the split is decided.
"""

from __future__ import annotations

from .errors import PlanError

PARTITION_ENV = "VLLM_PP_LAYER_PARTITION"


def parse_partition(text: str | None, source: str = "--pp-layers") -> tuple[int, ...] | None:
    """'15,15,16,15' -> (15, 15, 16, 15); None or '' -> None."""
    if text is None or not str(text).strip():
        return None
    try:
        return tuple(int(x) for x in str(text).split(","))
    except ValueError:
        raise PlanError(f"{source} {text!r}: expected comma-separated layer counts, one per stage, e.g. 15,15,16,15") \
            from None


def pp_partition(num_layers: int, pp: int, partition: tuple[int, ...] | None = None,
                 source: str = "--pp-layers") -> tuple[int, ...]:
    """Layers per stage: `partition` when given (checked), else vLLM's default split."""
    if pp < 1:
        raise PlanError(f"--pp {pp}: the number of pipeline stages must be >= 1")
    if pp > num_layers:
        raise PlanError(f"--pp {pp} is more pipeline stages than the model's {num_layers} layers "
                        f"(config.json num_hidden_layers); use --pp {num_layers} or fewer")
    if partition is not None:
        parts = tuple(partition)
        if len(parts) != pp:
            raise PlanError(f"{source} {','.join(map(str, parts))}: {len(parts)} stages given for --pp {pp}; "
                            f"give one layer count per stage")
        if min(parts) < 1:
            raise PlanError(f"{source} {','.join(map(str, parts))}: every stage needs at least one layer")
        if sum(parts) != num_layers:
            raise PlanError(f"{source} {','.join(map(str, parts))} sums to {sum(parts)} layers; the model has "
                            f"{num_layers} (config.json num_hidden_layers)")
        return parts
    parts = [num_layers // pp] * pp
    for i in range(2, num_layers % pp + 2):
        parts[-i] += 1
    return tuple(parts)


def pp_layer_range(num_layers: int, pp_rank: int, pp: int, partition: tuple[int, ...] | None = None) -> range:
    """The layers stage `pp_rank` of `pp` holds: range(start, end)."""
    parts = pp_partition(num_layers, pp, partition)
    start = sum(parts[:pp_rank])
    return range(start, start + parts[pp_rank])
