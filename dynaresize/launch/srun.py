"""Inside a Slurm allocation (the sbatch template): one task per GPU with srun."""
from __future__ import annotations

import os
import sys

from ..config import JobConfig
from .failure import explain_failure
from .local import run_and_watch


def launch(cfg: JobConfig, config_path: str) -> int:
    if "SLURM_JOB_ID" not in os.environ:
        print("dynaresize: cluster.launcher=srun runs inside a Slurm allocation (sbatch, salloc); "
              "use cluster=local here or cluster=slurm to submit", file=sys.stderr)
        return 2
    cmd = ["srun", f"--mpi={cfg.cluster.mpi}", f"--ntasks={cfg.cluster.ranks}", "--kill-on-bad-exit=1",
           sys.executable, "-m", "dynaresize.worker", config_path]
    env = dict(os.environ, PYTHONUNBUFFERED="1", PMIX_MCA_psec=os.environ.get("PMIX_MCA_psec", "native"))
    print(f"[dynaresize] starting {cfg.cluster.ranks} ranks in job {os.environ['SLURM_JOB_ID']}: "
          f"{' '.join(cmd)}", flush=True)
    code, lines = run_and_watch(cmd, env)
    if code != 0:
        why = explain_failure(lines, cfg.run.output_dir)
        if why:
            print(f"dynaresize: {why}", file=sys.stderr, flush=True)
    return code
