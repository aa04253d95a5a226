"""The processes of a running job, found in /proc (Linux): for the fault tests."""
from __future__ import annotations

import os


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    stat = f.read()
                children.setdefault(int(stat[stat.rindex(b")") + 2:].split()[1]), []).append(int(name))
            except (OSError, ValueError):
                pass
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def rank_pid(root: int, rank: int) -> int | None:
    """The process of MPI rank `rank` under `root` (the top-most with that rank in its environment)."""
    for pid in descendants(root):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if f"OMPI_COMM_WORLD_RANK={rank}".encode() in f.read().split(b"\0"):
                    return pid
        except OSError:
            pass
    return None


def state(pid: int) -> str:
    with open(f"/proc/{pid}/stat", "rb") as f:
        stat = f.read()
    return stat[stat.rindex(b")") + 2:].split()[0].decode()


def holds_open(pid: int, path) -> bool:
    target = os.path.realpath(path)
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") == target:
                return True
        except OSError:
            pass
    return False


def alive(pids) -> list[int]:
    """Those of `pids` still running (not gone, not a zombie)."""
    out = []
    for pid in pids:
        try:
            if state(pid) not in ("Z", "X"):
                out.append(pid)
        except (OSError, ValueError):
            pass
    return out
