"""Append-only HDF5 writer for the timeline (numpy and h5py only; used by runs and the simulator).

Rows are kept in memory by `append` and written by `flush` (once an iteration for a job), which
opens the file, writes them in single-writer/multiple-reader mode (SWMR, so that
`dynaresize-analyze --follow` can read the file while it grows) and closes it again. SWMR forbids
creating datasets or attributes, so everything is created first and the final attributes are set
after the last SWMR session.

Why the file is closed between flushes: HDF5 marks a file open for writing in its superblock and
clears the mark when it closes the file. A writer killed while it holds the file (SIGKILL cannot be
caught, nor can a node failure) leaves the mark, and then plain `h5py.File(path, "r")` (and pandas)
refuse the file ("file is already open for write ... h5clear"); only a SWMR reader gets in. Closed
between flushes, the file is clean at almost any moment a job can die: it opens with plain h5py,
with every iteration flushed before. The price is one open and close per flush: about 0.3 ms
(measured with h5py 3.16 / HDF5 2.0, 40 events and 64 samples an iteration: 3.0 ms to append and
flush on a file held open, 3.3 ms with the open and close), and nothing in file size. Catchable
signals (SIGTERM, SIGINT, SIGHUP) that arrive while the file is open wait until it is closed. A
SIGKILL during the few milliseconds a flush holds the file leaves the mark: `repair_timeline` (run
by the local launcher after a failed job, or `python -m dynaresize.timeline.writer repair PATH`)
copies the rows into a clean file.

The writer does not take HDF5's file lock (locking=False): a reader holding the file open between
flushes (a notebook with plain h5py) would otherwise make the job's next flush fail. The
superblock mark above still stops a second writer.

Within a flush the `iterations` rows are written last, after a flush of the other datasets, so an
iteration's row is on disk only once its events, samples and decisions are: readers take an
iteration without its row (one in flight when the job died) as not completed.
"""
from __future__ import annotations

import contextlib
import datetime
import json
import os
import signal
import sys
import threading

import h5py
import numpy as np

from .reader import open_read
from .schema import DATASETS, KIND, SCHEMA_VERSION, TimelineError, check_file, dataset, rows

CHUNK_ROWS = 1024
LAST = "iterations"                           # written last in each flush (see the module docstring)
ORDER = [name for name in DATASETS if name != LAST] + [LAST]
DEFERRED_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGINT", "SIGHUP") if hasattr(signal, name))


class TimelineWriter:
    def __init__(self, path: str | os.PathLike, meta: dict, resume_after: int | None = None,
                 attempt_start_s: float = 0.0, world_size: int | None = None):
        """Create `path`, or with `resume_after=i` reopen it, drop rows of iterations > i and
        record a new attempt that started at `attempt_start_s` on `world_size` ranks (attribute
        `attempts`; a run with the fully sharded trainer may resume on another rank count)."""
        self.path = os.fspath(path)
        if resume_after is None:
            self._create(meta)
        else:
            self._truncate_after(resume_after, attempt_start_s, world_size)
        self._pending: dict[str, list[np.ndarray]] = {name: [] for name in DATASETS}
        self._closed = False

    def _create(self, meta: dict) -> None:
        with h5py.File(self.path, "w", libver="latest", locking=False) as f:
            f.attrs["kind"] = KIND
            f.attrs["schema_version"] = SCHEMA_VERSION
            f.attrs["created"] = datetime.datetime.now(datetime.timezone.utc).isoformat()
            f.attrs["complete"] = False
            for key, value in meta.items():
                f.attrs[key] = value
            for name, dtype in DATASETS.items():
                f.create_dataset(name, shape=(0,), maxshape=(None,), dtype=dtype, chunks=(CHUNK_ROWS,))

    def _truncate_after(self, iteration: int, attempt_start_s: float, world_size: int | None = None) -> None:
        """Resume: keep only rows of completed iterations, so none is lost or repeated.

        A file whose writer died holding it is marked as open for writing, which HDF5 refuses to
        open for writing again; a SWMR reader still can. So the kept rows are copied into a new
        file that replaces the old one.
        """
        attempt = {"start_s": attempt_start_s, "after_iteration": iteration}
        if world_size is not None:
            attempt["world_size"] = world_size
        _copy_rows(self.path, lambda data: data[data["iteration"] <= iteration],
                   {"complete": False, "resumed": lambda attrs: int(attrs.get("resumed", 0)) + 1,
                    "attempts": lambda attrs: json.dumps(json.loads(attrs.get("attempts", "[]")) + [attempt])})

    def append(self, name: str, records: list[dict] | np.ndarray) -> None:
        """Add rows to dataset `name`; they are written by the next `flush` (or `close`)."""
        if self._closed:
            raise ValueError(f"{self.path}: the timeline writer is closed")
        if len(records) == 0:
            return
        data = records if isinstance(records, np.ndarray) else rows(DATASETS[name], records)
        self._pending[name].append(np.asarray(data, dtype=DATASETS[name]))

    def flush(self) -> None:
        """Write the appended rows and close the file (it is clean on disk when this returns)."""
        if not any(self._pending.values()):
            return
        with _signals_deferred(), _open_for_append(self.path) as f:
            for name in ORDER:
                if name == LAST:
                    f.flush()                 # everything else first: a row means its data is in
                parts = self._pending[name]
                if not parts:
                    continue
                data = parts[0] if len(parts) == 1 else np.concatenate(parts)
                _append_rows(f[name].id, name, data)
                self._pending[name] = []
            f.flush()

    def close(self, complete: bool, **final_attrs) -> None:
        if self._closed:
            return
        self.flush()
        self._closed = True
        with _signals_deferred(), h5py.File(self.path, "a", libver="latest", locking=False) as f:
            f.attrs["complete"] = complete
            for key, value in final_attrs.items():
                f.attrs[key] = value


