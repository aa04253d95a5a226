"""A rank shows it is alive, and never outlives the launcher that owns its job.

The launcher (dynaresize.launch.local.supervise) names itself in DYNARESIZE_LAUNCHER as
"HOST:PID:START" (START: the process's start time in /proc, so a recycled pid is never taken for
it). Every rank runs one thread (`RankLiveness`) that, every BEAT_INTERVAL_S,

- touches its heartbeat file RUN_DIR/.ranks/beat-NNNNN: the launcher's stall watchdog
  (dynaresize.launch.watchdog) names a rank whose heartbeat stops (a stopped or hung process);
- on the launcher's host (where it can see the launcher's process), checks that it still runs. If it is gone (killed with SIGKILL,
  say: it could not stop the job itself), the rank removes the job's staging directory on this node
  and ends at once. mpiexec or srun then sees a rank fail and stops the rest; ranks on other nodes
  fail in their next collective with it.
"""
from __future__ import annotations

import os
import socket
import threading

from .staging import RUN_ID_ENV, job_staging_dir, remove_dir
from .status import STATUS_DIR

LAUNCHER_ENV = "DYNARESIZE_LAUNCHER"
BEAT_INTERVAL_S = 1.0
LAUNCHER_GONE_EXIT = 70            # the exit code of a rank that stopped because its launcher died


def beat_path(run_dir: str, rank: int) -> str:
    return os.path.join(run_dir, STATUS_DIR, f"beat-{rank:05d}")


def _start_time(pid: int) -> str | None:
    """The start time of process `pid` (clock ticks since boot), or None if it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(b")") + 2:].split()
    if fields[0] in (b"Z", b"X"):
        return None
    return fields[19].decode()        # field 22 of stat(5); fields here start at field 3


def process_identity(pid: int | None = None) -> str:
    """"HOST:PID:START" for process `pid` (this process by default)."""
    pid = os.getpid() if pid is None else pid
    return f"{socket.gethostname()}:{pid}:{_start_time(pid)}"


def process_alive(identity: str) -> bool | None:
    """Does the process `identity` names still run? None when it runs on another host (unknown)."""
    host, pid, start = identity.rsplit(":", 2)
    if host != socket.gethostname():
        return None
    return _start_time(int(pid)) == start


class RankLiveness:
    """The rank's heartbeat and its watch on the launcher (a daemon thread; `stop` ends it)."""

    def __init__(self, run_dir: str, rank: int, local_scratch: str | None):
        self.beat = beat_path(run_dir, rank)
        self.launcher = os.environ.get(LAUNCHER_ENV)
        if self.launcher and process_alive(self.launcher) is not True:
            # On another host, or not visible from here (a container's own pid namespace): the
            # launcher started this rank, so it runs now; this rank cannot watch it.
            self.launcher = None
        run_id = os.environ.get(RUN_ID_ENV)
        self.staging = job_staging_dir(local_scratch, run_id) if run_id else None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dynaresize-liveness", daemon=True)

    def start(self) -> "RankLiveness":
        os.makedirs(os.path.dirname(self.beat), exist_ok=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.launcher and process_alive(self.launcher) is False:
                self._launcher_gone()
            try:
                with open(self.beat, "a"):
                    pass
                os.utime(self.beat)
            except OSError:
                pass                   # a full or vanished run directory is reported elsewhere
            self._stop.wait(BEAT_INTERVAL_S)

    def _launcher_gone(self) -> None:
        # Nobody is left to read this rank's output or to clean up after it: remove what the job
        # staged on this node and end now (not an exception: the main thread may be in a collective).
        if self.staging:
            remove_dir(self.staging)
        os._exit(LAUNCHER_GONE_EXIT)
