"""Follow a running job: print one line per iteration as the timeline grows.

The writer (dynaresize.timeline.writer) opens the file in HDF5 SWMR mode while it appends an
iteration, so this reader opens it with ``swmr=True`` and calls ``Dataset.refresh()`` to see new
rows. The file lock is not taken (``locking=False``), so following never blocks the job's writer.
File attributes are not refreshed by SWMR: the writer sets ``complete=True`` after its last SWMR
session, so every poll closes and reopens the file to read that attribute. Rows are read
incrementally (only rows not seen before), so following a long run stays cheap.
"""
from __future__ import annotations

import math
import sys
import time
from collections import defaultdict
from pathlib import Path

import h5py
import numpy as np

from dynaresize.timeline import schema
from dynaresize.timeline.schema import TimelineError

from .load import TIMELINE_FILE, open_timeline

# Reading a file that is being created, or that the writer reopens to set its final attributes,
# can fail for a moment; such errors are retried for this long before the first good read.
STARTUP_GRACE_S = 10.0


class _Follower:
    def __init__(self, path: Path, out):
        self.path = path
        self.out = out
        self.file: h5py.File | None = None
        self.offsets = {name: 0 for name in schema.DATASETS}
        self.pending: list[tuple] = []            # iterations rows not printed yet
        self.printed = 0
        self.first_start = math.nan
        self.last_end = math.nan
        self.samples = defaultdict(lambda: [0, 0, 0.0])      # iteration -> n, tokens, reward sum
        self.switch = defaultdict(lambda: [0.0, 0.0])        # iteration -> critical s, total s
        self.decisions: dict[int, tuple] = {}                # iteration -> (action, to, reason)

    # -- file handling ---------------------------------------------------------------------
    def open(self) -> None:
        self.file = open_timeline(self.path, swmr=True, locking=False)

    def close(self) -> None:
        if self.file is not None:
            try:
                self.file.close()
            finally:
                self.file = None

    def complete(self) -> bool:
        """Reopen the file (attributes are not refreshed by SWMR) and read `complete`."""
        self.close()
        self.open()
        return bool(self.file.attrs.get("complete", False))

    # -- reading ---------------------------------------------------------------------------
    def _new_rows(self, name: str, fields: list[str]) -> np.ndarray:
        ds = self.file[name]
        ds.refresh()
        start, stop = self.offsets[name], ds.shape[0]
        if stop <= start:
            return np.zeros(0, dtype=[(f, ds.dtype[f]) for f in fields])
        rows = ds.fields(fields)[start:stop]
        self.offsets[name] = stop
        return rows

    def read(self) -> None:
        # Iterations first: rows written before an iteration's row are then already in.
        its = self._new_rows("iterations", ["iteration", "train_ranks", "rollout_ranks", "start",
                                            "end"])
        self.pending.extend(its.tolist())
        s = self._new_rows("samples", ["iteration", "response_len", "reward"])
        for i, n_tok, reward in zip(s["iteration"].tolist(), s["response_len"].tolist(),
                                    s["reward"].tolist()):
            agg = self.samples[i]
            agg[0] += 1
            agg[1] += n_tok
            agg[2] += reward
        e = self._new_rows("events", ["iteration", "name", "start", "end", "critical"])
        switch = np.isin(e["name"], [n.encode() for n in schema.SWITCH_OPS])
        for i, start, end, crit in zip(e["iteration"][switch].tolist(), e["start"][switch].tolist(),
                                       e["end"][switch].tolist(), e["critical"][switch].tolist()):
            agg = self.switch[i]
            agg[1] += end - start
            if crit == schema.CRITICAL:
                agg[0] += end - start
        d = self._new_rows("decisions", ["iteration", "to_train", "action", "reason"])
        for i, to, action, reason in d.tolist():
            self.decisions[i] = (action.decode(), to, reason.decode())

    # -- output ----------------------------------------------------------------------------
    def print_new(self) -> None:
        for iteration, train, rollout, start, end in self.pending:
            span = end - start
            n, tokens, reward = self.samples.get(iteration, (0, 0, 0.0))
            crit, total = self.switch.get(iteration, (0.0, 0.0))
            line = (f"iteration {iteration:4d}  split {train}/{rollout}  {span:7.2f} s  "
                    f"{_rate(tokens, span):9.1f} tokens/s  {_rate(n, span):7.2f} samples/s  "
                    f"reward {reward / n if n else math.nan:6.3f}  "
                    f"switch {crit:.2f} s critical / {total:.2f} s")
            if iteration in self.decisions:
                action, to, reason = self.decisions[iteration]
                line += f"  decision {action} -> {to} train ({reason})"
            print(line, file=self.out, flush=True)
            self.first_start = start if math.isnan(self.first_start) else min(self.first_start, start)
            self.last_end = end if math.isnan(self.last_end) else max(self.last_end, end)
            self.printed += 1
        self.pending.clear()

    def summary(self) -> str:
        if not self.printed:
            return "no iteration"
        total = self.last_end - self.first_start
        tokens = sum(v[1] for v in self.samples.values())
        return (f"{self.printed} iterations, {total:.2f} s, {tokens} tokens "
                f"({_rate(tokens, total):.1f} tokens/s)")


def _rate(amount: float, seconds: float) -> float:
    return amount / seconds if seconds > 0 else math.nan


def follow(path, interval: float = 1.0, timeout: float | None = None, out=None) -> int:
    """Print one line per new iteration of the timeline at `path` while a job writes it.

    `path` is a timeline file or a run folder. A file that does not exist yet (job still
    queued) is waited for. Polls every `interval` seconds; stops when the file's ``complete``
    attribute becomes true (returns 0) or after `timeout` seconds (returns 1). Raises
    TimelineError if the file is of another schema version, or exists but has not become a
    readable timeline within max(STARTUP_GRACE_S, 5 intervals).
    """
    out = out or sys.stdout
    path = Path(path)
    if path.is_dir() or (not path.exists() and not path.suffix):
        path = path / TIMELINE_FILE
    started = time.monotonic()
    deadline = None if timeout is None else started + timeout
    grace = max(STARTUP_GRACE_S, 5 * interval)
    follower = _Follower(path, out)
    print(f"following {path} (every {interval:g} s"
          + (f", for at most {timeout:g} s)" if timeout is not None else ")"), file=out, flush=True)
    ever_read = False
    try:
        while True:
            complete = False
            try:
                if follower.file is None:
                    follower.open()
                follower.read()
                complete = follower.complete()
                if complete:            # rows written since the read above
                    follower.read()
                ever_read = True
            except (OSError, KeyError, TimelineError) as e:
                follower.close()
                if isinstance(e, TimelineError) and "schema version" in str(e):
                    raise
                if not ever_read and path.exists() and time.monotonic() - started > grace:
                    if isinstance(e, TimelineError):
                        raise
                    raise TimelineError(f"{path} cannot be read as a timeline: {e}") from e
            follower.print_new()
            if complete:
                print(f"run complete: {follower.summary()}", file=out, flush=True)
                return 0
            if deadline is not None and time.monotonic() >= deadline:
                state = "not found" if not path.exists() else "not complete"
                print(f"stopped after {timeout:g} s: {follower.summary()}; the run is {state}",
                      file=out, flush=True)
                return 1
            time.sleep(interval if deadline is None else
                       max(0.0, min(interval, deadline - time.monotonic())))
    finally:
        follower.close()
