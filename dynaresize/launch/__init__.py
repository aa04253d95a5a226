"""Launchers: how the ranks of a job are started. One small module per backend.

- local: this machine, `mpiexec -n cluster.ranks` (the default; no Slurm, no GPU needed)
- srun:  inside a Slurm allocation (sbatch script), `srun --mpi=pmix` one task per GPU
- slurm: submit a Slurm job through submitit and follow it
A process that is already one of several MPI ranks runs in place instead.
"""
