#!/usr/bin/env bash
# The vLLM stage: tests/jobs/test_vllm.py, test_vllm_oracle.py (every shipped family), test_vllm_object_store.py
# (s3:// through vLLM) and test_vllm_refit.py (a trainer job refits a running LLM, and vLLM's OpenAI server over its RL
# endpoints) against a real vLLM (its CPU build, tp 2), in a venv of its own so the main suite's environment stays as
# it is.
#   bash scripts/vllm_stage.sh [pytest args]
# The venv is the one a user gets: the README's install block ("Serving with vLLM", <!-- block: vllm-install -->),
# run as it is in a fresh copy of this checkout under ~/.cache/distload/vllm-stage (about 5.5 minutes), once per
# change of that block, of scripts/setup.sh or of pyproject's `vllm` extra (the venv keeps the stamp of what made
# it: tests/support/readme_blocks.py). Then pytest goes in, and distload is pointed (editable, no deps) at this
# checkout when the venv imports another one.
# DISTLOAD_VLLM_VENV=DIR: use the venv DIR as it is (a copy made by hand; the install-block test is then skipped).
set -uo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
if [[ -n ${DISTLOAD_VLLM_VENV:-} ]]; then
  venv=$DISTLOAD_VLLM_VENV
else
  home=${XDG_CACHE_HOME:-$HOME/.cache}/distload/vllm-stage
  venv=$home/.venv
  stamp=$(python3 tests/support/readme_blocks.py --stamp) || exit 1
  if [[ "$(cat "$venv/.distload-readme-install" 2>/dev/null)" != "$stamp" ]]; then
    echo "vllm stage: making its venv with the README's install block, in a fresh copy of this checkout ($home)"
    rm -rf "$home" && mkdir -p "$home" || exit 1
    git ls-files -z --cached --others --exclude-standard | tar --null -T - -cf - | tar -xf - -C "$home" || exit 1
    block=$(python3 tests/support/readme_blocks.py vllm-install) || exit 1
    printf '%s\n' "$block" | sed 's/^/  $ /'
    (cd "$home" && env -u VIRTUAL_ENV bash -euo pipefail -c "$block") || { echo "vllm stage: the README's install block failed"; exit 1; }
    "$venv/bin/python" -m pip install -q "pytest>=8" "moto[server]==5.2.5" || exit 1   # moto: the s3:// test's server
    echo "$stamp" > "$venv/.distload-readme-install"
  fi
fi
PY=$venv/bin/python
if [[ ! -x $PY ]]; then
  echo "vllm stage: $PY does not exist (DISTLOAD_VLLM_VENV=$venv)"; exit 1
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
  "$PY" -m pip install -q --no-deps -e . || exit 1
  here || { echo "vllm stage: $venv lacks vLLM or pytest (DISTLOAD_VLLM_VENV: a venv made by the README's block)"; exit 1; }
fi
export PYTHONSAFEPATH=1  # kernels/ would hide transformers' `kernels` (scripts/test.sh)
echo "vllm stage: venv ready in $((SECONDS - start)) s ($venv)"
"$PY" -m pytest -q -p no:cacheprovider tests/jobs/test_vllm.py tests/jobs/test_vllm_oracle.py tests/jobs/test_vllm_object_store.py \
  tests/jobs/test_vllm_refit.py "$@"
rc=$?
echo "vllm stage: $((SECONDS - start)) s in all, pytest exit $rc"
exit $rc
