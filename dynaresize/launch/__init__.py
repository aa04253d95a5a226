"""Launch: the commands that start jobs, and how the ranks of a job are started.

- cli:      the `dynaresize` command (compose the Hydra config, validate it, start the ranks)
- validate: the value checks, run here, in the launching process, before any rank starts
- local:    this machine, `mpiexec -n cluster.ranks` (the default; no Slurm, no GPU needed)
- srun:     inside a Slurm allocation (sbatch script), `srun --mpi=pmix` one task per GPU
- slurm:    submit a Slurm job through submitit and follow it
- failure:  which rank failed first, and what it was doing
- bench:    the switch benchmark (`dynaresize-bench`)
A process that is already one of several MPI ranks runs in place instead.
"""
