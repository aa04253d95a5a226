"""Explain a failed job: which rank failed first, and what it was doing (from its status file).

Every rank keeps a one-line status file saying what it is doing (dynaresize.runtime.status).

When one rank dies the others follow: a peer in a collective with it gets a connection error,
prints it and calls MPI_Abort, and mpiexec kills the rest. Which of these events mpiexec reports is
a race: it may report only a peer's MPI_Abort, a consequence. The cause is the rank that ended
first, so the local launcher also watches the ranks' processes (`RankWatch`) and records the order
in which they end; `explain_failure` names the cause (`first_to_fail`) with what its status file
said, and the ranks that failed after it.
"""
from __future__ import annotations

import os
import re
import select
import shutil
import threading
import time

from ..runtime.status import FINISHED, rank_status

# How launchers report a rank that died: Open MPI's mpiexec/prterun, and srun.
DEATH_PATTERNS = (
    re.compile(r"process rank (?P<rank>\d+) with PID \d+ on node \S+ exited on signal (?P<signal>\d+)"),
    re.compile(r"srun: error: \S+: task (?P<rank>\d+): (?P<signal>[A-Z][a-z]+)"),
)
ABORT_PATTERN = re.compile(r"MPI_ABORT was invoked on rank (?P<rank>\d+)")
# What a rank prints before it aborts the job (dynaresize/runtime/worker.py).
FAILED_PATTERN = re.compile(r"\[dynaresize\] rank (?P<rank>\d+) failed: (?P<error>.*)")


# --- watching the ranks' processes -------------------------------------------------------------
RANK_ENV_VARS = (b"OMPI_COMM_WORLD_RANK=", b"PMIX_RANK=", b"PMI_RANK=")


