"""Explain a failed job: which rank died, and what it was doing (from its status file)."""
from __future__ import annotations

import os
import re

# How launchers report a rank that died: Open MPI's mpiexec/prterun, and srun.
DEATH_PATTERNS = (
    re.compile(r"process rank (?P<rank>\d+) with PID \d+ on node \S+ exited on signal (?P<signal>\d+)"),
    re.compile(r"srun: error: \S+: task (?P<rank>\d+): (?P<signal>[A-Z][a-z]+)"),
)


def rank_status(run_dir: str, rank: int) -> str | None:
    path = os.path.join(run_dir, ".ranks", f"rank-{rank:05d}")
    try:
        with open(path) as f:
            return f.read().strip() or None
    except OSError:
        return None


def explain_failure(output_lines: list[str], run_dir: str) -> str | None:
    """One sentence naming the rank that died and the operation it was in, if the output says."""
    text = " ".join(line.strip() for line in output_lines)     # launchers wrap their messages
    for pattern in DEATH_PATTERNS:
        m = pattern.search(text)
        if m:
            rank = int(m.group("rank"))
            doing = rank_status(run_dir, rank) or "an unknown step (no status recorded)"
            return f"rank {rank} died (signal {m.group('signal')}) during {doing}"
    return None
