#!/usr/bin/env bash
# Install everything the tests need, start the services they use, run them, stop the services.
# Usage: bash tests/run.sh [pytest args]     (CI runs exactly this through .ci/run)
set -euo pipefail
cd "$(dirname "$0")/.."

# Python environment: the CPU build of torch where one is available, the project, MPI, test tools.
if [ ! -x .venv/bin/python ]; then python3 -m venv .venv; fi
.venv/bin/pip install -q torch==2.13.0 -e '.[mpi,test]'
export PATH="$PWD/.venv/bin:$PATH"

# A real two-node Slurm cluster with accounting for tests/test_slurm.py (root: daemons, namespaces).
slurm_dir=""
if [ "$(id -u)" -eq 0 ] && [ "${DYNARESIZE_SKIP_SLURM:-0}" != 1 ]; then
    bash slurm/testcluster/install.sh
    slurm_dir=$(mktemp -d -t dynaresize-slurm.XXXXXX)
    env_file=$(bash slurm/testcluster/start.sh "$slurm_dir" | tail -n 1)
    trap 'bash slurm/testcluster/stop.sh "$slurm_dir" >/dev/null 2>&1 || true' EXIT
    # shellcheck disable=SC1090
    . "$env_file"
else
    echo "tests/run.sh: not root (or DYNARESIZE_SKIP_SLURM=1): the Slurm tests will be skipped" >&2
fi

pytest=(.venv/bin/python -m pytest -q --timeout=900)
if [ $# -gt 0 ] || [ -z "$slurm_dir" ]; then
    "${pytest[@]}" --durations=25 "$@"
    exit
fi

# The whole suite in two streams: the Slurm tests (serial among themselves: they share the
# cluster's queue) beside the rest, filling the time each stream leaves a core idle (daemons,
# single-process phases). Emulation runs last, once the Slurm stream is done: its ranks sleep for
# priced durations, and their real work must fit inside them.
slurm_log=$(mktemp -t dynaresize-slurm-tests.XXXXXX)
"${pytest[@]}" --durations=10 -p no:cacheprovider tests/test_slurm.py >"$slurm_log" 2>&1 &
slurm_tests=$!
mapfile -t rest < <(ls tests/test_*.py | grep -v -e '^tests/test_slurm.py$' -e '^tests/test_emulation.py$')
main=0
"${pytest[@]}" --durations=25 "${rest[@]}" || main=$?
slurm=0
wait "$slurm_tests" || slurm=$?
"${pytest[@]}" --durations=3 tests/test_emulation.py || main=$?
echo "=== tests/test_slurm.py (run beside the others) ==="
cat "$slurm_log"
rm -f "$slurm_log"
[ "$main" -eq 0 ] && [ "$slurm" -eq 0 ]
