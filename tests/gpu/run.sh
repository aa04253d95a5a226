#!/usr/bin/env bash
# The prepared GPU check of dynaresize's CUDA paths (CUDA IPC weight hand-off, TorchEngine
# release/restore, HDF5 staging from the GPU, a ShardedTrainer step on NCCL, GroupRegistry over
# NCCL, bf16 matmul/copy ceilings). Not part of CI: no GPU there.
# Usage: bash tests/gpu/run.sh [CHECK ...]   on a machine with one CUDA GPU; runs in < 5 minutes.
# Needs python3 with torch (CUDA), transformers, h5py, numpy and omegaconf; the project is used in
# place (PYTHONPATH), not installed. On a machine without a package index, WHEELS=dir installs the
# wheels in dir (e.g. omegaconf, antlr4-python3-runtime) into a temporary folder first.
# Results: a table on stdout and $OUT/gpu_check.json (./gpu_check.json without $OUT).
set -uo pipefail
cd "$(dirname "$0")/../.."

EXTRA=""
if [ -n "${WHEELS:-}" ]; then
    EXTRA=$(mktemp -d)
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$EXTRA" "$WHEELS"/*.whl || exit 1
fi
if command -v nvidia-smi >/dev/null 2>&1; then nvidia-smi -L; fi
PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${EXTRA:+:$EXTRA}" python3 tests/gpu/check.py "$@"
