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
slurm_dir="" side=""
cleanup() {      # on any exit: the second pytest (below) and the Slurm test cluster stopped
    if [ -n "$side" ]; then kill "$side" 2>/dev/null || true; fi
    if [ -n "$slurm_dir" ]; then bash slurm/testcluster/stop.sh "$slurm_dir" >/dev/null 2>&1 || true; fi
}
trap cleanup EXIT
if [ "$(id -u)" -eq 0 ] && [ "${DYNARESIZE_SKIP_SLURM:-0}" != 1 ]; then
    bash slurm/testcluster/install.sh
    slurm_dir=$(mktemp -d -t dynaresize-slurm.XXXXXX)
    env_file=$(bash slurm/testcluster/start.sh "$slurm_dir" | tail -n 1)
    # shellcheck disable=SC1090
    . "$env_file"
else
    echo "tests/run.sh: not root (or DYNARESIZE_SKIP_SLURM=1): the Slurm tests will be skipped" >&2
fi

if [ $# -gt 0 ]; then      # the tests asked for, in one pytest (then `cleanup` stops Slurm)
    .venv/bin/python -m pytest -q --timeout=900 --durations=25 "$@"
    exit
fi
# Everything, in two pytests side by side, then the emulation check alone. The suite alone kept
# 1.2 of the 2 cores busy (its CPU time over its wall time, measured with every process
# accounted). The files that wait most run beside the others: Slurm's own timeouts, the watchdogs'
# and the fault tests' waits, the migration, stealing, speculation and validation tests' short
# jobs and launcher-only runs. The emulation check times real stages against their prices: beside
# another pytest its runs overran them by 20-40 % (measured), so it runs on its own.
side_files=(tests/test_slurm.py tests/test_supervision.py tests/test_faults.py tests/test_migration.py
            tests/test_stealing.py tests/test_speculation.py tests/test_validation.py)
alone=tests/test_emulation.py
side_log=$(mktemp -t dynaresize-side.XXXXXX)
.venv/bin/python -m pytest -q --timeout=900 --durations=10 "${side_files[@]}" >"$side_log" 2>&1 &
side=$!
status=0
.venv/bin/python -m pytest -q --timeout=900 --durations=25 "${side_files[@]/#/--ignore=}" --ignore="$alone" \
    || status=$?
side_status=0
wait "$side" || side_status=$?
side=""
echo "tests/run.sh: beside them, ${side_files[*]}:"
cat "$side_log"
rm -f "$side_log"
echo "tests/run.sh: then, alone, $alone:"
alone_status=0
.venv/bin/python -m pytest -q --timeout=900 "$alone" || alone_status=$?
for code in "$status" "$side_status" "$alone_status"; do
    if [ "$code" -ne 0 ]; then exit "$code"; fi
done
