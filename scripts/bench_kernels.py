"""Times distload's post-load kernels and reports memory throughput against the device's peak.

    python scripts/bench_kernels.py [--small] [--iters N] [--json OUT] [--peak-gbps X]

On CUDA it times the Triton kernels and, for comparison, their torch references (CUDA events). On CPU
there is no Triton path, so it times the references and says so. The kernels are memory-bound, so the
figure of merit is bytes moved per second: the bytes each kernel must read and write at least
(e.g. per-tensor quantize reads its input twice, once for amax and once to scale, and writes fp8).
"""

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

import distload.kernels as kernels

# Nominal HBM bandwidth by device name, for torch builds whose device properties lack the memory
# clock and bus width (bytes/s).
NOMINAL_PEAK = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12, "L40S": 0.864e12, "B200": 8.0e12}


def peak_bandwidth(device: torch.device) -> tuple[float | None, str]:
    """(bytes/s, where the number comes from); None on CPU."""
    if device.type != "cuda":
        return None, "unknown for CPU"
    props = torch.cuda.get_device_properties(device)
    # memory_clock_rate (kHz) and memory_bus_width (bits) exist only in some torch versions
    clock_khz = getattr(props, "memory_clock_rate", 0)
    bus_bits = getattr(props, "memory_bus_width", 0)
    if clock_khz and bus_bits:
        return 2 * clock_khz * 1e3 * bus_bits / 8, "device properties (double data rate)"
    for name, peak in NOMINAL_PEAK.items():
        if name in props.name:
            return peak, f"nominal for {name}"
    return None, f"unknown for {props.name}"


def time_call(fn: Callable[[], object], device: torch.device, iters: int) -> float:
    """Mean seconds per call after one warm-up call (which also compiles Triton kernels)."""
    fn()
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) / 1e3 / iters
    begin = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - begin) / iters


