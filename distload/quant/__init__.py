"""Quantized checkpoints and online quantization: every format distload knows, one module each, one registry.

    format.py       the protocol a format implements (detect, companions and their cuts, steps, ops)
    companions.py   the tensors beside a weight, found by suffix, all parts or none
    per_part.py     per-part companions: held whole, every part's, in part order
    steps.py        the steps' shared parts: the step with its parameters, which rows are which part's
    scaled.py       the family whose weight stays X.weight, scales beside it      fp8.py  fp8_block.py  fp8_channel.py
                                                                                  int8_channel.py
    block_grid.py   block scales cut on the block grid of their weight's cut
    online.py       --quantize: a scaled format made on each rank as the weights land
    packed.py       the family of packed 4-bit tensors over a logical weight     gptq.py  awq.py  ct_int4.py
    packed_view.py  packed_cuts.py  packed_table.py  its planning view, its cuts, its table's row type
                                                                                  nvfp4.py  bnb.py  mxfp4.py
    ct_config.py    compressed-tensors' quantization_config, read for the formats that share it

`for_load(config, quantize=, dequantize=)` is the one entry: it hands build_plan the load's quantization object
(plan/quantization.py says what the plan asks of it), refusing with one message what no format loads.
`OPS`: every format's post-load ops by name, what postprocess.py runs. Adding a format: README.md, "Adding a
quantization format".
"""

from __future__ import annotations

from dataclasses import replace

from ..errors import PlanError
from ..plan.quantization import UNQUANTIZED
from . import ct_config
from .awq import Awq
from .bnb import Bnb4
from .ct_int4 import CtInt4
from .fp8 import Fp8Tensor
from .fp8_block import Fp8Block
from .fp8_channel import Fp8Channel
from .gptq import Gptq
from .int8_channel import Int8Channel
from .mxfp4 import Mxfp4
from .nvfp4 import Nvfp4
from .online import Online

FORMATS = (Fp8Tensor, Fp8Block, Fp8Channel, Int8Channel, Gptq, Awq, CtInt4, Nvfp4, Bnb4, Mxfp4)
# --quantize NAME: the scaled format made on each rank as the weights land
ONLINE = {"fp8": Fp8Tensor, "fp8-block": Fp8Block, "fp8-channel": Fp8Channel}


def _ops() -> dict:
    ops: dict = {}
    for fmt in FORMATS:
        for name, fn in fmt.OPS.items():
            if ops.setdefault(name, fn) is not fn:
                raise RuntimeError(f"post-load op {name!r} is named by two formats with different code ({fmt.name})")
    return ops


OPS = _ops()


def checkpoint_format(config: dict):
    """The format config.json's quantization_config declares (a quant.format.Format), None when there is none;
    PlanError when it names no format distload loads, listing those it does."""
    qc = config.get("quantization_config")
    if not qc:
        return None
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    where = f"config.json quantization_config (quant_method {method})"
    declared = [fmt for fmt in FORMATS if isinstance(qc, dict) and fmt.declares(qc)]
    if len(declared) != 1:
        found = ct_config.summary(qc) if method == ct_config.METHOD else "not supported"
        raise PlanError(f"{where}: {found}; distload loads {'; '.join(f.declared_by for f in FORMATS)}; "
                        f"dequantize the checkpoint first")
    return declared[0].from_config(qc, where)


def for_load(config: dict, quantize: str | None = None, dequantize: bool = False):
    """The quantization build_plan is handed for a load of a checkpoint with this config.json: the declared
    format, as stored or (--dequantize) to BF16; --quantize NAME's online quantization; UNQUANTIZED otherwise.
    The contradictions of the options with the checkpoint are refused here, once for every format."""
    declared = checkpoint_format(config)
    if quantize is not None:
        if quantize not in ONLINE:
            raise PlanError(f"--quantize {quantize!r}: choose one of {', '.join(ONLINE)}")
        if declared is not None:
            raise PlanError(f"--quantize {quantize}: the checkpoint is already quantized ({declared.label()}); "
                            f"drop --quantize")
        if dequantize:
            raise PlanError("--quantize and --dequantize contradict each other; pass one")
        return Online(ONLINE[quantize](f"--quantize {quantize}"))
    if declared is None:
        if dequantize:
            raise PlanError("--dequantize: the checkpoint is not quantized (config.json has no quantization_config); "
                            "drop --dequantize")
        return UNQUANTIZED
    return replace(declared, dequantize=True) if dequantize else declared