_MEMORY_TYPES: dict[str, h5py.h5t.TypeID] = {}


def _append_rows(dataset: h5py.h5d.DatasetID, name: str, data: np.ndarray) -> None:
    """Extend `dataset` by `data` (low-level calls: the high-level ones cost ~1 ms a flush here,
    mostly re-deriving the compound type of a freshly opened dataset)."""
    mtype = _MEMORY_TYPES.get(name)
    if mtype is None:
        mtype = _MEMORY_TYPES[name] = h5py.h5t.py_create(DATASETS[name])
    start = dataset.get_space().shape[0]
    dataset.set_extent((start + len(data),))
    fspace = dataset.get_space()
    fspace.select_hyperslab((start,), (len(data),))
    dataset.write(h5py.h5s.create_simple((len(data),)), fspace, np.ascontiguousarray(data), mtype=mtype)


@contextlib.contextmanager
def _open_for_append(path: str):
    f = h5py.File(path, "a", libver="latest", locking=False)
    try:
        f.swmr_mode = True
        yield f
    finally:
        f.close()                             # clears the superblock's "open for write" mark


@contextlib.contextmanager
def _signals_deferred():
    """Hold SIGTERM, SIGINT and SIGHUP until the block ends, then act on them as before (a job
    told to stop while it writes the timeline stops right after, leaving the file closed)."""
    if threading.current_thread() is not threading.main_thread():
        yield                                 # handlers can only be set from the main thread
        return
    received: list[int] = []
    previous = {}
    try:
        for sig in DEFERRED_SIGNALS:
            if signal.getsignal(sig) is not None:     # None: a handler set outside Python, kept
                previous[sig] = signal.signal(sig, lambda signum, frame: received.append(signum))
    except (ValueError, OSError):             # e.g. not allowed in this interpreter
        pass
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for sig in received[:1]:
            os.kill(os.getpid(), sig)         # the old handler (default: end the process)


def _copy_rows(path: str, keep, attr_updates: dict) -> None:
    """Rewrite timeline `path` as a clean file: `keep(rows)` of each dataset, attributes updated
    (a value may be a function of the old attributes), swapped in with os.replace."""
    with h5py.File(path, "r", libver="latest", swmr=True) as old:
        check_file(old)
        attrs = dict(old.attrs)
        kept = {name: keep(dataset(old, name)) for name in DATASETS}
    tmp = f"{path}.rewrite"
    with h5py.File(tmp, "w", libver="latest", locking=False) as f:
        f.attrs.update(attrs)
        f.attrs["schema_version"] = SCHEMA_VERSION       # every dataset is written, so the newest
        for key, value in attr_updates.items():
            f.attrs[key] = value(attrs) if callable(value) else value
        for name, dtype in DATASETS.items():
            f.create_dataset(name, data=kept[name], maxshape=(None,), dtype=dtype, chunks=(CHUNK_ROWS,))
    os.replace(tmp, path)


def clock_origin(path: str | os.PathLike) -> float | None:
    """The Unix time a run's clock started at (attribute `clock_origin`), for a resumed attempt
    to go on from; None if the file is missing or older than that attribute."""
    try:
        with h5py.File(path, "r", libver="latest", swmr=True) as f:
            origin = f.attrs.get("clock_origin")
    except OSError:
        return None
    return None if origin is None else float(origin)


def needs_repair(path: str | os.PathLike) -> bool:
    """True if `path` is marked as open for writing (its writer was killed holding it), so that
    plain h5py.File(path, "r") refuses it."""
    try:
        h5py.File(path, "r", libver="latest").close()
        return False
    except OSError as e:
        return "already open for write" in str(e)


def repair_timeline(path: str | os.PathLike) -> str | None:
    """Make a timeline whose writer was killed holding it open readable by plain h5py again: its
    rows are copied into a clean file that replaces it (incomplete, as before). Only for a file no
    job is writing. Returns what was done, or None if the file needed nothing (or is missing)."""
    path = os.fspath(path)
    if not os.path.exists(path) or not needs_repair(path):
        return None
    _copy_rows(path, lambda data: data, {"repaired": lambda attrs: int(attrs.get("repaired", 0)) + 1})
    return f"repaired {path} (its writer was killed while it held the file open)"


def last_complete_iteration(path: str | os.PathLike) -> int:
    """The last iteration that has its `iterations` row (-1 if none), for resuming."""
    with open_read(path) as f:
        check_file(f)
        its = f["iterations"]["iteration"]
        return int(its.max()) if len(its) else -1


def main(argv: list[str] | None = None) -> int:
    """python -m dynaresize.timeline.writer repair TIMELINE..."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 2 or argv[0] != "repair":
        print("usage: python -m dynaresize.timeline.writer repair TIMELINE [TIMELINE ...]", file=sys.stderr)
        return 2
    for path in argv[1:]:
        try:
            print(repair_timeline(path) or f"{path}: nothing to repair")
        except (OSError, TimelineError) as e:
            print(f"{path}: {e}", file=sys.stderr)
            return 2
    return 0


__all__ = ["TimelineWriter", "TimelineError", "clock_origin", "last_complete_iteration", "repair_timeline",
           "needs_repair"]

if __name__ == "__main__":
    sys.exit(main())
