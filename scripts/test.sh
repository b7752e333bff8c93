#!/usr/bin/env bash
# Install distload with its test dependencies and run the tests.
#   bash scripts/test.sh            the whole suite (what CI runs), then the vLLM stage (scripts/vllm_stage.sh:
#                                   real vLLM CPU at tp 2, in a venv of its own; DISTLOAD_VLLM_STAGE=0 skips it)
#   bash scripts/test.sh --fast     only the pure tests (tests/pure/: no process, no transformers model); installs
#                                   (distload and pytest only: scripts/setup.sh --fast) only when distload is not
#                                   importable from this checkout yet
# Further arguments go to pytest.
set -uo pipefail
cd "$(dirname "$0")/.."
select=()
if [[ "${1:-}" == "--fast" ]]; then
  shift
  select=(tests/pure)
fi
installed_here() {  # distload importable from this checkout (and, with "pytest", pytest too)
  python - "$@" <<'PY' 2>/dev/null
import importlib.util, pathlib, sys
spec = importlib.util.find_spec("distload")  # finds without importing: the check costs no torch import
here = spec is not None and pathlib.Path(spec.origin).resolve().parent == pathlib.Path("distload").resolve()
sys.exit(0 if here and (sys.argv[1:] != ["pytest"] or importlib.util.find_spec("pytest")) else 1)
PY
}
if [[ ${#select[@]} -eq 0 ]]; then
  echo "test.sh: installing distload from this checkout with what the whole suite needs (scripts/setup.sh --test)"
  bash scripts/setup.sh --test || exit 1
elif ! installed_here; then
  echo "test.sh: first run here: installing distload from this checkout and pytest (scripts/setup.sh --fast)"
  bash scripts/setup.sh --fast || exit 1
elif ! installed_here pytest; then  # after the README's first command: distload is there, pytest is not
  echo "test.sh: installing pytest (the pure tests need nothing else)"
  python -m pip install -q "pytest>=8" 2>&1 | grep -v "is ignored: it is neither a file nor a directory" || true
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# The checkout's own folder off sys.path (here and in every process the tests start): its top-level kernels/
# would hide the `kernels` distribution that transformers (5.x) imports when it is installed.
export PYTHONSAFEPATH=1
python -m pytest -q "${select[@]:-tests}" "$@"
rc=$?
if [[ $rc -eq 5 ]]; then echo "pytest collected no tests"; exit 1; fi
if [[ $rc -ne 0 || ${#select[@]} -ne 0 || $# -ne 0 || "${DISTLOAD_VLLM_STAGE:-1}" == "0" ]]; then
  exit $rc  # the vLLM stage runs after a whole, green suite only
fi
bash scripts/vllm_stage.sh
