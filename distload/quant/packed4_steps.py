"""Final specs and post-load steps of a packed 4-bit load: the packed form as it is, or --dequantize.

    packed (default)  the packed tensors are the final params (vLLM's layout before its post-processing)
    --dequantize      per quantized linear one `dequantize4` step: its packed tensors -> the float weight
                      [out, in] of the rank's cut, in BF16; the packed tensors are gone (MXFP4 experts: the
                      slice is staged unpadded and the BF16 param padded as the packed one, mxfp4.py)
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..errors import PlanError
from .fp8 import DEQUANTIZED_DTYPE
from .packed4 import PackedTensor, by_weight
from .packed4_formats import BNB_BLOCK, Packed4


@dataclass(frozen=True)
class Dequant4Step:
    """Dequantize one rank's packed tensors of one linear (quant/ops_4bit.py runs it).

    inputs: the packed params, `suffixes` says which is which; runs: (rows, part) down the local weight,
    for per-part scales (NVFP4 weight_scale_2); use_g_idx: GPTQ desc_act (else groups are i // group_size).
    """
    op: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    format: str
    suffixes: tuple[str, ...]
    group: int
    runs: tuple[tuple[int, int], ...] = ()
    use_g_idx: bool = False
    # bitsandbytes: per logical piece (dst_row, dst_col, rows, cols, src_row, src_col, src_cols, part) in
    # absmax blocks, to find each local block's global index; and each part's quant_state length in bytes
    blocks: tuple[tuple[int, ...], ...] = ()
    state_sizes: tuple[int, ...] = ()


def _runs(lay, spec, part_of: dict) -> tuple[tuple[int, int], ...]:
    """(rows, part) down the (first) local logical matrix, from the pieces at input column 0."""
    n_loc = spec.local_shape[-2]
    runs: list[list[int]] = []
    for pc in sorted((p for p in lay.pieces if p.dst_col == 0 and p.dst_row < n_loc), key=lambda p: p.dst_row):
        part = part_of[pc.source]
        if runs and runs[-1][1] == part:
            runs[-1][0] += pc.rows[1] - pc.rows[0]
        else:
            runs.append([pc.rows[1] - pc.rows[0], part])
    return tuple((r, p) for r, p in runs)


def _blocks(lay, sources: tuple[str, ...], index: dict) -> tuple[tuple[int, ...], ...]:
    """The logical pieces in absmax blocks (bitsandbytes: 64 inputs of one row each)."""
    part_of, b = {s: i for i, s in enumerate(sources)}, BNB_BLOCK
    return tuple((pc.dst_row, pc.dst_col // b, pc.rows[1] - pc.rows[0], (pc.cols[1] - pc.cols[0]) // b, pc.rows[0],
                  pc.cols[0] // b, index[pc.source].shape[1] // b, part_of[pc.source]) for pc in lay.pieces)


def finalize(staging: list[dict], logical: dict, packed: tuple[PackedTensor, ...], targets: dict, index: dict,
             scheme: Packed4, quantize: str | None, dequantize: bool) -> tuple[list[dict], list[tuple], str]:
    """(final specs per rank, steps per rank, what the load does about quantization)."""
    if quantize:
        raise PlanError(f"--quantize {quantize}: the checkpoint is already quantized ({scheme.describe()}); "
                        f"drop --quantize")
    if not dequantize:
        return staging, [() for _ in staging], scheme.describe()
    final = [dict(specs) for specs in staging]
    steps: list[list[Dequant4Step]] = [[] for _ in staging]
    for weight, tensors in by_weight(packed, logical).items():
        specs, lays = logical[weight]
        target = targets[weight]
        sources = target.sources
        part_of = ({s: j for parts in target.expert_sources for j, s in enumerate(parts)} if target.expert_sources
                   else {s: i for i, s in enumerate(sources)})
        states = [p for p in tensors if p.suffix.startswith("weight.quant_state.")]
        state_sizes = tuple(index[n].nbytes for n in states[0].sources) if states else ()
        for r, (spec, lay) in enumerate(zip(specs, lays)):
            if spec.style == "expert" and not spec.experts:
                continue  # this rank hosts no expert: nothing to rewrite
            for p in tensors:
                del final[r][p.name]
            final[r][weight] = replace(spec, dtype=DEQUANTIZED_DTYPE)
            steps[r].append(Dequant4Step("dequantize4", tuple(p.name for p in tensors), (weight,), scheme.name,
                                         tuple(p.suffix for p in tensors), scheme.group, _runs(lay, spec, part_of),
                                         scheme.desc_act, _blocks(lay, sources, index) if states else (),
                                         state_sizes))
    return final, [tuple(s) for s in steps], scheme.describe() + " -> BF16 (--dequantize)"
