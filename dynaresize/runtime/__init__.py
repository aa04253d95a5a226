"""The rank's runtime: what one process of a running job does (needs torch and MPI).

`worker` is the rank's entry point; `job.Job` does the real work of each stage of the recipe
(dynaresize.loop): the rollout engines (`rollout/`), the trainer, the control and data planes
(`comm`), the pre-created groups (`groups`), the switch executed (`resize`), state staging and
checkpoints, the rank's status file, Slurm's warning signal and the per-iteration metrics loggers.
"""