def _ppid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return int(stat[stat.rindex(b")") + 2:].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _mpi_rank(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read().split(b"\0")
    except OSError:
        return None
    for var in RANK_ENV_VARS:
        for item in env:
            if item.startswith(var):
                try:
                    return int(item[len(var):])
                except ValueError:
                    return None
    return None


def _exited(pid: int) -> bool:
    """True if `pid` has ended (gone, or a zombie waiting for its parent)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return stat[stat.rindex(b")") + 2:stat.rindex(b")") + 3] in (b"Z", b"X")
    except (OSError, ValueError):
        return True


class RankWatch:
    """Record the order in which the ranks started under one process (mpiexec) end.

    The ranks are found in /proc among the launcher process's descendants: the top-most processes
    with an MPI rank in their environment (a rank's own children inherit it). Each is watched with
    a pidfd, which becomes readable the moment the process ends; `exits` is then [(time, rank)] in
    that order (time.monotonic()). Linux only; elsewhere it records nothing.
    """

    FIND_INTERVAL_S = 0.05
    POLL_FALLBACK_S = 0.01      # without pidfds (old kernels): poll /proc this often

    def __init__(self, root_pid: int, ranks: int):
        self.root_pid, self.ranks = root_pid, ranks
        self.exits: list[tuple[float, int]] = []
        self.pids: dict[int, int] = {}            # rank -> pid
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dynaresize-rank-watch", daemon=True)

    def start(self) -> "RankWatch":
        if os.path.isdir("/proc/self"):
            self._thread.start()
        return self

    def stop(self, timeout: float = 2.0) -> list[tuple[float, int]]:
        """Stop after the ranks being watched have been seen to end (call it once the launcher has
        exited: its ranks have ended by then). The exits, or [] if not every rank was watched."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        if len(self.pids) < self.ranks:
            return []          # some ranks were not seen (another node, or gone before found)
        return list(self.exits)

    def _find(self) -> None:
        children: dict[int, list[int]] = {}
        for name in os.listdir("/proc"):
            if name.isdigit():
                ppid = _ppid(int(name))
                if ppid is not None:
                    children.setdefault(ppid, []).append(int(name))
        todo = list(children.get(self.root_pid, []))
        while todo:
            pid = todo.pop()
            rank = _mpi_rank(pid)
            if rank is None:
                todo.extend(children.get(pid, []))
            elif rank not in self.pids:
                self.pids[rank] = pid
                self._watch(pid, rank)

    def _watch(self, pid: int, rank: int) -> None:
        try:
            fd = os.pidfd_open(pid)
        except (AttributeError, OSError):
            self._polled[pid] = rank
            return
        self._fds[fd] = rank
        self._poll.register(fd, select.POLLIN)

    def _run(self) -> None:
        self._fds: dict[int, int] = {}           # pidfd -> rank
        self._polled: dict[int, int] = {}        # pid -> rank, where pidfds are not available
        self._poll = select.poll()
        next_find, deadline = 0.0, None
        try:
            while True:
                now = time.monotonic()
                if self._stop.is_set():          # the launcher has exited: its ranks have ended
                    deadline = now + 1.0 if deadline is None else deadline
                    if not (self._fds or self._polled) or now > deadline:
                        return
                elif len(self.pids) < self.ranks and now >= next_find:
                    try:
                        self._find()
                    except OSError:
                        pass
                    next_find = now + self.FIND_INTERVAL_S
                finding = len(self.pids) < self.ranks and not self._stop.is_set()
                wait = self.POLL_FALLBACK_S if self._polled else self.FIND_INTERVAL_S if finding else 0.2
                ready = self._poll.poll(wait * 1000)
                when = time.monotonic()
                ended = []
                for fd, _ in ready:
                    ended.append(self._fds.pop(fd))
                    self._poll.unregister(fd)
                    os.close(fd)
                for pid, rank in list(self._polled.items()):
                    if _exited(pid):
                        del self._polled[pid]
                        ended.append(rank)
                self.exits.extend((when, rank) for rank in sorted(ended))
        finally:
            for fd in self._fds:
                os.close(fd)


# --- the report --------------------------------------------------------------------------------
def _parse(output_lines: list[str]):
    text = " ".join(line.strip() for line in output_lines)     # launchers wrap their messages
    signals: dict[int, str] = {}
    for pattern in DEATH_PATTERNS:
        for m in pattern.finditer(text):
            signals.setdefault(int(m.group("rank")), m.group("signal"))
    aborted = [int(m.group("rank")) for m in ABORT_PATTERN.finditer(text)]
    failed: dict[int, str] = {}
    for line in output_lines:
        m = FAILED_PATTERN.search(line)
        if m:
            failed.setdefault(int(m.group("rank")), m.group("error").strip())
    return signals, aborted, failed


def first_to_fail(output_lines: list[str], run_dir: str,
                  exits: list[tuple[float, int]] | None = None) -> int | None:
    """The rank whose failure came first.

    1. A rank the launcher reports killed by a signal (not one it sent: mpiexec does not report
       the ranks it kills itself after an MPI_Abort); the first of them to end.
    2. Else the first rank to end (`exits`, from RankWatch), leaving out ranks whose status says
       they had finished their work (they ended normally). Ranks seen ending at the same instant:
       one that ended without a word (killed, or crashed) before one that reported an error.
    3. Else the first rank that reported an error, else the first that called MPI_Abort.
    """
    signals, aborted, failed = _parse(output_lines)
    exits = [(when, rank) for when, rank in exits or []
             if not (rank_status(run_dir, rank) or "").startswith(FINISHED)]
    ended_at = {}
    for when, rank in exits:
        ended_at.setdefault(rank, when)
    if signals:
        reported = list(signals)
        return min(reported, key=lambda r: (ended_at.get(r, float("inf")), reported.index(r)))
    if exits:
        first_time = exits[0][0]
        tied = [rank for when, rank in exits if when == first_time]
        return min(tied, key=lambda r: (r in failed or r in aborted, r))
    if failed:
        return next(iter(failed))
    return aborted[0] if aborted else None


def explain_failure(output_lines: list[str], run_dir: str,
                    exits: list[tuple[float, int]] | None = None) -> str | None:
    """One sentence naming the rank that failed first and the operation it was in, if known.

    `exits`: [(time, rank)] in the order the ranks ended (RankWatch), when the launcher saw it.
    """
    signals, aborted, failed = _parse(output_lines)
    rank = first_to_fail(output_lines, run_dir, exits)
    if rank is None:
        return None
    doing = rank_status(run_dir, rank) or "an unknown step (no status recorded)"
    if rank in signals:
        what = f"rank {rank} died (signal {signals[rank]}) during {doing}"
    elif rank in failed:
        what = f"rank {rank} failed during {doing}: {failed[rank]}"
    else:
        what = (f"rank {rank} died (killed or crashed: it reported no error, and ended before the "
                f"other ranks) during {doing}")
    later = sorted((set(failed) | set(aborted)) - {rank})
    if later:
        names = ", ".join(str(r) for r in later)
        what += f"; rank{'s' if len(later) > 1 else ''} {names} failed after it (a consequence)"
    return what


DISK_FULL = ("No space left on device", "Disk quota exceeded")


def disk_full_hint(output_lines: list[str], places: dict[str, str | None]) -> str | None:
    """If the ranks failed on a full disk (or quota): how much room each of `places` (what: path) has
    left, so the user sees which one filled up."""
    if not any(text in line for line in output_lines for text in DISK_FULL):
        return None
    room = []
    for what, path in places.items():
        if path:
            try:
                free = shutil.disk_usage(path).free
            except OSError:
                continue
            room.append(f"{what} {path}: {free / 2**20:.1f} MiB free")
    if not room:
        return None
    return (f"a disk is full ({'; '.join(room)}). Fix: free space there (or raise the quota) and start the "
            f"same command again: it resumes from the last checkpoint")