def cases(rows: int, cols: int, experts: int, device: torch.device) -> list[tuple[str, str, int, Callable, Callable]]:
    """(kernel, shape, bytes moved, Triton-dispatching call, reference call) for each kernel."""
    gen = torch.Generator(device=device).manual_seed(0)
    w = torch.randn(rows, cols, generator=gen, device=device).to(torch.bfloat16)
    w_experts = torch.randn(experts, rows // experts, cols, generator=gen, device=device).to(torch.bfloat16)
    q, scale = kernels.quantize_fp8_per_tensor_reference(w)
    q_block, scale_inv = kernels.quantize_fp8_block_reference(w)
    fused = q.clone()
    part_rows = [rows // 2, rows - rows // 2]  # gate, up
    part_scales = torch.tensor([1.0, 0.5], device=device) * scale
    n = w.numel()
    shape = f"{rows}x{cols}"
    return [
        ("fingerprint bf16", shape, 2 * n, lambda: kernels.fingerprint(w), lambda: kernels.fingerprint_reference(w)),
        ("quantize_fp8_per_tensor", shape, 5 * n,
         lambda: kernels.quantize_fp8_per_tensor(w), lambda: kernels.quantize_fp8_per_tensor_reference(w)),
        ("dequantize_fp8_per_tensor", shape, 3 * n,
         lambda: kernels.dequantize_fp8_per_tensor(q, scale),
         lambda: kernels.dequantize_fp8_per_tensor_reference(q, scale)),
        ("requantize_fp8_parts (in place)", shape, 2 * n,
         lambda: kernels.requantize_fp8_parts(fused, part_rows, part_scales),
         lambda: kernels.requantize_fp8_parts_reference(fused, part_rows, part_scales)),
        ("quantize_fp8_block 128x128", shape, 3 * n,
         lambda: kernels.quantize_fp8_block(w), lambda: kernels.quantize_fp8_block_reference(w)),
        ("dequantize_fp8_block 128x128", shape, 3 * n,
         lambda: kernels.dequantize_fp8_block(q_block, scale_inv),
         lambda: kernels.dequantize_fp8_block_reference(q_block, scale_inv)),
        ("quantize_fp8_block experts", f"{experts}x{rows // experts}x{cols}", 3 * w_experts.numel(),
         lambda: kernels.quantize_fp8_block(w_experts), lambda: kernels.quantize_fp8_block_reference(w_experts)),
        *four_bit_cases(rows, cols, device, gen),
    ]


def four_bit_cases(rows: int, cols: int, device: torch.device, gen) -> list[tuple[str, str, int, Callable, Callable]]:
    """The 4-bit dequantization kernels on random packed tensors of a [rows, cols] weight (the values do not
    change the work); bytes moved: the packed input, its scales, and the bf16 output."""
    def ints(*shape, dtype=torch.int32):
        return torch.randint(-2**31, 2**31 - 1, shape, generator=gen, device=device, dtype=torch.int64).to(dtype)

    def scales(*shape, dtype=torch.float16):
        return (torch.rand(shape, generator=gen, device=device) * 0.01 + 0.001).to(dtype)

    def u8(*shape):
        return torch.randint(0, 256, shape, generator=gen, device=device, dtype=torch.int32).to(torch.uint8)

    n, group, shape = rows * cols, 128, f"{rows}x{cols}"
    out_bytes, packed_bytes = 2 * n, n // 2
    g = cols // group
    gptq = (ints(cols // 8, rows), ints(g, rows // 8), scales(g, rows))
    g_idx = torch.arange(cols, device=device, dtype=torch.int32) // group
    awq = (ints(cols, rows // 8), ints(g, rows // 8), scales(g, rows))
    compressed = (ints(rows, cols // 8), scales(rows, g, dtype=torch.bfloat16), ints(rows // 8, g))
    nvfp4 = (u8(rows, cols // 2), scales(rows, cols // 16, dtype=torch.float32).to(torch.float8_e4m3fn),
             torch.tensor(0.5, device=device))
    mxfp4 = (u8(rows, cols // 32, 16), torch.randint(118, 130, (rows, cols // 32), generator=gen, device=device,
                                                        dtype=torch.int32).to(torch.uint8))
    nf4_map = torch.linspace(-1, 1, 16, device=device)
    nf4 = (u8(n // 2), scales(n // 64, dtype=torch.float32), nf4_map, (rows, cols))
    return [
        ("dequantize_gptq g128", shape, packed_bytes + 2 * rows * g + out_bytes,
         lambda: kernels.dequantize_gptq(*gptq, group_size=group),
         lambda: kernels.dequantize_gptq_reference(*gptq, group_size=group)),
        ("dequantize_gptq g128 desc_act", shape, packed_bytes + 2 * rows * g + 4 * cols + out_bytes,
         lambda: kernels.dequantize_gptq(*gptq, g_idx=g_idx, group_size=group),
         lambda: kernels.dequantize_gptq_reference(*gptq, g_idx=g_idx, group_size=group)),
        ("dequantize_awq g128", shape, packed_bytes + 2 * rows * g + out_bytes,
         lambda: kernels.dequantize_awq(*awq), lambda: kernels.dequantize_awq_reference(*awq)),
        ("dequantize_compressed_int4 g128", shape, packed_bytes + 2 * rows * g + out_bytes,
         lambda: kernels.dequantize_compressed_int4(*compressed),
         lambda: kernels.dequantize_compressed_int4_reference(*compressed)),
        ("dequantize_nvfp4", shape, packed_bytes + n // 16 + out_bytes,
         lambda: kernels.dequantize_nvfp4(*nvfp4), lambda: kernels.dequantize_nvfp4_reference(*nvfp4)),
        ("dequantize_mxfp4", shape, packed_bytes + n // 32 + out_bytes,
         lambda: kernels.dequantize_mxfp4(*mxfp4), lambda: kernels.dequantize_mxfp4_reference(*mxfp4)),
        ("dequantize_bnb_nf4", shape, packed_bytes + 4 * n // 64 + out_bytes,
         lambda: kernels.dequantize_bnb_4bit(*nf4), lambda: kernels.dequantize_bnb_4bit_reference(*nf4)),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="1024x1024 tensors: a quick run, e.g. on CPU")
    parser.add_argument("--iters", type=int, default=None, help="timed calls per kernel (default 20 CUDA, 3 CPU)")
    parser.add_argument("--json", metavar="OUT", type=Path, help="also write the results as JSON")
    parser.add_argument("--peak-gbps", type=float, help="peak memory bandwidth in GB/s, overriding the detected one")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    rows, cols, experts = (1024, 1024, 8) if args.small else (8192, 8192, 16)
    iters = args.iters or (20 if device.type == "cuda" else 3)
    peak, peak_source = peak_bandwidth(device)
    if args.peak_gbps:
        peak, peak_source = args.peak_gbps * 1e9, "--peak-gbps"
    triton_runs = kernels.use_triton(torch.empty(0, device=device), needs_fp8=True)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"device: {name}; peak memory bandwidth: "
          f"{f'{peak / 1e9:.0f} GB/s' if peak else 'n/a'} ({peak_source})")
    if not triton_runs:
        print("no Triton path on this device: timing the torch references (what distload runs here)")

    results = []
    print(f"{'kernel':34} {'shape':>14} {'impl':>9} {'ms':>9} {'GB/s':>8} {'% peak':>7}")
    for kernel, shape, nbytes, dispatched, reference in cases(rows, cols, experts, device):
        impls = [("triton", dispatched), ("reference", reference)] if triton_runs else [("reference", reference)]
        for impl, fn in impls:
            seconds = time_call(fn, device, iters)
            gbps = nbytes / seconds / 1e9
            fraction = nbytes / seconds / peak if peak else None
            results.append(dict(kernel=kernel, shape=shape, impl=impl, bytes_moved=nbytes, seconds=seconds,
                                gb_per_s=gbps, fraction_of_peak=fraction))
            pct = f"{100 * fraction:6.1f}%" if fraction is not None else "    n/a"
            print(f"{kernel:34} {shape:>14} {impl:>9} {seconds * 1e3:9.3f} {gbps:8.1f} {pct:>7}")

    if args.json:
        report = dict(device=name, device_type=device.type, peak_bytes_per_s=peak, peak_source=peak_source,
                      triton=triton_runs, iters=iters, torch=torch.__version__, results=results)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
