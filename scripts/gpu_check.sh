#!/usr/bin/env bash
# The device checks in one run, for a task lent a GPU (the `device` tool: one H200, ~15 min of device time in
# all, nothing fetchable there; its python3 holds torch, triton, safetensors, transformers, pytest):
#   run(command="bash scripts/gpu_check.sh", timeout_s=540)   -> logs and JSON under $OUT
# 1. the kernel tests on CUDA (the Triton-vs-reference bit-equality tests that skip on CPU),
# 2. scripts/bench_kernels.py (GB/s of each kernel vs the device's peak),
# 3. scripts/bench.py --device cuda: distload vs every-rank-reads at 1 rank, params on the GPU, with the
#    storage and pinned-H2D bandwidth it is set against, and a 1-rank `torchrun -m distload load` on CUDA.
# Written on a CPU-only machine: the CUDA paths it drives have not run yet; read its output before trusting it.
set -uo pipefail
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
REPO=$(cd "$(dirname "$0")/.." && pwd)
nvidia-smi 2>&1 | tee "$OUT/nvidia-smi.txt" | head -15
python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'triton', triton.__version__)"
# distload itself, without dependencies (they are in the image), outside the tree so ./distload does not shadow it
python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /tmp/distload-site "$REPO" \
    || { echo "install failed"; exit 1; }
export PYTHONPATH=/tmp/distload-site
cd /tmp
step() { echo "== $1"; shift; timeout "$@"; echo "== rc=$?"; }
step "kernel tests on CUDA" 240 python3 -m pytest -q -p no:cacheprovider "$REPO/tests/test_kernels.py" 2>&1 \
    | tee "$OUT/test_kernels.txt" | tail -15
step "kernel benchmarks" 120 python3 "$REPO/scripts/bench_kernels.py" --json "$OUT/kernels.json" 2>&1 \
    | tee "$OUT/bench_kernels.txt" | tail -20
step "load bench on CUDA (1 rank)" 240 python3 "$REPO/scripts/bench.py" --device cuda --reps 3 --size-gib 2 \
    --workdir /tmp/distload-bench --out "$OUT/bench" 2>&1 | tee "$OUT/bench.txt" | tail -25
step "torchrun load on CUDA" 60 torchrun --standalone --nproc-per-node 1 -m distload load \
    /tmp/distload-bench/llama-2048mib-4files --report "$OUT/report-cuda.json" 2>&1 | tail -5
