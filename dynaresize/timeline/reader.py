"""Reading timelines: the one place that opens a timeline file for reading.

The analysis (pandas), the calibration, `dynaresize-analyze follow`, the Slurm launcher's progress,
the timeline writer's repair and resume, and the simulator all read through here (h5py and numpy
only). Anything that is not a readable timeline of this schema version raises TimelineError with
the path and what is wrong.
"""
from __future__ import annotations

import os
from pathlib import Path

import h5py
import numpy as np

from .schema import DATASETS, TimelineError, check_file, dataset

TIMELINE_FILE = "timeline.h5"     # in every run folder


def resolve_path(path: str | os.PathLike) -> Path:
    """The timeline file of `path` (a timeline file or a run folder containing timeline.h5)."""
    p = Path(path)
    if p.is_dir():
        if (p / TIMELINE_FILE).is_file():
            return p / TIMELINE_FILE
        raise TimelineError(f"{p} is a folder without a {TIMELINE_FILE}: give a run folder or a timeline file")
    if not p.exists():
        raise TimelineError(f"{p}: no such file or folder")
    return p


def open_read(path, swmr: bool = False, **kwargs) -> h5py.File:
    """Open an HDF5 file read-only: one that a running job holds open for writing (SWMR), or that a
    killed writer left marked as open, is opened in SWMR read mode."""
    try:
        return h5py.File(path, "r", libver="latest", swmr=swmr, **kwargs)
    except OSError as e:
        if swmr or "already open for write" not in str(e):
            raise
        return h5py.File(path, "r", libver="latest", swmr=True, **kwargs)


def open_timeline(path: str | os.PathLike, swmr: bool = False, locking: bool | None = None) -> h5py.File:
    """Open a timeline (file or run folder) read-only and check its kind and schema version."""
    path = resolve_path(path)
    kwargs = {} if locking is None else {"locking": locking}
    try:
        f = open_read(path, swmr=swmr, **kwargs)
    except OSError as e:
        raise TimelineError(f"{path} cannot be read as a timeline: {_describe_os_error(e)}") from e
    try:
        check_file(f)
    except BaseException:
        f.close()
        raise
    return f


def read_arrays(path: str | os.PathLike, names=tuple(DATASETS), swmr: bool = False,
                fields: dict[str, list[str]] | None = None) -> tuple[dict, dict]:
    """The file's attributes (plain Python values) and the datasets `names` as structured arrays
    (of a dataset named in `fields`, only the fields listed there)."""
    with open_timeline(path, swmr=swmr) as f:
        attrs = {key: plain(value) for key, value in f.attrs.items()}
        return attrs, {name: dataset(f, name, (fields or {}).get(name)) for name in names}


def plain(value):
    """An HDF5 attribute value as a plain Python value."""
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return [plain(v) for v in value.tolist()] if value.dtype.kind in "SO" else value.tolist()
    return value


def _describe_os_error(e: OSError) -> str:
    text = str(e)
    if "signature not found" in text:
        return f"it is not an HDF5 file ({text})"
    if "truncated" in text:
        return f"the file is truncated, e.g. copied or written only in part ({text})"
    return f"the HDF5 library reports: {text}"
