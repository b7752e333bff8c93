"""kernels/: each reference against an independent plain computation; each Triton kernel against its
reference (under TRITON_INTERPRET=1 in one subprocess on CPU, bit-exact on a GPU when there is one)."""

import importlib
import itertools
import os
import sys
from pathlib import Path

import pytest
import torch

from distload.kernels import (
    FP8_DTYPE,
    block_scale_shape,
    dequantize_fp8_block,
    dequantize_fp8_block_reference,
    dequantize_fp8_per_tensor,
    dequantize_fp8_per_tensor_reference,
    fingerprint,
    fingerprint_reference,
    fingerprints,
    quantize_fp8_block,
    quantize_fp8_block_reference,
    quantize_fp8_per_tensor,
    quantize_fp8_per_tensor_reference,
    requantize_fp8_parts,
    requantize_fp8_parts_reference,
)
from distload.kernels.fp8_format import saturating_cast_to_fp8

ROOT = Path(__file__).resolve().parents[2]
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1" and os.environ.get("DISTLOAD_FORCE_TRITON") == "1"
interpreted_only = pytest.mark.skipif(
    not INTERPRETED, reason="runs inside tests/jobs/test_interpreted_kernels.py"
)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="exact Triton checks need a GPU")

# Odd shapes on purpose: tails shorter than a word, partial tiles, partial FP8 blocks.
ODD_SHAPES = [(1,), (7,), (37, 29), (130, 250), (3, 65, 129)]


