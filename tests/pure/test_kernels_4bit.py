"""kernels/int4*.py and fp4*.py: each dequantization against the independent numpy reference of its format
(tests/quant4_reference.py), bit for bit; each Triton kernel against its torch twin under TRITON_INTERPRET=1
(one subprocess on CPU) and on a GPU when there is one."""

import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import quant4_reference as ref
from distload.kernels import (
    dequantize_awq,
    dequantize_awq_reference,
    dequantize_bnb_4bit,
    dequantize_bnb_4bit_reference,
    dequantize_compressed_int4,
    dequantize_compressed_int4_reference,
    dequantize_gptq,
    dequantize_gptq_reference,
    dequantize_mxfp4,
    dequantize_mxfp4_reference,
    dequantize_nvfp4,
    dequantize_nvfp4_reference,
    undo_bnb_nested_absmax,
)

ROOT = Path(__file__).resolve().parents[2]
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1" and os.environ.get("DISTLOAD_FORCE_TRITON") == "1"
interpreted_only = pytest.mark.skipif(not INTERPRETED, reason="runs inside tests/jobs/test_interpreted_kernels.py")


def weight(out_f, in_f, seed=0):
    return np.random.default_rng(seed).standard_normal((out_f, in_f))


def t(a):
    return torch.from_numpy(np.ascontiguousarray(a))


# Each case: (name, numpy tensors, reference dequantization, distload's kernel and its twin as f(tensors, dtype)).
def _gptq(act_order):
    q = ref.gptq_quantize(weight(24, 64, 1), group=16, act_order_seed=7 if act_order else None)

    def run(fn, dtype):
        g_idx = t(q["g_idx"]) if act_order else None
        return fn(t(q["qweight"]), t(q["qzeros"]), t(q["scales"]), g_idx, group_size=16, dtype=dtype)
    return q, ref.gptq_dequantize(q), run, (dequantize_gptq, dequantize_gptq_reference)


def _awq():
    q = ref.awq_quantize(weight(32, 48, 2), group=16)
    return q, ref.awq_dequantize(q), lambda fn, dt: fn(t(q["qweight"]), t(q["qzeros"]), t(q["scales"]), dtype=dt), \
        (dequantize_awq, dequantize_awq_reference)


def _compressed(symmetric):
    q = ref.compressed_quantize(weight(16, 64, 3), group=32, symmetric=symmetric)
    zp = None if symmetric else t(q["weight_zero_point"])
    return q, ref.compressed_dequantize(q), \
        lambda fn, dt: fn(t(q["weight_packed"]), t(q["weight_scale"]), zp, dtype=dt), \
        (dequantize_compressed_int4, dequantize_compressed_int4_reference)


def _nvfp4():
    q = ref.nvfp4_quantize(weight(8, 64, 4))
    return q, ref.nvfp4_dequantize(q), \
        lambda fn, dt: fn(t(q["weight"]), t(q["weight_scale"]).to(torch.float8_e4m3fn), t(q["weight_scale_2"]),
                          dtype=dt), (dequantize_nvfp4, dequantize_nvfp4_reference)


def _mxfp4():
    q = ref.mxfp4_quantize(weight(6, 96, 5))
    return q, ref.mxfp4_dequantize(q), lambda fn, dt: fn(t(q["blocks"]), t(q["scales"]), dtype=dt), \
        (dequantize_mxfp4, dequantize_mxfp4_reference)


def _bnb(nested, shape=(12, 40)):
    q = ref.bnb_quantize(weight(*shape, 6), nested=nested)

    def run(fn, dt):
        absmax = t(ref.bnb_absmax(q)) if not nested else undo_bnb_nested_absmax(
            t(q["absmax"]), t(q["nested_quant_map"]), t(q["nested_absmax"]), float(q["offset"]))
        return fn(t(q["weight"]), absmax, t(q["quant_map"]), q["shape"], dtype=dt)
    return q, ref.bnb_dequantize(q), run, (dequantize_bnb_4bit, dequantize_bnb_4bit_reference)


