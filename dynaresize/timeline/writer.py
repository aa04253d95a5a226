"""Append-only HDF5 writer for the timeline (numpy and h5py only; used by runs and the simulator).

The file is opened for single-writer/multiple-reader access (SWMR) so `dynaresize-analyze --follow`
can read it while it grows; every append is flushed, so a crash loses at most the iteration in
flight. SWMR forbids creating datasets or attributes once it is on, so everything is created first
and the final attributes are set after the SWMR session is closed.
"""
from __future__ import annotations

import datetime
import os

import h5py
import numpy as np

from .schema import DATASETS, KIND, SCHEMA_VERSION, TimelineError, check_file, rows

CHUNK_ROWS = 1024


class TimelineWriter:
    def __init__(self, path: str | os.PathLike, meta: dict, resume_after: int | None = None):
        """Create `path`, or with `resume_after=i` reopen it and drop rows of iterations > i."""
        self.path = os.fspath(path)
        if resume_after is None:
            self._create(meta)
        else:
            self._truncate_after(resume_after)
        self._file = h5py.File(self.path, "a", libver="latest")
        self._file.swmr_mode = True
        self._datasets = {name: self._file[name] for name in DATASETS}

    def _create(self, meta: dict) -> None:
        with h5py.File(self.path, "w", libver="latest") as f:
            f.attrs["kind"] = KIND
            f.attrs["schema_version"] = SCHEMA_VERSION
            f.attrs["created"] = datetime.datetime.now(datetime.timezone.utc).isoformat()
            f.attrs["complete"] = False
            for key, value in meta.items():
                f.attrs[key] = value
            for name, dtype in DATASETS.items():
                f.create_dataset(name, shape=(0,), maxshape=(None,), dtype=dtype, chunks=(CHUNK_ROWS,))

    def _truncate_after(self, iteration: int) -> None:
        """Resume: keep only rows of completed iterations, so none is lost or repeated.

        A writer that died leaves the file marked as open for SWMR writing, which HDF5 refuses to
        open for writing again; a SWMR reader still can. So the kept rows are copied into a new
        file that replaces the old one.
        """
        with h5py.File(self.path, "r", libver="latest", swmr=True) as old:
            check_file(old)
            attrs = dict(old.attrs)
            kept = {}
            for name in DATASETS:
                data = old[name][...]
                kept[name] = data[data["iteration"] <= iteration]
        tmp = f"{self.path}.resume"
        with h5py.File(tmp, "w", libver="latest") as f:
            f.attrs.update(attrs)
            f.attrs["complete"] = False
            f.attrs["resumed"] = int(attrs.get("resumed", 0)) + 1
            for name, dtype in DATASETS.items():
                f.create_dataset(name, data=kept[name], maxshape=(None,), dtype=dtype, chunks=(CHUNK_ROWS,))
        os.replace(tmp, self.path)

    def append(self, name: str, records: list[dict] | np.ndarray) -> None:
        if len(records) == 0:
            return
        data = records if isinstance(records, np.ndarray) else rows(DATASETS[name], records)
        dataset = self._datasets[name]
        start = dataset.shape[0]
        dataset.resize((start + len(data),))
        dataset[start:] = data

    def flush(self) -> None:
        for dataset in self._datasets.values():
            dataset.flush()
        self._file.flush()

    def close(self, complete: bool, **final_attrs) -> None:
        if self._file is None:
            return
        self.flush()
        self._file.close()
        self._file = None
        with h5py.File(self.path, "a", libver="latest") as f:
            f.attrs["complete"] = complete
            for key, value in final_attrs.items():
                f.attrs[key] = value


def last_complete_iteration(path: str | os.PathLike) -> int:
    """The last iteration that has its `iterations` row (-1 if none), for resuming."""
    with h5py.File(path, "r", libver="latest") as f:
        check_file(f)
        its = f["iterations"]["iteration"]
        return int(its.max()) if len(its) else -1


__all__ = ["TimelineWriter", "TimelineError", "last_complete_iteration"]
