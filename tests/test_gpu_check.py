"""The prepared GPU check (tests/gpu/check.py) keeps working where CI runs it: without CUDA, its
checks that have a CPU path run on the CPU (gloo for the 2-rank registry), so an API change in
the project breaks this test, not the next run on a GPU machine."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import ROOT, _env


def test_gpu_check_runs_its_cpu_paths(tmp_path):
    env = dict(_env(), DYNARESIZE_GPU_CHECK_DEVICE="cpu", OUT=str(tmp_path), PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "gpu", "check.py")], capture_output=True,
                          text=True, timeout=300, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = {c["check"]: c["result"] for c in json.loads((tmp_path / "gpu_check.json").read_text())["checks"]}
    assert results == {"cuda_ipc_handoff": "SKIP", "torch_engine_release_restore": "PASS",
                       "staging_from_gpu": "PASS", "trainer_step_cuda": "PASS", "nccl_registry": "PASS",
                       "bf16_matmul": "SKIP", "fsdp2_step_memory": "PASS"}, results
