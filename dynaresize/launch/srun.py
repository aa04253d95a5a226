"""Inside a Slurm allocation (the sbatch template): one task per GPU with srun."""
from __future__ import annotations

import os
import sys

from ..config import JobConfig
from .local import supervise


def launch(cfg: JobConfig, config_path: str) -> int:
    if "SLURM_JOB_ID" not in os.environ:
        print("dynaresize: cluster.launcher=srun runs inside a Slurm allocation (sbatch, salloc); "
              "use cluster=local here or cluster=slurm to submit", file=sys.stderr)
        return 2
    cmd = ["srun", f"--mpi={cfg.cluster.mpi}", f"--ntasks={cfg.cluster.ranks}", "--kill-on-bad-exit=1",
           sys.executable, "-m", "dynaresize.runtime.worker", config_path]
    env = dict(os.environ, PYTHONUNBUFFERED="1", PMIX_MCA_psec=os.environ.get("PMIX_MCA_psec", "native"))
    print(f"[dynaresize] starting {cfg.cluster.ranks} ranks in job {os.environ['SLURM_JOB_ID']}: "
          f"{' '.join(cmd)}", flush=True)
    # srun's tasks run under slurmstepd, not under this process: their order of exit is not seen here.
    return supervise(cmd, env, cfg, ranks_here=0)
