"""Slurm's end-of-job warning (SIGUSR2), owned here alone.

Slurm sends SIGUSR2 to every rank `cluster.signal_delay_s` before the time limit (and on a
preemption with a grace time). submitit would answer it inside the signal handler, on rank 0
alone: call the task's `checkpoint()` and requeue at once. A DynaResize checkpoint is collective
and taken at an iteration boundary, so this handler, installed first thing in every rank
(`worker.run_rank`, replacing submitit's), only records the warning. The ranks agree on it at the
end of the iteration (`Job.end_iteration`), checkpoint together, and rank 0 requeues the job
(`requeue`, which then waits for Slurm to end the attempt). It does so at most
`cluster.max_requeues` times per submission, counted by Slurm's SLURM_RESTART_COUNT (every restart
of the job: ours, preemptions, node failures). Past the limit the job stops after its checkpoint
with `RequeueLimit`; submitting the same command again resumes.
"""
from __future__ import annotations

import os
import signal
import subprocess
import time

_warned = False


class RequeueLimit(RuntimeError):
    """The job was warned of its end after it had been restarted cluster.max_requeues times."""


def install() -> None:
    """Take SIGUSR2 in this rank, inside a Slurm job (a local run is never warned), and let SIGTERM
    end it at once."""
    if os.environ.get("SLURM_JOB_ID"):
        signal.signal(signal.SIGUSR2, _on_warning)
        # submitit "bypasses" SIGTERM (it requeues on its own signal): when Slurm ends an attempt
        # (a cancel, a lost node) the ranks would run on until SIGKILL, iterations and checkpoints
        # that the failure report and the next attempt do not expect.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _on_warning(signum, frame) -> None:
    global _warned
    _warned = True


def warned() -> bool:
    """Has Slurm warned this rank of the job's end?"""
    return _warned


def restarts() -> int:
    """How many times Slurm has restarted this job (0 on its first run)."""
    return int(os.environ.get("SLURM_RESTART_COUNT") or 0)


def requeue(max_requeues: int, checkpoint_dir: str) -> None:
    """After the checkpoint (one rank calls this): put the job back in the queue, or raise
    RequeueLimit if it has already been restarted `max_requeues` times."""
    done = restarts()
    if done >= max_requeues:
        raise RequeueLimit(
            f"Slurm warned of the job's end after {done} restart(s) (cluster.max_requeues={max_requeues}): "
            f"checkpointed ({checkpoint_dir}) and stopped instead of requeueing. "
            f"Fix: submit the same command again to resume from that checkpoint, or raise cluster.max_requeues")
    print(f"[dynaresize] Slurm warned of the job's end: checkpointed ({checkpoint_dir}); requeueing "
          f"(restart {done + 1} of at most {max_requeues})", flush=True)
    job_id = os.environ.get("SLURM_ARRAY_JOB_ID") or os.environ["SLURM_JOB_ID"]
    if os.environ.get("SLURM_ARRAY_TASK_ID"):
        job_id = f"{job_id}_{os.environ['SLURM_ARRAY_TASK_ID']}"
    subprocess.run(["scontrol", "requeue", job_id], check=True, timeout=60)
    # Slurm now ends this attempt. Returning would let the task end as a success first, and whoever
    # follows the job (submitit's result file, the sbatch script) would take it for finished.
    while True:
        time.sleep(60)
