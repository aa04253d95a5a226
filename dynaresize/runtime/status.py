"""Each rank's status file: one line saying what the rank is doing now.

Every rank keeps RUN_DIR/.ranks/rank-NNNNN (`Job.set_status` -> `write_status`). The file is
replaced atomically (written to a temporary file in the same directory, then `os.replace`d over the
old one), so a reader finds the old text or the new one, never an empty or half-written file. The
launchers read it to say what a failed rank was doing (dynaresize.launch.failure).
"""
from __future__ import annotations

import os
import signal
import threading

STATUS_DIR = ".ranks"
# Fault injection for tests: "RANK:TEXT" makes rank RANK kill itself (SIGKILL) right after it sets a
# status that starts with TEXT (e.g. "1:weight_sync", "0:train (iteration 2"). The status is on disk
# first, so the launcher's report can be checked against it.
KILL_AT_STATUS_ENV = "DYNARESIZE_KILL_AT_STATUS"
# The status of a rank that has done its work (Job.finish): it ends normally, never a cause.
FINISHED = "finished"


def status_path(run_dir: str, rank: int) -> str:
    return os.path.join(run_dir, STATUS_DIR, f"rank-{rank:05d}")


def write_status(path: str, text: str, rank: int | None = None) -> None:
    """Replace the status file `path` with `text`, atomically (readers never see it empty)."""
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    # Unique to this process and thread, so concurrent writers never share a temporary file.
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException as e:
        try:
            os.remove(tmp)
        except OSError:
            pass
        if isinstance(e, OSError) and not e.filename:      # name the file (a full disk says only errno)
            raise OSError(e.errno, f"{e.strerror} (writing the rank's status file)", path) from None
        raise
    spec = os.environ.get(KILL_AT_STATUS_ENV)
    if spec and rank is not None:
        who, _, prefix = spec.partition(":")
        if who == str(rank) and text.startswith(prefix):
            os.kill(os.getpid(), signal.SIGKILL)


def rank_status(run_dir: str, rank: int) -> str | None:
    try:
        with open(status_path(run_dir, rank)) as f:
            return f.read().strip() or None
    except OSError:
        return None


def clear_statuses(run_dir: str) -> None:
    """Remove the status and heartbeat files of an earlier run in `run_dir` (a rank that dies before it writes
    one must not be reported as doing what the earlier run's rank did)."""
    directory = os.path.join(run_dir, STATUS_DIR)
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        if name.startswith(("rank-", "beat-")) or name.endswith(".tmp"):
            try:
                os.remove(os.path.join(directory, name))
            except OSError:
                pass
