#!/usr/bin/env bash
# The device checks in one run, for a task lent a GPU (the `device` tool: one H200, ~15 min of device time in
# all; its python3 holds torch, triton, safetensors, transformers, pytest, but not fastsafetensors):
#   echo /.whl/ >> .git/info/exclude; pip download --no-deps ... -d .whl fastsafetensors==0.5.0  (cp312 wheel)
#   run(command="bash scripts/gpu_check.sh", carry=[".whl"], timeout_s=330)
# 1. the CUDA tests: tests/pure/test_kernels.py's compiled-Triton checks and tests/jobs/test_cuda.py (every load on the
#    GPU through NCCL bit for bit equal to the same load on the CPU; load_into, save/reload, refit, torchrun);
# 2. scripts/bench.py --device cuda: distload vs every-rank-reads and fastsafetensors
#    at 1 rank, params on the GPU, with the storage and pinned-H2D bandwidth they are set against;
# 3. scripts/bench_kernels.py: GB/s of each post-load kernel vs the device's peak.
# Everything lands in $OUT/gpu-check.tgz (re-packed after each step, so a run stopped at its limit still
# returns what finished); the last lines printed are the summary.
set -uo pipefail
OUT=${OUT:-/tmp/gpu-check}
LOGS=/tmp/gpu-check-logs
mkdir -p "$OUT" "$LOGS"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4 HF_HUB_OFFLINE=1
REPO=$(cd "$(dirname "$0")/.." && pwd)
pack() { tar czf "$OUT/gpu-check.tgz" -C "$LOGS" . 2>/dev/null; }
step() {  # step NAME SECONDS CMD...: run with a time limit, log to $LOGS/NAME.txt, print its tail
    local name=$1 limit=$2; shift 2
    echo "== $name (limit ${limit}s)"
    local t0=$SECONDS
    timeout -k 10 "$limit" "$@" > "$LOGS/$name.txt" 2>&1
    local rc=$?
    echo "== $name: rc=$rc in $((SECONDS - t0))s" | tee -a "$LOGS/steps.txt"
    tail -n 25 "$LOGS/$name.txt"
    pack
}

{
    date -u; uname -a; nproc; free -g; nvidia-smi
    echo "--- file systems"; df -h /tmp /; grep -E " / | /tmp " /proc/mounts
    echo "--- block devices"; ls /sys/block 2>&1; head -n 5 /proc/diskstats 2>&1
    python3 -c "import torch, triton, safetensors, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available(), torch.cuda.get_device_name(0), 'cc', torch.cuda.get_device_capability(0)); print('triton', triton.__version__, 'safetensors', safetensors.__version__, 'transformers', transformers.__version__)"
} > "$LOGS/env.txt" 2>&1
head -n 40 "$LOGS/env.txt"

# distload itself, editable (as tests/ and scripts/ run it from the source tree; the image has its dependencies),
# and fastsafetensors from carried wheels.
python3 -m pip install -q --no-deps --no-build-isolation -e "$REPO" > "$LOGS/install.txt" 2>&1 \
    || python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /tmp/distload-site "$REPO" \
        >> "$LOGS/install.txt" 2>&1 || { cat "$LOGS/install.txt"; echo "distload install failed"; pack; exit 1; }
[ -d /tmp/distload-site ] && export PYTHONPATH=/tmp/distload-site
if ls "$REPO"/.whl/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/wheels-site "$REPO"/.whl/*.whl \
        >> "$LOGS/install.txt" 2>&1 || echo "wheels not installed (see install.txt)"
    export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}/tmp/wheels-site
fi
cd /tmp
step tests 120 python3 -m pytest -q -p no:cacheprovider -o faulthandler_timeout=110 -rs \
    "$REPO/tests/pure/test_kernels.py" -k "cuda or gpu" "$REPO/tests/jobs/test_cuda.py"
step bench 150 python3 "$REPO/scripts/bench.py" --device cuda --reps 5 --size-gib 2 \
    --loaders distload,every-rank-reads,fastsafetensors --scenario-timeout 140 \
    --workdir /tmp/distload-bench --out "$LOGS/bench"
step kernels 30 python3 "$REPO/scripts/bench_kernels.py" --json "$LOGS/kernels.json"

echo "== summary"; cat "$LOGS/steps.txt"
cat "$LOGS"/bench/probes-*.json 2>/dev/null; echo
cat "$LOGS/bench/results.md" 2>/dev/null | head -n 30