CASES = {
    "gptq": lambda: _gptq(False), "gptq-act-order": lambda: _gptq(True), "awq": _awq,
    "ct-symmetric": lambda: _compressed(True), "ct-asymmetric": lambda: _compressed(False),
    "nvfp4": _nvfp4, "mxfp4": _mxfp4, "bnb-nf4": lambda: _bnb(False), "bnb-nf4-nested": lambda: _bnb(True),
    "bnb-odd-numel": lambda: _bnb(False, (7, 9)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_reference_twin_equals_independent_reference(case):
    _, expected, run, (_, twin) = CASES[case]()
    out = run(twin, torch.float32)
    assert out.shape == expected.shape
    assert torch.equal(out, t(expected.astype(np.float32))), case  # every value is exact in fp32
    assert torch.equal(run(twin, torch.bfloat16), out.to(torch.bfloat16))


@pytest.mark.parametrize("case", sorted(CASES))
def test_dispatch_on_cpu_is_the_twin(case):
    _, _, run, (kernel, twin) = CASES[case]()
    assert torch.equal(run(kernel, torch.bfloat16), run(twin, torch.bfloat16))


@pytest.mark.parametrize("case", ["gptq", "awq", "ct-asymmetric", "nvfp4", "mxfp4", "bnb-nf4"])
def test_reference_quantizer_round_trips(case):
    """The reference quantizer itself: dequantized values stay within half a step of the weight."""
    q, deq, *_ = CASES[case]()
    w = {"gptq": weight(24, 64, 1), "awq": weight(32, 48, 2), "ct-asymmetric": weight(16, 64, 3),
         "nvfp4": weight(8, 64, 4), "mxfp4": weight(6, 96, 5), "bnb-nf4": weight(12, 40, 6)}[case]
    err = np.abs(deq - w).max() / np.abs(w).max()
    assert err < 0.25, err


def test_unpack_nibble_order_of_every_layout():
    """Unit scales, zero zeros: dequantization is the unpacked code, so the nibble order shows directly."""
    codes = np.arange(8 * 16).reshape(8, 16) % 16                     # q[o, i]
    # GPTQ: word [i//8, o], nibble i%8; a stored zero 0 is z = 1 (v1 stores z - 1)
    qweight = np.zeros((2, 8), dtype=np.int64)
    for i in range(16):
        qweight[i // 8] |= codes[:, i] << (4 * (i % 8))
    out = dequantize_gptq(t(ref.as_int32(qweight)), torch.zeros(1, 1, dtype=torch.int32),
                          torch.ones(1, 8, dtype=torch.float16), group_size=-1, dtype=torch.float32)
    assert torch.equal(out, t(codes - 1.0).float())
    # AWQ: word [i, o//8], nibble k holds column AWQ_ORDER[k]
    aw = np.zeros((16, 1), dtype=np.int64)
    for k, col in enumerate(ref.AWQ_ORDER):
        aw[:, 0] |= codes[col, :] << (4 * k)
    out = dequantize_awq(t(ref.as_int32(aw)), torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, 8, dtype=torch.float16),
                         dtype=torch.float32)
    assert torch.equal(out, t(codes.astype(np.float32)))
    # NVFP4: element 2j in the low nibble; codes 0..7 are 0, .5, 1, 1.5, 2, 3, 4, 6
    packed = torch.tensor([[0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE]], dtype=torch.uint8)
    out = dequantize_nvfp4(packed, torch.ones(1, 1).to(torch.float8_e4m3fn), torch.tensor(1.0), dtype=torch.float32)
    assert out.tolist() == [[float(v) for v in ref.E2M1]]
    # bitsandbytes: the first value in the high nibble
    out = dequantize_bnb_4bit(torch.tensor([0x0F], dtype=torch.uint8), torch.ones(1), t(ref.NF4), (2,), dtype=torch.float32)
    assert out.tolist() == [-1.0, 1.0]


def test_nested_absmax_undone_like_bitsandbytes():
    q = ref.bnb_quantize(weight(40, 1000, 8), nested=True)           # 625 blocks: 3 nested blocks, a partial one
    got = undo_bnb_nested_absmax(t(q["absmax"]), t(q["nested_quant_map"]), t(q["nested_absmax"]), float(q["offset"]))
    assert torch.equal(got, t(ref.bnb_absmax(q)))
    with pytest.raises(ValueError, match="nested_absmax"):
        undo_bnb_nested_absmax(t(q["absmax"]), t(q["nested_quant_map"]), t(q["nested_absmax"][:2]), 0.0)


@pytest.mark.parametrize("call, match", [
    (lambda: dequantize_gptq(torch.zeros(2, 8, dtype=torch.int32), torch.zeros(1, 2, dtype=torch.int32),
                             torch.ones(2, 8), group_size=8), "qzeros"),
    (lambda: dequantize_awq(torch.zeros(16, 1, dtype=torch.int32), torch.zeros(1, 2, dtype=torch.int32),
                            torch.ones(1, 8)), "qzeros"),
    (lambda: dequantize_compressed_int4(torch.zeros(8, 2, dtype=torch.int32), torch.ones(8, 3)), "groups"),
    (lambda: dequantize_nvfp4(torch.zeros(4, 8, dtype=torch.uint8), torch.ones(4, 2), 1.0), "NVFP4"),
    (lambda: dequantize_mxfp4(torch.zeros(2, 3, 16, dtype=torch.uint8), torch.zeros(2, 4, dtype=torch.uint8)), "MXFP4"),
    (lambda: dequantize_bnb_4bit(torch.zeros(10, dtype=torch.uint8), torch.ones(2), t(ref.NF4), (4, 5)), "absmax"),
])
def test_wrong_shapes_are_refused(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# Triton kernels under the interpreter (one subprocess: triton must see TRITON_INTERPRET at import)


@interpreted_only
@pytest.mark.parametrize("case", sorted(CASES))
def test_interpreted_kernel_equals_twin(case):
    _, expected, run, (kernel, twin) = CASES[case]()
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(run(kernel, dtype), run(twin, dtype)), (case, dtype)
    module = "int4_triton" if case.startswith(("gptq", "awq", "ct")) else "fp4_triton"
    assert f"distload.kernels.{module}" in sys.modules  # the Triton path really ran


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("case", sorted(CASES))
def test_cuda_kernel_equals_cpu_reference(case):
    q, expected, run, (kernel, twin) = CASES[case]()
    cpu = run(twin, torch.bfloat16)
    gpu_run = _on_cuda(run)
    assert torch.equal(gpu_run(kernel, torch.bfloat16).cpu(), cpu), case


def _on_cuda(run):
    def wrapped(fn, dtype):
        return run(lambda *a, **k: fn(*[x.cuda() if isinstance(x, torch.Tensor) else x for x in a], **k), dtype)
    return wrapped
