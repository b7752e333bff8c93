"""An independent, slow numpy reference of every packed 4-bit format distload loads, written from the
formats' own definitions (not from distload.kernels): a quantizer that writes the on-disk tensors of a
float weight [out, in], and a dequantizer that reads them back with explicit per-nibble loops.

    GPTQ v1 (AutoGPTQ)  qweight int32 [in/8, out]: nibble i%8 of word [i//8, o] is q[o, i]; qzeros int32
                        [G, out/8]: nibble o%8 of word [g, o//8] is z - 1; scales fp16 [G, out]; g_idx int32
                        [in] (with desc_act the groups follow a permutation of the input columns)
    AWQ (AutoAWQ GEMM)  qweight int32 [in, out/8]: nibble k of word [i, c] is q[8c + ORDER[k], i]; qzeros the
                        same along [G, out/8]; scales fp16 [G, out]; ORDER = 0 2 4 6 1 3 5 7
    compressed-tensors  weight_packed int32 [out, in/8]: nibble i%8 of word [o, i//8] is q + 8 (q signed);
    pack-quantized      weight_scale [out, G]; weight_zero_point int32 [out/8, G] (z + 8 packed down dim 0)
    NVFP4 (ModelOpt)    weight uint8 [out, in/2] (element 2j in the low nibble of byte j), e2m1 codes;
                        weight_scale fp8 e4m3 [out, in/16]; weight_scale_2 fp32 []
    MXFP4               blocks uint8 [rows, n/32, 16] low nibble first; scales uint8 E8M0 [rows, n/32]
    bitsandbytes NF4    the flat row-major weight, 64-value blocks, byte j = code[2j] << 4 | code[2j+1];
                        absmax fp32 per block, or with nested quantization uint8 codes of a 256-value map
                        times nested_absmax per 256 blocks plus an offset
Scales are chosen with few significant bits where the format allows it, so that every dequantized value is
an exact fp32 number and a kernel must match the reference bit for bit.
"""

from __future__ import annotations

import numpy as np

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float64)
NF4 = np.array([-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
                -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
                0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                0.7229568362236023, 1.0], dtype=np.float32)


def as_int32(words: np.ndarray) -> np.ndarray:
    return words.astype(np.uint32).view(np.int32)


def _nibble(words: np.ndarray, k) -> np.ndarray:
    return (words.astype(np.int64) & 0xFFFFFFFF) >> (4 * np.asarray(k)) & 15


def _few_bits(x: np.ndarray, bits: int = 8, floor: float = 1e-3) -> np.ndarray:
    """x rounded to `bits` significant bits (positive, kept away from zero: at least `floor`)."""
    m, e = np.frexp(np.maximum(x, floor))
    return np.ldexp(np.ceil(m * 2 ** bits) / 2 ** bits, e)


def _asym_int4(w: np.ndarray, groups: np.ndarray, n_groups: int):
    """Per (output row, group): scale, zero in [1, 15] and codes q in [0, 15] with w ~ (q - z) * scale."""
    out_f, in_f = w.shape
    scale = np.zeros((n_groups, out_f))
    zero = np.zeros((n_groups, out_f), dtype=np.int64)
    for g in range(n_groups):
        cols = w[:, groups == g]
        lo, hi = np.minimum(cols.min(1), 0), np.maximum(cols.max(1), 0)
        scale[g] = _few_bits((hi - lo) / 14)
        zero[g] = np.clip(np.round(-lo / scale[g]), 1, 15)
    q = np.clip(np.round(w / scale[groups].T) + zero[groups].T, 0, 15).astype(np.int64)
    return q, scale, zero


