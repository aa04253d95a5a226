#!/usr/bin/env bash
# Install everything the tests need, start the services they use, run them, stop the services.
# Usage: bash tests/run.sh [pytest args]     (CI runs exactly this through .ci/run)
set -euo pipefail
cd "$(dirname "$0")/.."

# Python environment: the CPU build of torch where one is available, the project, MPI, test tools.
if [ ! -x .venv/bin/python ]; then python3 -m venv .venv; fi
.venv/bin/pip install -q torch==2.13.0 -e '.[mpi,test]'
export PATH="$PWD/.venv/bin:$PATH"

.venv/bin/python -m pytest -q --timeout=600 "$@"