def rand(shape, dtype=torch.float32, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(dtype)


def bits(t: torch.Tensor) -> torch.Tensor:
    """Raw bytes, so fp8 tensors (no torch.equal for them everywhere) and NaNs compare exactly."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def assert_bit_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, a.shape, b.dtype, b.shape)
    mismatches = (bits(a.cpu()) != bits(b.cpu())).sum().item()
    assert mismatches == 0, f"{mismatches} bytes differ"


def fp8_half_ulp(v: torch.Tensor) -> torch.Tensor:
    """Half the e4m3 spacing around |v| (float64): 2**(e-3) for normals, 2**-9 below 2**-6."""
    magnitude = v.abs().clamp(min=2.0**-6)
    return torch.exp2(torch.floor(torch.log2(magnitude)) - 3) / 2


def assert_nearest_fp8(q: torch.Tensor, exact: torch.Tensor) -> None:
    """Every q is an fp8 value nearest to the float64 `exact` (no tie-breaking claim: independent check)."""
    err = (q.double() - exact).abs()
    assert bool((err <= fp8_half_ulp(exact) * (1 + 1e-6)).all()), float((err / fp8_half_ulp(exact)).max())


def rel_frobenius(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


# ---------------------------------------------------------------------------------------------------
# fingerprint
# ---------------------------------------------------------------------------------------------------

_M64 = (1 << 64) - 1


def python_fingerprint(data: bytes) -> list[int]:
    """The documented hash in Python integers (the spec the torch and Triton code must meet)."""

    def splitmix64(s):
        z = ((s ^ (s >> 30)) * 0xBF58476D1CE4E5B9) & _M64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
        return z ^ (z >> 31)

    def fmix64(s):
        z = ((s ^ (s >> 33)) * 0xFF51AFD7ED558CCD) & _M64
        z = ((z ^ (z >> 33)) * 0xC4CEB9FE1A85EC53) & _M64
        return z ^ (z >> 33)

    padded = data + b"\0" * (-len(data) % 4)
    h1 = h2 = 0
    for i in range(len(padded) // 4):
        state = (int.from_bytes(padded[4 * i : 4 * i + 4], "little") + (i + 1) * 0x9E3779B97F4A7C15) & _M64
        h1 += splitmix64(state)
        h2 += fmix64(state)
    length = len(data) ^ 0x6A09E667F3BCC909
    h1 += splitmix64(length)
    h2 += fmix64(length)
    return [v - (1 << 64) if v >= 1 << 63 else v for v in (h1 & _M64, h2 & _M64)]


FINGERPRINT_CASES = {
    "bf16": rand((37, 29), torch.bfloat16),
    "fp16_odd": rand((7,), torch.float16),
    "fp32": rand((5, 3)),
    "fp8": rand((11,), FP8_DTYPE, scale=30.0),
    "bool": torch.tensor([True, False, True, True, False]),
    "int8": torch.arange(-5, 8, dtype=torch.int8),
    "int64": torch.arange(9, dtype=torch.int64) * (1 << 40),
    "empty": torch.empty(0, 4),
    "scalar": torch.tensor(2.5),
}


@pytest.mark.parametrize("name", sorted(FINGERPRINT_CASES))
def test_fingerprint_reference_matches_python_spec(name):
    t = FINGERPRINT_CASES[name]
    fp = fingerprint_reference(t)
    assert fp.dtype == torch.int64 and fp.shape == (2,) and fp.device.type == "cpu"
    assert fp.tolist() == python_fingerprint(bits(t).numpy().tobytes())
    assert torch.equal(fingerprint(t), fp)  # CPU dispatch is the reference


def test_fingerprints_of_many_tensors_are_each_ones_fingerprint():
    # the batched pass (small CPU tensors of whole words) and the one-by-one path (odd byte counts, empty,
    # large, strided) in one list, in the caller's order; the words hold both signs and full-range values
    tensors = [*FINGERPRINT_CASES.values(), torch.randint(-2**31, 2**31 - 1, (4097,), dtype=torch.int32),
               rand((64, 48), torch.bfloat16)[:, 5:17], rand((300_000,)), rand((2048,), torch.bfloat16)]
    got = fingerprints(tensors)
    assert len(got) == len(tensors)
    for t, fp in zip(tensors, got):
        assert fp.tolist() == python_fingerprint(bits(t.contiguous()).numpy().tobytes())
    # the same tensor gives the same value wherever it sits in a batch; one changed bit changes only its own
    a, b = rand((512,), torch.bfloat16), rand((512,), torch.bfloat16)
    b2 = b.clone()
    bits(b2)[100] ^= 1
    first, second = fingerprints([a, b]), fingerprints([b, a, b2])
    assert torch.equal(first[0], second[1]) and torch.equal(first[1], second[0])
    assert not torch.equal(second[2], second[0])


@pytest.mark.parametrize("dtype", [torch.bfloat16, FP8_DTYPE, torch.int8, torch.bool, torch.float32])
def test_fingerprint_detects_every_single_change_and_swap(dtype):
    base = torch.arange(1, 24).to(dtype) if dtype != torch.bool else torch.arange(23) % 3 == 0
    seen = {tuple(fingerprint(base).tolist())}
    changed = []
    for i in range(base.numel()):  # every position, incl. the zero-padded tail word
        t = base.clone()
        bits(t)[i * t.element_size()] ^= 1  # flip the lowest bit of element i (True <-> False for bool)
        changed.append(tuple(fingerprint(t).tolist()))
    swapped = []
    for i, j in itertools.combinations(range(base.numel()), 2):
        if bits(base[i : i + 1]).tolist() != bits(base[j : j + 1]).tolist():
            t = base.clone()
            t[i], t[j] = base[j], base[i]
            swapped.append(tuple(fingerprint(t).tolist()))
    everything = list(seen) + changed + swapped
    assert len(set(everything)) == len(everything)


def test_fingerprint_depends_on_values_not_layout_and_counts_bytes():
    t = rand((6, 10))
    assert torch.equal(fingerprint(t.t()), fingerprint(t.t().contiguous()))
    odd_start = torch.arange(20, dtype=torch.int8)[3:]  # storage offset not a multiple of 4
    assert torch.equal(fingerprint(odd_start), fingerprint(odd_start.clone()))
    a, b = torch.tensor([1, 2, 3], dtype=torch.int8), torch.tensor([1, 2, 3, 0], dtype=torch.int8)
    assert not torch.equal(fingerprint(a), fingerprint(b))  # padding is not data


def test_fingerprint_reference_chunking_is_invisible(monkeypatch):
    fingerprint_module = importlib.import_module("distload.kernels.fingerprint")  # the package exports the function

    t = rand((1001,), torch.bfloat16)
    whole = fingerprint_reference(t)
    monkeypatch.setattr(fingerprint_module, "REFERENCE_CHUNK_WORDS", 7)
    assert torch.equal(fingerprint_reference(t), whole)


# ---------------------------------------------------------------------------------------------------
# per-tensor FP8
# ---------------------------------------------------------------------------------------------------


def test_saturating_cast_rounds_to_nearest_even_and_saturates():
    x = torch.tensor([1.0625, 1.1875, 500.0, -1e9, 464.0, 440.0, float("inf"), 2.0**-10, 3 * 2.0**-10])
    expected = [1.0, 1.25, 448.0, -448.0, 448.0, 448.0, 448.0, 0.0, 2.0**-8]
    assert saturating_cast_to_fp8(x).float().tolist() == expected
    assert saturating_cast_to_fp8(torch.tensor([float("nan")])).float().isnan().all()


@pytest.mark.parametrize("shape", ODD_SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quantize_per_tensor_reference_against_float64(shape, dtype):
    w = rand(shape, dtype, seed=len(shape))
    q, scale = quantize_fp8_per_tensor_reference(w)
    assert q.dtype == FP8_DTYPE and q.shape == w.shape and scale.dtype == torch.float32 and scale.dim() == 0
    amax = w.double().abs().max()
    assert float(scale) == pytest.approx(float(amax / 448), rel=1e-7)
    assert float(q.float().abs().max()) == 448.0  # the largest element lands on the top of the range
    assert_nearest_fp8(q, w.double() / scale.double())
    assert rel_frobenius(dequantize_fp8_per_tensor_reference(q, scale, torch.float32), w) < 0.045


def test_quantize_per_tensor_zero_empty_and_scalar():
    q, scale = quantize_fp8_per_tensor_reference(torch.zeros(4, 5))
    assert float(scale) == 1.0 and not q.float().any()
    q, scale = quantize_fp8_per_tensor_reference(torch.empty(0, 3))
    assert q.shape == (0, 3) and float(scale) == 1.0
    q, scale = quantize_fp8_per_tensor_reference(torch.tensor(-3.0))
    assert q.shape == () and float(q.float() * scale) == -3.0
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        quantize_fp8_per_tensor_reference(torch.zeros(2, dtype=FP8_DTYPE))


def test_dequantize_per_tensor_reference_is_one_rounding_of_the_exact_product():
    q = rand((37, 29), FP8_DTYPE, scale=40.0)
    scale = torch.tensor(0.0123, dtype=torch.float32)
    exact = q.double() * scale.double()  # exact: 4 significant bits times 24
    assert torch.equal(dequantize_fp8_per_tensor_reference(q, scale, torch.float32), exact.float())
    assert torch.equal(dequantize_fp8_per_tensor_reference(q, float(scale)), exact.float().bfloat16())
    with pytest.raises(ValueError, match="one value"):
        dequantize_fp8_per_tensor_reference(q, torch.ones(2))


def fused_fp8_param(part_rows, cols, magnitudes, seed=0):
    """A fused weight as a per-tensor FP8 checkpoint stores it: each part quantized with its own scale."""
    originals, parts, scales = [], [], []
    for i, (rows, magnitude) in enumerate(zip(part_rows, magnitudes)):
        w = rand((rows, cols), seed=seed + i, scale=magnitude)
        q, s = quantize_fp8_per_tensor_reference(w)
        originals.append(w)
        parts.append(q)
        scales.append(s)
    return torch.cat(originals), torch.cat(parts), torch.stack(scales)


def test_requantize_parts_reference_against_float64_and_original():
    part_rows = [48, 16, 16]  # q, k, v
    original, weight, scales = fused_fp8_param(part_rows, 33, magnitudes=[1.0, 5.0, 0.2])
    before = weight.clone()
    out, scale = requantize_fp8_parts_reference(weight, part_rows, scales)
    assert out.data_ptr() == weight.data_ptr()  # rewritten in place
    assert scale.dim() == 0 and float(scale) == float(scales.max())
    row_scales = scales.double().repeat_interleave(torch.tensor(part_rows))[:, None]
    assert_nearest_fp8(out, before.double() * row_scales / scale.double())
    assert_bit_equal(out[48:64], before[48:64])  # the part that owns the max scale is untouched
    dequantized = dequantize_fp8_per_tensor_reference(out, scale, torch.float32)
    assert rel_frobenius(dequantized, original) < 0.08


def test_requantize_parts_rewrites_a_parameter_in_place():
    _, weight, scales = fused_fp8_param([4, 4], 8, magnitudes=[1.0, 2.0])
    param = torch.nn.Parameter(weight.clone())  # requires grad: the kernels run under no_grad
    out, _ = requantize_fp8_parts(param, [4, 4], scales)
    assert out is param
    assert_bit_equal(param.data, requantize_fp8_parts_reference(weight, [4, 4], scales)[0])


def test_requantize_parts_validates_layout():
    weight = torch.zeros(10, 4, dtype=FP8_DTYPE)
    with pytest.raises(ValueError, match="sum to 9"):
        requantize_fp8_parts_reference(weight, [4, 5], torch.ones(2))
    with pytest.raises(ValueError, match="one scale per logical part"):
        requantize_fp8_parts_reference(weight, [5, 5], torch.ones(3))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        requantize_fp8_parts_reference(weight.float(), [5, 5], torch.ones(2))


# ---------------------------------------------------------------------------------------------------
# block FP8
# ---------------------------------------------------------------------------------------------------


def blockwise_float64(w: torch.Tensor, block):
    """Independent block quantization: a plain loop over blocks in float64 (exact scale, exact quotient)."""
    bn, bk = block
    n, k = w.shape
    scales = torch.empty(block_scale_shape(w.shape, block), dtype=torch.float64)
    quotients = torch.empty(w.shape, dtype=torch.float64)
    for i, j in itertools.product(range(scales.shape[0]), range(scales.shape[1])):
        tile = w[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk].double()
        amax = tile.abs().max()
        scales[i, j] = amax / 448 if amax > 0 else 1.0
        quotients[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk] = tile / scales[i, j]
    return quotients, scales


@pytest.mark.parametrize(
    "shape, block", [((130, 250), (128, 128)), ((37, 29), (16, 8)), ((64, 128), (64, 64)), ((50, 70), (24, 40))]
)
def test_block_quantize_reference_against_float64_loop(shape, block):
    w = rand(shape, torch.bfloat16, seed=shape[0])
    w[: block[0], : block[1]] = 0  # an all-zero block gets scale 1
    q, scale_inv = quantize_fp8_block_reference(w, block)
    quotients, scales = blockwise_float64(w, block)
    assert scale_inv.dtype == torch.float32 and scale_inv.shape == scales.shape
    assert torch.allclose(scale_inv.double(), scales, rtol=1e-7, atol=0)
    assert float(scale_inv[0, 0]) == 1.0
    assert_nearest_fp8(q, quotients)
    deq = dequantize_fp8_block_reference(q, scale_inv, block, torch.float32)
    bn, bk = block
    per_element = scale_inv.double().repeat_interleave(bn, 0)[: shape[0]].repeat_interleave(bk, 1)[:, : shape[1]]
    assert torch.equal(deq, (q.double() * per_element).float())  # the product is exact in float64
    assert rel_frobenius(deq, w.float()) < 0.045


def test_block_fp8_expert_stacked_equals_per_expert():
    w = rand((3, 130, 70), torch.bfloat16)
    q, scale_inv = quantize_fp8_block_reference(w, (64, 32))
    assert scale_inv.shape == (3, 3, 3)
    for e in range(3):
        q_e, s_e = quantize_fp8_block_reference(w[e], (64, 32))
        assert_bit_equal(q[e], q_e)
        assert torch.equal(scale_inv[e], s_e)
    deq = dequantize_fp8_block_reference(q, scale_inv, (64, 32))
    assert deq.dtype == torch.bfloat16 and deq.shape == w.shape
    assert torch.equal(deq[1], dequantize_fp8_block_reference(q[1], scale_inv[1], (64, 32)))


def test_block_dequantize_rejects_a_wrong_scale_shape():
    q = torch.zeros(130, 250, dtype=FP8_DTYPE)
    with pytest.raises(ValueError, match=r"needs scale_inv of shape \(2, 2\)"):
        dequantize_fp8_block_reference(q, torch.ones(1, 2), (128, 128))
    with pytest.raises(ValueError, match="positive"):
        quantize_fp8_block_reference(torch.zeros(4, 4), (0, 128))


# ---------------------------------------------------------------------------------------------------
# Triton kernels under the interpreter (one subprocess: triton must see TRITON_INTERPRET at import)
# ---------------------------------------------------------------------------------------------------


@interpreted_only
def test_interpreted_fingerprint():
    odd_start = torch.arange(20, dtype=torch.int8)[3:]
    for t in [*FINGERPRINT_CASES.values(), rand((5000,), torch.bfloat16), rand((9, 4097), torch.int8), odd_start]:
        assert torch.equal(fingerprint(t), fingerprint_reference(t))
    assert "distload.kernels.fingerprint_triton" in sys.modules  # the Triton path really ran


@interpreted_only
@pytest.mark.parametrize("shape", ODD_SHAPES + [()])
def test_interpreted_per_tensor(shape):
    w = rand(shape, torch.bfloat16, seed=3)
    q, scale = quantize_fp8_per_tensor(w)
    q_ref, scale_ref = quantize_fp8_per_tensor_reference(w)
    assert_bit_equal(q, q_ref)
    assert torch.equal(scale, scale_ref)
    for dtype in (torch.bfloat16, torch.float32):
        expected = dequantize_fp8_per_tensor_reference(q, scale, dtype)
        assert_bit_equal(dequantize_fp8_per_tensor(q, scale, dtype), expected)
    assert "distload.kernels.fp8_triton" in sys.modules


@interpreted_only
def test_interpreted_requantize_parts():
    part_rows = [40, 9, 9]
    _, weight, scales = fused_fp8_param(part_rows, 131, magnitudes=[1.0, 4.0, 0.1])
    expected, expected_scale = requantize_fp8_parts_reference(weight.clone(), part_rows, scales)
    out, scale = requantize_fp8_parts(weight, part_rows, scales)
    assert out.data_ptr() == weight.data_ptr()
    assert_bit_equal(out, expected)
    assert torch.equal(scale, expected_scale)
    # a non-contiguous weight is rewritten through a contiguous copy
    _, weight, scales = fused_fp8_param([8, 8], 24, magnitudes=[1.0, 2.0])
    transposed = weight.t().contiguous().t()
    requantize_fp8_parts(transposed, [8, 8], scales)
    assert_bit_equal(transposed, requantize_fp8_parts_reference(weight, [8, 8], scales)[0])


@interpreted_only
def test_interpreted_saturation_and_nan():
    from distload.kernels.fp8_triton import rescale_triton

    x = torch.tensor([1.0, -1.0, 0.001, float("nan")])
    out = torch.empty(4)
    rescale_triton(x, out, div=torch.tensor([1e-6]), clamp_fp8=True)
    assert out[:3].tolist() == [448.0, -448.0, 448.0] and out[3].isnan()


@interpreted_only
@pytest.mark.parametrize("shape, block", [((130, 250), (128, 128)), ((3, 65, 129), (64, 32)), ((37, 29), (24, 40))])
def test_interpreted_block(shape, block):
    w = rand(shape, torch.bfloat16, seed=5)
    q, scale_inv = quantize_fp8_block(w, block)
    q_ref, scale_ref = quantize_fp8_block_reference(w, block)
    assert_bit_equal(q, q_ref)
    assert torch.equal(scale_inv, scale_ref)
    assert_bit_equal(dequantize_fp8_block(q, scale_inv, block), dequantize_fp8_block_reference(q, scale_inv, block))


def fp8_midpoint_weights(cols: int = 256) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(w, q, scales): w bf16 [128, cols] whose every [128, 128] block has amax 12.25 (scale 12.25 / 448 =
    7/256, not a power of two) and otherwise holds +-m * 7/256 for every midpoint m between neighbouring fp8
    values, so w / scale is exactly a tie (RNE must pick the even neighbour) and a division that is off by
    an ulp rounds the wrong way (seen on an H200: `tl.fdiv(ieee_rounding=True)`, Triton 3.6). Also a fused
    fp8 param of two parts whose requantization (part 1's scale is 3/4 of part 0's) lands on midpoints."""
    values = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).float()
    values = values[torch.isfinite(values) & (values > 0)].sort().values
    middles = (values[1:] + values[:-1]) / 2
    step = torch.tensor(7 / 256)
    ties = torch.cat([middles, -middles]) * step
    w = ties.repeat(-(-128 * cols // len(ties)))[:128 * cols].reshape(128, cols)
    w[:, ::128] = 448 * step                      # each block's amax
    assert torch.equal(w.to(torch.bfloat16).float(), w)  # every value exact in bf16
    q = torch.cat([values, -values]).repeat(-(-128 * cols // (2 * len(values))))[:128 * cols].reshape(128, cols)
    return w.to(torch.bfloat16), q.to(FP8_DTYPE), torch.stack([step, step * 0.75])


@pytest.mark.skipif(not (INTERPRETED or (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9))),
                    reason="the Triton kernels run under the interpreter (interpreted run) or on an sm89+ GPU")
def test_interpreted_and_cuda_divisions_round_ties_like_the_references():
    device = "cpu" if INTERPRETED else "cuda"
    w, q, scales = fp8_midpoint_weights()
    exact = w.double() / (7 / 256)
    assert (exact.abs() != 448).sum() > 0.9 * w.numel()  # mostly ties, not the amax itself
    q_ref, scale_ref = quantize_fp8_per_tensor_reference(w)
    assert float(scale_ref) == 7 / 256
    got, scale = quantize_fp8_per_tensor(w.to(device))
    assert_bit_equal(got, q_ref)
    assert torch.equal(scale.cpu(), scale_ref)
    q_ref, scale_ref = quantize_fp8_block_reference(w, (128, 128))
    got, scale = quantize_fp8_block(w.to(device), (128, 128))
    assert_bit_equal(got, q_ref)
    assert torch.equal(scale.cpu(), scale_ref)
    expected, expected_scale = requantize_fp8_parts_reference(q.clone(), [64, 64], scales)
    got, scale = requantize_fp8_parts(q.to(device), [64, 64], scales.to(device))
    assert_bit_equal(got, expected)
    assert torch.equal(scale.cpu(), expected_scale)


# ---------------------------------------------------------------------------------------------------
# compiled Triton on a GPU: bit-exact against the CPU references
# ---------------------------------------------------------------------------------------------------


@needs_cuda
def test_cuda_fingerprint_equals_cpu():
    for t in [*FINGERPRINT_CASES.values(), rand((4097, 513), torch.bfloat16), rand((3, 1 << 20), FP8_DTYPE)]:
        assert torch.equal(fingerprint(t.cuda()), fingerprint_reference(t))


@needs_cuda
@pytest.mark.skipif(
    torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9), reason="Triton fp8 needs sm89+"
)
def test_cuda_fp8_kernels_bit_equal_to_cpu_references():
    w = rand((1031, 2053), torch.bfloat16, seed=7)
    q, scale = quantize_fp8_per_tensor(w.cuda())
    q_ref, scale_ref = quantize_fp8_per_tensor_reference(w)
    assert_bit_equal(q, q_ref)
    assert torch.equal(scale.cpu(), scale_ref)
    assert_bit_equal(dequantize_fp8_per_tensor(q, scale), dequantize_fp8_per_tensor_reference(q_ref, scale_ref))

    part_rows = [512, 256, 263]
    _, weight, scales = fused_fp8_param(part_rows, 2053, magnitudes=[1.0, 3.0, 0.5])
    expected, expected_scale = requantize_fp8_parts_reference(weight.clone(), part_rows, scales)
    out, out_scale = requantize_fp8_parts(weight.cuda(), part_rows, scales.cuda())
    assert_bit_equal(out, expected)
    assert torch.equal(out_scale.cpu(), expected_scale)

    for shape, block in [((1031, 2053), (128, 128)), ((4, 300, 130), (128, 128)), ((257, 99), (96, 48))]:
        w = rand(shape, torch.bfloat16, seed=shape[-1])
        q, scale_inv = quantize_fp8_block(w.cuda(), block)
        q_ref, scale_ref = quantize_fp8_block_reference(w, block)
        assert_bit_equal(q, q_ref)
        assert torch.equal(scale_inv.cpu(), scale_ref)
        expected = dequantize_fp8_block_reference(q_ref, scale_ref, block)
        assert_bit_equal(dequantize_fp8_block(q, scale_inv, block), expected)
