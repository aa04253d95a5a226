"""Checkpoints for preemption and requeue (filled in with Slurm support)."""
from __future__ import annotations


def checkpoint_if_due(job, it, ready, decision) -> None:
    return None
