#!/usr/bin/env bash
# Install distload with its test dependencies and run the whole suite (what CI runs).
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test || exit 1
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
python -m pytest -q tests "$@"
rc=$?
if [[ $rc -eq 5 ]]; then echo "pytest collected no tests"; exit 1; fi
exit $rc
