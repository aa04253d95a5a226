"""Checkpoints for preemption and requeue, and exact resume.

A checkpoint is taken at an iteration boundary, every `run.checkpoint_every` iterations and when
Slurm warns that the job will end (SIGUSR2 `cluster.signal_delay_s` before the time limit or a
preemption). It holds everything the next iteration depends on:
- each train rank's optimizer shard (float32 master weights and AdamW moments, with the step
  count), in the staging format (HDF5, per-chunk CRC32): the full weights are their concatenation;
- rank 0's state: the last completed iteration, the role table, the policy's state, the batch
  generated but not yet trained (max_lag 1) and the decision taken for the next iteration.
No RNG state is needed: every random draw is a pure function of (seed, batch, prompt, sample).
It is written to a temporary directory and renamed when complete, so a half-written checkpoint is
never loaded. A job started on a run directory that holds one resumes from it; the timeline is cut
back to the checkpoint's iteration, so no iteration is lost or repeated there.
"""
from __future__ import annotations

import os
import pickle
import shutil
import signal
import subprocess
from dataclasses import dataclass

import numpy as np
import torch

from .flat import shard_range
from .staging import read_range, read_shard, shard_path, write_shard

CHECKPOINTS = "checkpoints"
STATE_FILE = "state.pkl"


@dataclass
class ResumeState:
    path: str
    iteration: int                 # last completed iteration
    table: object                  # RoleTable
    policy_state: dict
    pending_batch: list
    pending_decision: object


class PreemptionWatch:
    """Turns Slurm's warning signal into a request to checkpoint at the next iteration boundary."""

    def __init__(self):
        self.requested = False
        if os.environ.get("SLURM_JOB_ID"):
            signal.signal(signal.SIGUSR2, self._on_signal)

    def _on_signal(self, signum, frame):
        self.requested = True


def latest(run_dir: str) -> str | None:
    root = os.path.join(run_dir, CHECKPOINTS)
    if not os.path.isdir(root):
        return None
    done = sorted(d for d in os.listdir(root) if d.startswith("iter-"))
    return os.path.join(root, done[-1]) if done else None


def checkpoint_if_due(job, it: int, ready: list, decision, requested: bool) -> bool:
    """Write a checkpoint after iteration `it` if one is due; True if written."""
    every = job.cfg.run.checkpoint_every
    if not (requested or (every > 0 and (it + 1) % every == 0)):
        return False
    job.settle_background()
    root = os.path.join(job.run_dir, CHECKPOINTS)
    final = os.path.join(root, f"iter-{it:06d}")
    tmp = os.path.join(root, f".tmp-iter-{it:06d}")
    with job.rec.span(it + 1, "checkpoint", job.role) as ev:
        if job.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        job.ctrl.barrier()
        if job.trainer is not None:
            ev["bytes"] = write_shard(shard_path(tmp, job.table.version, job.rank), job.trainer.export_shard(),
                                      job.table.version, job.cfg.staging.buffer_mb, fsync=True)
        if job.rank == 0:
            state = {"iteration": it, "table": job.table, "policy_state": job.policy.state(),
                     "pending_batch": ready, "pending_decision": decision}
            with open(os.path.join(tmp, STATE_FILE), "wb") as f:
                pickle.dump(state, f)
                f.flush()
                os.fsync(f.fileno())
        job.ctrl.barrier()
        if job.rank == 0:
            os.replace(tmp, final)                      # complete, or not there at all
            for old in os.listdir(root):                # keep the newest only
                if old.startswith("iter-") and old < os.path.basename(final):
                    shutil.rmtree(os.path.join(root, old), ignore_errors=True)
        job.ctrl.barrier()
    return True


def find_resume(run_dir: str) -> ResumeState | None:
    path = latest(run_dir)
    if path is None:
        return None
    with open(os.path.join(path, STATE_FILE), "rb") as f:
        s = pickle.load(f)
    return ResumeState(path, s["iteration"], s["table"], s["policy_state"], s["pending_batch"],
                       s["pending_decision"])


def load_flat_params(resume: ResumeState, numel: int) -> torch.Tensor:
    """The full weights: the concatenated master copies of every train rank's shard."""
    table = resume.table
    k = table.num_train
    parts = []
    for q in range(k):
        lo, hi = shard_range(numel, k, q)
        data, _ = read_range(shard_path(resume.path, table.version, q), table.version, lo, hi)
        parts.append(data["params"])
    return torch.from_numpy(np.concatenate(parts))


def load_shard(resume: ResumeState, numel: int, index: int):
    """Train rank `index`'s shard of the checkpointed table."""
    table = resume.table
    k = table.num_train
    lo, hi = shard_range(numel, k, index)
    return read_shard(resume.path, table.version, k, numel, lo, hi, shard_range)


def requeue_slurm_job() -> None:
    """Put this Slurm job back in the queue; it resumes from the checkpoint just written."""
    job_id = os.environ.get("SLURM_ARRAY_JOB_ID") or os.environ["SLURM_JOB_ID"]
    if os.environ.get("SLURM_ARRAY_TASK_ID"):
        job_id = f"{job_id}_{os.environ['SLURM_ARRAY_TASK_ID']}"
    subprocess.run(["scontrol", "requeue", job_id], check=True, timeout=60)
