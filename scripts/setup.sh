#!/usr/bin/env bash
# Install distload into the current Python environment (a venv is recommended).
#   bash scripts/setup.sh          runtime only (torch, safetensors, numpy, psutil, triton)
#   bash scripts/setup.sh --test   plus what the test suite needs (pytest, transformers, matplotlib, fastsafetensors,
#                                  boto3 and moto's S3 server for the s3:// tests)
# torch goes first: a bare `torch` requirement with no torch present pulls a multi-GB CUDA build, so
# we keep a torch that is already there, else install the pinned release (a CPU build is cached on the
# project's machines), and let everything else resolve against it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
if ! "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install -q "torch==${DISTLOAD_TORCH_VERSION:-2.13.0}"
fi
extras="triton"
if [[ "${1:-}" == "--test" ]]; then extras="triton,s3,test,bench"; fi  # bench: the bench.py smoke test
"$PY" -m pip install -q -e ".[${extras}]" 2>&1 | grep -v "is ignored: it is neither a file nor a directory" || true
"$PY" -c "import torch, distload; print(f'distload {distload.__version__} with torch {torch.__version__}')"