def gptq_quantize(w: np.ndarray, group: int, act_order_seed: int | None = None) -> dict:
    out_f, in_f = w.shape
    order = np.arange(in_f) if act_order_seed is None else np.random.default_rng(act_order_seed).permutation(in_f)
    g_idx = np.empty(in_f, dtype=np.int64)
    g_idx[order] = np.arange(in_f) // group
    q, scale, zero = _asym_int4(w, g_idx, in_f // group)
    qweight = np.zeros((in_f // 8, out_f), dtype=np.int64)
    for i in range(in_f):
        qweight[i // 8] |= q[:, i] << (4 * (i % 8))
    qzeros = np.zeros((in_f // group, out_f // 8), dtype=np.int64)
    for o in range(out_f):
        qzeros[:, o // 8] |= ((zero[:, o] - 1) & 15) << (4 * (o % 8))
    return {"qweight": as_int32(qweight), "qzeros": as_int32(qzeros), "scales": scale.astype(np.float16),
            "g_idx": g_idx.astype(np.int32)}


def gptq_dequantize(t: dict) -> np.ndarray:
    qweight, qzeros, scales, g_idx = t["qweight"], t["qzeros"], t["scales"].astype(np.float64), t["g_idx"]
    in_f, out_f = qweight.shape[0] * 8, qweight.shape[1]
    w = np.zeros((out_f, in_f))
    for i in range(in_f):
        g = g_idx[i]
        for o in range(out_f):
            q = _nibble(qweight[i // 8, o], i % 8)
            z = _nibble(qzeros[g, o // 8], o % 8) + 1
            w[o, i] = (q - z) * scales[g, o]
    return w


def awq_quantize(w: np.ndarray, group: int) -> dict:
    out_f, in_f = w.shape
    q, scale, zero = _asym_int4(w, np.arange(in_f) // group, in_f // group)
    qweight = np.zeros((in_f, out_f // 8), dtype=np.int64)
    qzeros = np.zeros((in_f // group, out_f // 8), dtype=np.int64)
    for c in range(out_f // 8):
        for k, col in enumerate(AWQ_ORDER):
            qweight[:, c] |= q[8 * c + col, :] << (4 * k)
            qzeros[:, c] |= zero[:, 8 * c + col] << (4 * k)
    return {"qweight": as_int32(qweight), "qzeros": as_int32(qzeros), "scales": scale.astype(np.float16)}


def awq_dequantize(t: dict) -> np.ndarray:
    qweight, qzeros, scales = t["qweight"], t["qzeros"], t["scales"].astype(np.float64)
    in_f, out_f = qweight.shape[0], qweight.shape[1] * 8
    group = in_f // scales.shape[0]
    w = np.zeros((out_f, in_f))
    for o in range(out_f):
        k = AWQ_ORDER.index(o % 8)
        for i in range(in_f):
            q = _nibble(qweight[i, o // 8], k)
            z = _nibble(qzeros[i // group, o // 8], k)
            w[o, i] = (q - z) * scales[i // group, o]
    return w


def compressed_quantize(w: np.ndarray, group: int, symmetric: bool = True) -> dict:
    out_f, in_f = w.shape
    groups = np.arange(in_f) // group
    if symmetric:
        scale = np.stack([_few_bits(np.abs(w[:, groups == g]).max(1) / 7) for g in range(in_f // group)])
        zero = np.zeros_like(scale, dtype=np.int64)
    else:
        q_u, scale, zero_u = _asym_int4(w, groups, in_f // group)
        zero = zero_u - 8
    q = np.clip(np.round(w / scale[groups].T) + zero[groups].T, -8, 7).astype(np.int64)
    packed = np.zeros((out_f, in_f // 8), dtype=np.int64)
    for i in range(in_f):
        packed[:, i // 8] |= (q[:, i] + 8) << (4 * (i % 8))
    out = {"weight_packed": as_int32(packed), "weight_scale": scale.T.astype(np.float32),
           "weight_shape": np.array([out_f, in_f], dtype=np.int64)}
    if not symmetric:
        zp = np.zeros((out_f // 8, in_f // group), dtype=np.int64)
        for o in range(out_f):
            zp[o // 8] |= (zero[:, o] + 8) << (4 * (o % 8))
        out["weight_zero_point"] = as_int32(zp)
    return out


def compressed_dequantize(t: dict) -> np.ndarray:
    packed, scale = t["weight_packed"], t["weight_scale"].astype(np.float64)
    out_f, in_f = packed.shape[0], packed.shape[1] * 8
    group = in_f // scale.shape[1]
    zp = t.get("weight_zero_point")
    w = np.zeros((out_f, in_f))
    for o in range(out_f):
        for i in range(in_f):
            q = _nibble(packed[o, i // 8], i % 8) - 8
            z = 0 if zp is None else _nibble(zp[o // 8, i // group], o % 8) - 8
            w[o, i] = (q - z) * scale[o, i // group]
    return w


def _e2m1_codes(x: np.ndarray) -> np.ndarray:
    """The nearest e2m1 code of each value (ties to the lower magnitude; sign kept)."""
    mags = E2M1[:8]
    code = np.abs(np.abs(x)[..., None] - mags).argmin(-1)
    return np.where((x < 0) & (code > 0), code + 8, code)


def fp8_e4m3_values() -> np.ndarray:
    """Every finite positive e4m3fn value, from the bit layout (1 sign, 4 exponent bits bias 7, 3 mantissa)."""
    out = [m / 8 * 2 ** -6 for m in range(1, 8)]
    out += [(1 + m / 8) * 2 ** (e - 7) for e in range(1, 16) for m in range(8) if not (e == 15 and m == 7)]
    return np.array(out)


def nvfp4_quantize(w: np.ndarray) -> dict:
    out_f, in_f = w.shape
    # ModelOpt's global scale, amax / (6 * 448): a tiny model's (amax ~0.1) is far below the int4 scales' floor,
    # which would give every part the same one
    scale_2 = float(_few_bits(np.array(np.abs(w).max() / (6 * 448)), 12, floor=1e-12))
    blocks = np.abs(w).reshape(out_f, in_f // 16, 16).max(-1) / 6 / scale_2
    e4m3 = fp8_e4m3_values()
    scale = e4m3[np.abs(blocks[..., None] - e4m3).argmin(-1)]
    codes = _e2m1_codes(w / np.repeat(scale * scale_2, 16, axis=1))
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    return {"weight": packed, "weight_scale": scale.astype(np.float32), "weight_scale_2": np.float32(scale_2)}


def nvfp4_dequantize(t: dict) -> np.ndarray:
    packed, scale, scale_2 = t["weight"], t["weight_scale"].astype(np.float64), float(t["weight_scale_2"])
    out_f, in_f = packed.shape[0], packed.shape[1] * 2
    w = np.zeros((out_f, in_f))
    for o in range(out_f):
        for i in range(in_f):
            byte = int(packed[o, i // 2])
            code = byte & 15 if i % 2 == 0 else byte >> 4
            w[o, i] = E2M1[code] * scale[o, i // 16] * scale_2
    return w


def mxfp4_quantize(w: np.ndarray) -> dict:
    rows, n = w.shape
    blocks = w.reshape(rows, n // 32, 32)
    exp = np.ceil(np.log2(np.maximum(np.abs(blocks).max(-1), 1e-30) / 6)).astype(np.int64)
    codes = _e2m1_codes(blocks / np.exp2(exp)[..., None])
    return {"blocks": (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8),
            "scales": (exp + 127).astype(np.uint8)}


def mxfp4_dequantize(t: dict) -> np.ndarray:
    blocks, scales = t["blocks"], t["scales"]
    rows, nb, _ = blocks.shape
    w = np.zeros((rows, nb * 32))
    for r in range(rows):
        for k in range(nb * 32):
            byte = int(blocks[r, k // 32, (k % 32) // 2])
            code = byte & 15 if k % 2 == 0 else byte >> 4
            w[r, k] = E2M1[code] * 2.0 ** (int(scales[r, k // 32]) - 127)
    return w


def dynamic_map() -> np.ndarray:
    """A sorted 256-value code book in [-1, 1] for the nested absmax (stored in the checkpoint, so any works)."""
    return np.sort(np.concatenate([np.linspace(-1, 1, 255), [0.0]])).astype(np.float32)


def bnb_quantize(w: np.ndarray, nested: bool = False) -> dict:
    flat = w.astype(np.float32).reshape(-1)
    n = flat.size
    nblocks = -(-n // 64)
    padded = np.zeros(nblocks * 64, dtype=np.float32)
    padded[:n] = flat
    absmax = np.abs(padded.reshape(nblocks, 64)).max(1).astype(np.float32)
    absmax = np.where(absmax == 0, np.float32(1), absmax)
    norm = padded / np.repeat(absmax, 64)
    codes = np.abs(norm[:, None] - NF4[None, :]).argmin(1)[:n]
    codes = np.concatenate([codes, [0]]) if n % 2 else codes
    out = {"weight": ((codes[0::2] << 4) | codes[1::2]).astype(np.uint8).reshape(-1, 1), "quant_map": NF4.copy(),
           "shape": tuple(w.shape)}
    if not nested:
        out["absmax"] = absmax
        return out
    offset = np.float32(absmax.mean())
    centred = (absmax - offset).astype(np.float32)
    n2 = -(-nblocks // 256)
    nested_absmax = np.array([np.abs(centred[b * 256:(b + 1) * 256]).max() for b in range(n2)], dtype=np.float32)
    book = dynamic_map()
    scaled = centred / np.repeat(nested_absmax, 256)[:nblocks]
    out.update(absmax=np.abs(scaled[:, None] - book[None, :]).argmin(1).astype(np.uint8),
               nested_absmax=nested_absmax, nested_quant_map=book, offset=offset)
    return out


def bnb_absmax(t: dict) -> np.ndarray:
    """The fp32 absmax, undoing nested quantization: book[code] * nested_absmax[b // 256] + offset, in fp32."""
    if "nested_absmax" not in t:
        return t["absmax"].astype(np.float32)
    codes = t["absmax"].astype(np.int64)
    out = np.empty(codes.size, dtype=np.float32)
    for b, c in enumerate(codes):
        out[b] = np.float32(t["nested_quant_map"][c] * t["nested_absmax"][b // 256]) + t["offset"]
    return out


def bnb_dequantize(t: dict) -> np.ndarray:
    """fp32 values (code book value x absmax rounded once in fp32), in the weight's shape."""
    absmax, packed, table = bnb_absmax(t), t["weight"].reshape(-1).astype(np.int64), t["quant_map"].astype(np.float32)
    n = int(np.prod(t["shape"]))
    codes = np.empty(packed.size * 2, dtype=np.int64)
    codes[0::2], codes[1::2] = packed >> 4, packed & 15      # the first value in the high nibble
    values = table[codes[:n]] * np.repeat(absmax, 64)[:n]
    return values.astype(np.float32).reshape(t["shape"])
