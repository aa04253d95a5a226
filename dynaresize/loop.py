"""The recipe: one RL iteration loop over a role table that may change between iterations.

Pipeline with `run.max_lag` = L: in iteration i, rollout ranks generate batch i with the weights
they hold, and train ranks train on batch i - L. With L = 0 training waits for this iteration's
batch (synchronous); with L = 1 it trains on the batch generated in the previous iteration while
the next one is generated (one step off-policy). L is fixed for a run: the split never changes
what is computed, only where.
"""
from __future__ import annotations

from .comm import ControlPlane
from .config import JobConfig
from .job import Job


def run_job(cfg: JobConfig, ctrl: ControlPlane) -> None:
    job = Job(cfg, ctrl)                      # groups, model, roles, engine/trainer, timeline
    lag, iterations = cfg.run.max_lag, cfg.run.iterations
    ready = job.pending_batch                 # generated, not yet trained (resumed runs start with it)
    decision = job.pending_decision

    for it in range(job.first_iteration, iterations + lag):
        job.begin_iteration(it)
        if decision is not None and decision.moves:
            job.switch(it, decision)          # resize: critical operations block, the rest overlap
        generate = it if it < iterations else None
        train = it - lag if it >= lag else None

        samples = job.rollout(it, generate) if generate is not None else []
        if lag == 0:
            ready = job.exchange(it, samples)     # trainers wait for this iteration's batch
        if train is not None:
            job.train(it, ready)
        if lag == 1:
            ready = job.exchange(it, samples)     # handed over for the next iteration
        if train is not None:
            job.sync_weights(it)

        decision = job.end_iteration(it, generated=generate, trained=train)
        job.checkpoint_if_due(it, ready, decision)
        if job.end_warned:                        # Slurm ends the job soon: checkpointed just above
            job.requeue()                         # back in the queue; it resumes from the checkpoint
            return

    job.finish()
