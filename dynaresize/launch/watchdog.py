"""The stall watchdog: a job whose ranks stop making progress ends, naming the rank.

Every rank touches a heartbeat file every second (dynaresize.runtime.liveness) and rewrites its
status file whenever it starts an operation (dynaresize.runtime.status). The launcher reads both:

- a rank whose heartbeat has not moved for longer than the timeout has stopped: a process stopped
  (SIGSTOP, a debugger), frozen, or on a node that hangs. Its peers would wait in their next
  collective for it until gloo's or NCCL's own timeout (minutes), and name nobody;
- when every rank still beats but none has started a new operation for longer than the timeout,
  the job is stuck (a deadlock, a request that never returns): the rank that has been in its
  operation longest is named.

Times are the launcher's own clock when it saw a file change (not the files' mtimes), so a shared
file system's clock skew between nodes does not matter.

The timeout is `run.stall_timeout_s`, or by default STALL_FACTOR times the longest operation this
job has taken so far, and at least STALL_FLOOR_S (start-up loads models and compiles). The cost
model prices the profile's hardware, not the machine the job runs on, so the job's own history is
the better guide to how long an operation may take here. A rank still starting (no heartbeat yet,
or a start-up status) is allowed STARTUP_S at least.
"""
from __future__ import annotations

import os
import threading
import time
from typing import Callable

from ..runtime.liveness import beat_path
from ..runtime.status import FINISHED, rank_status, status_path

STALL_FLOOR_S = 600.0
STALL_FACTOR = 10.0
STARTUP_S = 600.0     # start-up (imports, model load, engine start) may take this long whatever the timeout


def _mtime(path: str) -> float | None:
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return None


class StallWatch:
    """Watch the heartbeat and status files of ranks 0..ranks-1 in `run_dir` from a thread; call
    `on_stall(message)` once if the job stalls."""

    def __init__(self, run_dir: str, ranks: int, timeout_s: float | None, on_stall: Callable[[str], None],
                 interval_s: float = 1.0):
        self.run_dir, self.ranks, self.fixed_timeout = run_dir, ranks, timeout_s
        self.on_stall, self.interval = on_stall, interval_s
        self.longest_op = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dynaresize-stall-watch", daemon=True)

    def timeout(self) -> float:
        if self.fixed_timeout is not None:
            return self.fixed_timeout
        return max(STALL_FLOOR_S, STALL_FACTOR * self.longest_op)

    def start(self) -> "StallWatch":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        start = time.monotonic()
        beat: dict[int, tuple[float | None, float]] = {}      # rank -> (mtime, when it was seen to change)
        status: dict[int, tuple[float | None, float]] = {}
        while not self._stop.wait(self.interval):
            now = time.monotonic()
            for rank in range(self.ranks):
                for files, path in ((beat, beat_path(self.run_dir, rank)),
                                    (status, status_path(self.run_dir, rank))):
                    mtime = _mtime(path)
                    seen = files.get(rank)
                    if seen is None or seen[0] != mtime:
                        if files is status and seen is not None and seen[0] is not None:
                            self.longest_op = max(self.longest_op, now - seen[1])
                        files[rank] = (mtime, now)
            message = self._stalled(beat, status, now, now - start)
            if message:
                self.on_stall(message)
                return

    def _stalled(self, beat, status, now: float, running: float) -> str | None:
        limit = self.timeout()
        if running <= limit:
            return None
        how = (f"run.stall_timeout_s={self.fixed_timeout:g}" if self.fixed_timeout is not None else
               f"the default: {STALL_FACTOR:g} x the longest operation so far, at least {STALL_FLOOR_S:g} s; "
               f"set run.stall_timeout_s to change it")

        def late(r: int, since: float) -> tuple[bool, str | None]:
            """Has rank r been silent too long (`since`: when it last changed)? And its status.
            A finished rank is never late; one still starting gets STARTUP_S at least."""
            if now - since <= limit:
                return False, None                 # the common case: no file read
            doing = rank_status(self.run_dir, r)
            if (doing or "").startswith(FINISHED):
                return False, doing
            starting = beat[r][0] is None or doing is None or "startup" in doing
            return now - since > (max(limit, STARTUP_S) if starting else limit), doing

        # A rank never seen to beat counts from the watch's start.
        for quiet, rank in sorted(((now - beat[r][1], r) for r in range(self.ranks)), reverse=True):
            is_late, doing = late(rank, beat[rank][1])
            if is_late:
                return (f"rank {rank} stopped responding: no heartbeat for {quiet:.0f} s ({how}) during "
                        f"{self._describe(doing)}; the job was stopped")
            if now - beat[rank][1] <= limit:
                break
        verdicts = {r: late(r, status[r][1]) for r in range(self.ranks)}
        if all(is_late or (doing or "").startswith(FINISHED) for is_late, doing in verdicts.values()) \
                and any(is_late for is_late, _ in verdicts.values()):
            waiting = [r for r, (is_late, _) in verdicts.items() if is_late]
            # Seen changing first; among files already there when the watch began, the older mtime.
            rank = min(waiting, key=lambda r: (status[r][1], status[r][0] or 0))
            progress = min(now - status[r][1] for r in waiting)
            return (f"no rank has started a new operation for {progress:.0f} s ({how}); rank {rank} has been "
                    f"in {self._describe(verdicts[rank][1])} longest ({now - status[rank][1]:.0f} s); the job "
                    f"was stopped")
        return None

    @staticmethod
    def _describe(status: str | None) -> str:
        return status or "start-up (no status recorded)"
