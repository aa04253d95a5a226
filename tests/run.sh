#!/usr/bin/env bash
# Install everything the tests need, start the services they use, run them, stop the services.
# Usage: bash tests/run.sh [pytest args]     (CI runs exactly this through .ci/run)
set -euo pipefail
cd "$(dirname "$0")/.."

# Bytecode is compiled when a module is first imported and kept (an environment may turn that
# off): pip then need not compile every module of torch and the rest at install (half of the
# install's CPU time, measured), of which the tests import a fraction.
unset PYTHONDONTWRITEBYTECODE

# Python environment: the CPU build of torch where one is available, the project, MPI, test tools.
if [ ! -x .venv/bin/python ]; then python3 -m venv .venv; fi
# One pip at a time writes the project's build files in this tree (the vLLM stage installs it too).
flock . .venv/bin/pip install -q --no-compile torch==2.13.0 -e '.[mpi,test,docs]'
export PATH="$PWD/.venv/bin:$PATH"

# The architecture and the docs: the import layers hold, and the site builds without a warning
# (a generated reference page out of date is one).
.venv/bin/lint-imports --no-cache
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --quiet --site-dir "$(mktemp -d -t dynaresize-site.XXXXXX)"

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

# The Slurm tests mostly wait (for slurmctld, a requeue, a node to return: about 1 CPU-second in
# 4 of their wall time, measured), so they run in a pytest of their own beside the rest (exit 5:
# none among "$@"). DYNARESIZE_TEST_SHARED: the session's reference runs (tests/conftest.py), made
# once for both.
export DYNARESIZE_TEST_SHARED
DYNARESIZE_TEST_SHARED=$(mktemp -d -t dynaresize-tests.XXXXXX)
slurm_pid=""
rest="not vllm and not alone"          # without a cluster the Slurm tests are skipped there, saying why
if [ -n "$slurm_dir" ]; then
    slurm_log="$DYNARESIZE_TEST_SHARED/slurm-tests.log"
    .venv/bin/python -m pytest -q --timeout=900 --durations=10 --basetemp="$DYNARESIZE_TEST_SHARED/slurm" \
        -m "slurm and not vllm and not alone" "$@" >"$slurm_log" 2>&1 &
    slurm_pid=$!
    rest="not slurm and $rest"
fi
slurm_tests() {     # wait for the Slurm tests and print what they printed; their exit status
    [ -n "$slurm_pid" ] || return 0
    local status=0
    wait "$slurm_pid" || status=$?
    echo "tests/run.sh: the Slurm tests (beside the rest):"
    cat "$slurm_log"
    [ "$status" -eq 0 ] || [ "$status" -eq 5 ]
}

# DYNARESIZE_TEST_WORKERS pytest workers for the rest (pytest-xdist, a file each at a time; default
# 1). Two finished the main pytest in 27-31 minutes on 2 cores (one: 36-41 before the last cuts),
# but starve the vLLM stage that .ci/run runs beside at the lowest priority (one of its tests
# passed its 900 s timeout): docs/reference/tests.md. The tests marked alone compare real stage
# times with their prices, so they run afterwards by themselves (exit 5: none among "$@").
workers=${DYNARESIZE_TEST_WORKERS:-1}
parallel=()
if [ "$workers" -gt 1 ]; then parallel=(-n "$workers" --dist loadfile); fi
status=0
.venv/bin/python -m pytest -q --timeout=900 --durations=25 "${parallel[@]}" -m "$rest" "$@" || status=$?
if [ "$status" -eq 5 ]; then status=0; fi
slurm_tests || status=1
[ "$status" -eq 0 ] || exit "$status"
.venv/bin/python -m pytest -q --timeout=900 -m "alone and not vllm" "$@" || [ $? -eq 5 ]
rm -rf "$DYNARESIZE_TEST_SHARED"
