"""One rank of a job: `python -m dynaresize.runtime.worker RUN_DIR/config.yaml` (started by mpiexec or srun).

A failing rank prints its error and aborts the whole MPI job, so no other rank is left waiting in
a collective for it.
"""
from __future__ import annotations

import os
import sys
import traceback

from omegaconf import OmegaConf

from . import preemption
from ..config import JobConfig, parse_config


def run_rank(cfg: JobConfig) -> None:
    """Run this process as one rank of the job `cfg` (also the callable submitit ships to Slurm)."""
    preemption.install()          # first: Slurm's warning is ours from the start, not submitit's
    from .comm import ControlPlane
    from .job import Job
    from .liveness import RankLiveness
    from ..loop import run_iterations

    ctrl = ControlPlane()
    liveness = RankLiveness(cfg.run.output_dir or os.getcwd(), ctrl.rank, cfg.cluster.local_scratch).start()
    try:
        run_iterations(Job(cfg, ctrl), cfg.run.iterations, cfg.run.max_lag, cfg.eval.every)
    except preemption.RequeueLimit:
        raise                     # stopped cleanly after a checkpoint, every rank: no abort
    except BaseException as e:  # noqa: BLE001 - any failure must take the job down, not hang it
        print(f"[dynaresize] rank {ctrl.rank} failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        traceback.print_exc()
        ctrl.abort(1)
    finally:
        liveness.stop()


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        sys.exit("usage: python -m dynaresize.runtime.worker RUN_DIR/config.yaml")
    try:
        run_rank(parse_config(OmegaConf.load(argv[0])))   # validated by the launcher that wrote it
    except preemption.RequeueLimit as e:
        sys.exit(f"dynaresize: {e}")
    exit_without_teardown()


def exit_without_teardown() -> None:
    """End a rank whose run finished: the exit handlers (atexit: a pricing pool's shutdown,
    logging's flush), MPI_Finalize (mpi4py's own runs after the interpreter's teardown), then
    os._exit. The teardown it skips, freeing torch's and transformers' modules one by one, took
    2.4-2.8 s of every 4-rank launch on 2 cores (measured) with nothing left to write: Job.finish
    has closed every file and the process group."""
    import atexit
    from mpi4py import MPI
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    if MPI.Is_initialized() and not MPI.Is_finalized():
        MPI.Finalize()
    os._exit(0)


if __name__ == "__main__":
    main()
