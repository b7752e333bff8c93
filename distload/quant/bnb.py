"""bitsandbytes 4-bit (quant_method bitsandbytes, load_in_4bit, nf4 or fp4), pre-quantized.

bitsandbytes packs the flat row-major weight in 64-value blocks, so with in % 64 == 0 the flat bytes are the
[out, in/2] matrix and the absmax the [out, in/64] one, and row and column cuts keep whole blocks (what no engine
does: vLLM and SGLang refuse pre-quantized bitsandbytes at tp > 1). A nested absmax (uint8 codes) is cut like
the fp32 one; the dequantize step undoes it with each block's global index in its part's whole weight.

    X.weight  U8 flat [out * in / 2]     X.weight.absmax  F32 (nested: U8) flat [out * in / 64]
    per part, not cut: X.weight.quant_map, .nested_absmax, .nested_quant_map, .quant_state.bitsandbytes__<type>
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from .. import kernels
from .format import refuse_kind
from .packed import PackedFormat, PackedStep, packed_op
from .packed_table import IN, ONE, OUT, Cut

BLOCK = 64
STATE = "weight.quant_state."


@dataclass(frozen=True)
class BnbStep(PackedStep):
    """The dequantize step with what nested absmax needs: per logical piece (dst_row, dst_col, rows, cols,
    src_row, src_col, src_cols, part) in absmax blocks, to find each local block's global index; and each
    part's quant_state length in bytes."""
    blocks: tuple[tuple[int, ...], ...] = ()
    state_sizes: tuple[int, ...] = ()


def _states(step, t: dict) -> list[dict]:
    """Each part's quant_state (bitsandbytes' JSON, stored as bytes; the parts' one after another)."""
    blob = next(v for k, v in t.items() if k.startswith(STATE)).reshape(-1).tolist()
    out, at = [], 0
    for n in step.state_sizes:
        out.append(json.loads(bytes(blob[at:at + n]).decode()))
        at += n
    return out


def _undo_nested(step, t: dict, codes: torch.Tensor) -> torch.Tensor:
    """fp32 absmax of this rank's blocks: nested_quant_map[code] * nested_absmax[b // 256] + offset, with b
    the block's index in its part's whole weight (bitsandbytes' double quantization, per part)."""
    states = _states(step, t)
    maps = t["weight.nested_quant_map"].reshape(len(states), -1).float()
    nested = t["weight.nested_absmax"].reshape(-1).float()
    starts = [0]
    for st in states:
        starts.append(starts[-1] + -(-math.prod(st["shape"]) // st["blocksize"] // st["nested_blocksize"]))
    out = torch.empty(codes.shape, dtype=torch.float32, device=codes.device)
    for dst_row, dst_col, rows, cols, src_row, src_col, src_cols, part in step.blocks:
        c = codes[dst_row:dst_row + rows, dst_col:dst_col + cols].long()
        b = ((src_row + torch.arange(rows, device=codes.device))[:, None] * src_cols
             + (src_col + torch.arange(cols, device=codes.device))[None, :])
        per_block = nested[starts[part]:starts[part + 1]][b // states[part]["nested_blocksize"]]
        offset = torch.tensor(states[part]["nested_offset"], dtype=torch.float32, device=codes.device)
        out[dst_row:dst_row + rows, dst_col:dst_col + cols] = maps[part][c] * per_block + offset
    return out


def _matrix(step, t: dict, dtype):
    weight, absmax = t["weight"], t["weight.absmax"]
    if absmax.dtype == torch.uint8:
        absmax = _undo_nested(step, t, absmax)
    maps = t["weight.quant_map"].reshape(-1, 16)
    cols = weight.shape[1] * 2
    out = torch.empty(weight.shape[0], cols, dtype=dtype, device=weight.device)
    row = 0
    for rows, part in step.runs:  # blocks never cross a row (in % 64 == 0); each part with its own code book
        out[row:row + rows] = kernels.dequantize_bnb_4bit(weight[row:row + rows], absmax[row:row + rows],
                                                          maps[part], (rows, cols), dtype=dtype)
        row += rows
    return out


@dataclass(frozen=True)
class Bnb4(PackedFormat):
    """bitsandbytes 4-bit (see the module docstring)."""
    quant_type: str = "fp4"          # nf4 | fp4

    name: ClassVar[str] = "bnb"
    declared_by: ClassVar[str] = "bnb (quant_method bitsandbytes, load_in_4bit, nf4 or fp4)"
    unit_name: ClassVar[str] = "block"
    experts_supported: ClassVar[bool] = False
    dequantize_op: ClassVar[str] = "dequantize_bnb"
    OPS: ClassVar[dict] = {"dequantize_bnb": packed_op(_matrix)}

    @staticmethod
    def declares(qc: dict) -> bool:
        return qc.get("quant_method") == "bitsandbytes"

    @classmethod
    def from_config(cls, qc: dict, where: str) -> "Bnb4":
        kind = qc.get("bnb_4bit_quant_type", "fp4")
        if not qc.get("load_in_4bit") or kind not in ("nf4", "fp4"):
            raise refuse_kind(where, f"load_in_4bit {qc.get('load_in_4bit')!r}, bnb_4bit_quant_type {kind!r}",
                              "pre-quantized 4-bit (nf4 / fp4) bitsandbytes checkpoints")
        return cls(where, group=BLOCK, quant_type=kind)

    def details(self) -> str:
        return f"{self.quant_type} {super().details()}"

    def cuts(self, in_features: int) -> dict[str, Cut]:
        part = dict(optional=True, per_part=True)
        return {"weight.absmax": Cut((OUT, 1), (IN, BLOCK), ("F32", "U8"), flat=True),
                "weight": Cut((OUT, 1), (IN, 2), ("U8",), flat=True),
                "weight.quant_map": Cut((ONE, 1), (ONE, 1), ("F32",), per_part=True),
                "weight.nested_absmax": Cut((ONE, 1), (ONE, 1), ("F32",), **part),
                "weight.nested_quant_map": Cut((ONE, 1), (ONE, 1), ("F32",), **part),
                f"{STATE}bitsandbytes__{self.quant_type}": Cut((ONE, 1), (ONE, 1), ("U8",), per_part=True)}

    def step(self, weight, tensors, spec, lay, target, index, kind=BnbStep, **extra):
        states = [p for p in tensors if p.suffix.startswith(STATE)]
        part_of = {s: i for i, s in enumerate(target.sources)}
        blocks = tuple((pc.dst_row, pc.dst_col // BLOCK, pc.rows[1] - pc.rows[0], (pc.cols[1] - pc.cols[0]) // BLOCK,
                        pc.rows[0], pc.cols[0] // BLOCK, index[pc.source].shape[1] // BLOCK, part_of[pc.source])
                       for pc in lay.pieces) if states else ()
        sizes = tuple(index[n].nbytes for n in states[0].sources) if states else ()
        return super().step(weight, tensors, spec, lay, target, index, kind, blocks=blocks, state_sizes=sizes)
