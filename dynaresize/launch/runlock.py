"""One launcher per run directory: RUN_DIR/.lock names the launcher that owns the run.

A second launch into a run directory whose launcher still runs is refused (two jobs would write one
timeline and one set of checkpoints). A lock whose holder is gone (the launcher was killed, its node
rebooted) is taken over, saying so; so is one held by an earlier attempt of the same Slurm job (a
requeue runs on another node). The lock is a small JSON file created with O_EXCL, which works on
the shared file systems run directories live on (flock does not, on all of them).
"""
from __future__ import annotations

import json
import os
import socket
import sys
import time

from ..config import ConfigError
from ..runtime.liveness import process_alive, process_identity

LOCK_FILE = ".lock"


def _slurm_job() -> str | None:
    return os.environ.get("SLURM_JOB_ID")


class RunLock:
    def __init__(self, run_dir: str):
        self.path = os.path.join(run_dir, LOCK_FILE)
        self.mine = {"launcher": process_identity(), "slurm_job": _slurm_job(),
                     "since": time.strftime("%Y-%m-%d %H:%M:%S")}

    def acquire(self) -> None:
        """Take the lock, or raise ConfigError naming the launcher that holds it."""
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        for _ in range(3):                   # a holder that is gone is replaced; a racing launch wins or loses
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                holder = self._holder()
                if holder is not None and self._holder_runs(holder):
                    raise ConfigError(self._refusal(holder))
                self._take_over(holder)
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(self.mine, f)
            return
        raise ConfigError(f"run.output_dir: could not take {self.path}: another launch keeps taking it")

    def release(self) -> None:
        if self._holder() == self.mine:
            try:
                os.remove(self.path)
            except OSError:
                pass

    def _holder(self) -> dict | None:
        try:
            with open(self.path) as f:
                return json.load(f)
        except (OSError, ValueError):
            return None                      # vanished, or written by a launcher killed mid-write

    def _holder_runs(self, holder: dict) -> bool:
        alive = process_alive(holder["launcher"])
        if alive is not None:
            return alive
        # On another host: an earlier attempt of this Slurm job has ended (Slurm restarted the job).
        return not (holder.get("slurm_job") and holder["slurm_job"] == _slurm_job())

    def _take_over(self, holder: dict | None) -> None:
        if holder is not None:
            host, pid, _ = holder["launcher"].rsplit(":", 2)
            print(f"[dynaresize] the launcher that held {self.path} (pid {pid} on {host}, since "
                  f"{holder.get('since')}) is gone: taking the run over", file=sys.stderr, flush=True)
        if self._holder() == holder:         # not a racing launch's new lock
            try:
                os.remove(self.path)
            except FileNotFoundError:
                pass

    def _refusal(self, holder: dict) -> str:
        host, pid, _ = holder["launcher"].rsplit(":", 2)
        here = host == socket.gethostname()
        fix = (f"wait for it to end, stop it (kill {pid}), or run elsewhere with hydra.run.dir=..." if here else
               f"wait for it to end or run elsewhere with hydra.run.dir=...; if that launcher is gone "
               f"(its node was lost), remove {self.path}")
        return (f"run.output_dir: {os.path.dirname(self.path)} is in use by another launcher (pid {pid} on "
                f"{host}, since {holder.get('since')}). Fix: {fix}")
