"""Read a timeline file into pandas: `load_timeline(path) -> Timeline`.

The file format is defined in `dynaresize.timeline.schema`; this module only reads it. A path may
be the `timeline.h5` file itself or a run folder that contains one. Anything that is not a
readable timeline of the current schema version raises `schema.TimelineError` with the path and
what is wrong, so the command line can print one clear message.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import h5py
import numpy as np
import pandas as pd

from dynaresize.timeline import schema
from dynaresize.timeline.reader import TIMELINE_FILE, open_timeline, plain, resolve_path  # noqa: F401 (re-exported)
from dynaresize.timeline.schema import TimelineError

# Columns of each dataset that hold fixed-size byte strings and are decoded to str.
_STRING_COLUMNS = {
    "events": ("role", "name", "attrs"),
    "iterations": (),
    "samples": (),
    "decisions": ("action", "reason", "attrs"),
    "metrics": ("name",),
}
# Decoded to pandas categoricals (few distinct values, millions of rows).
_CATEGORICAL_COLUMNS = {("events", "role"), ("events", "name"), ("metrics", "name")}


@dataclass
class Timeline:
    """One run's timeline, decoded.

    Attributes:
        path: the timeline file.
        attrs: the file attributes as plain Python values; ``attrs["config"]`` is the run config
            parsed from its YAML text into a dict (``{}`` when the file has none).
        events: one row per event (columns of ``schema.EVENT_DTYPE``); ``role`` and ``name`` are
            categoricals of str, ``attrs`` is the raw JSON text (``""`` when empty, absent when
            loaded with ``event_attrs=False``; decode with ``schema.decode_attrs``).
        iterations: one row per completed iteration (``schema.ITERATION_DTYPE``).
        samples: one row per generated sample (``schema.SAMPLE_DTYPE``).
        decisions: one row per policy decision (``schema.DECISION_DTYPE``); ``action``, ``reason``
            and ``attrs`` are str.
        metrics: one row per (iteration, metric) the run's loggers got (``schema.METRIC_DTYPE``,
            long format; empty for a simulated run or a file of schema version 1).
        config_text: the config attribute as written (YAML).
    """

    path: str
    attrs: dict
    events: pd.DataFrame
    iterations: pd.DataFrame
    samples: pd.DataFrame
    decisions: pd.DataFrame
    metrics: pd.DataFrame
    config_text: str = ""
    # Results of expensive computations (interval unions), filled by dynaresize.analysis.metrics.
    cache: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def config(self) -> dict:
        return self.attrs.get("config") or {}

    @property
    def policy(self) -> str:
        """The policy name: config ``policy.name``, else the file attribute ``policy``, else
        ``"unknown"``."""
        policy = self.config.get("policy")
        name = policy.get("name") if isinstance(policy, dict) else policy
        if name in (None, ""):
            name = self.attrs.get("policy")
        return str(name) if name not in (None, "") else "unknown"

    @property
    def initial_train_ranks(self) -> int | None:
        """Train ranks of the initial split: config ``policy.train_ranks`` (unless ``auto``), else
        the first iteration's split, else None."""
        policy = self.config.get("policy")
        if isinstance(policy, dict) and isinstance(policy.get("train_ranks"), int):
            return int(policy["train_ranks"])
        if len(self.iterations):
            return int(self.iterations["train_ranks"].iloc[0])
        return None

    @property
    def world_size(self) -> int:
        """Number of GPU ranks: the ``world_size`` attribute, else the ranks seen in events."""
        if "world_size" in self.attrs:
            return int(self.attrs["world_size"])
        return len(self.ranks)

    @property
    def ranks(self) -> np.ndarray:
        """All ranks: 0..world_size-1 plus any other rank that has events, sorted."""
        if "ranks" not in self.cache:
            seen = np.unique(self.events["rank"].to_numpy()) if len(self.events) else np.array([], int)
            declared = np.arange(int(self.attrs.get("world_size", 0)))
            self.cache["ranks"] = np.union1d(declared, seen).astype(np.int64)
        return self.cache["ranks"]

    @property
    def complete(self) -> bool:
        return bool(self.attrs.get("complete", False))

    @property
    def name(self) -> str:
        """A short name for the run: its folder's name."""
        return Path(self.path).resolve().parent.name


def load_timeline(path: str | os.PathLike, event_attrs: bool = True) -> Timeline:
    """Load a timeline file (or the timeline.h5 of a run folder) into a `Timeline`.

    Args:
        path: a timeline file, or a run folder containing ``timeline.h5``.
        event_attrs: also load the per-event JSON ``attrs`` column (256 bytes a row; skip it for
            very large runs when only the metrics are needed).

    Raises:
        schema.TimelineError: not a timeline, another schema version, truncated or unreadable.
        ImportError: the file has a config and PyYAML is not installed.
    """
    path = resolve_path(path)
    with open_timeline(path) as f:
        try:
            attrs = {key: plain(value) for key, value in f.attrs.items()}
            tables = {}
            for name in schema.DATASETS:
                skip = () if (name != "events" or event_attrs) else ("attrs",)
                tables[name] = _read_dataset(f, name, skip)
        except TimelineError:
            raise
        except (OSError, KeyError, ValueError, TypeError) as e:
            raise TimelineError(f"{path} cannot be read as a timeline: reading it failed, the file "
                                f"may be truncated or corrupt ({e})") from e
    config_text = attrs.get("config", "")
    if not isinstance(config_text, str):
        config_text = str(config_text)
    attrs["config"] = parse_config(config_text, path)
    return Timeline(path=str(path), attrs=attrs, config_text=config_text, **tables)


def _read_dataset(f: h5py.File, name: str, skip: tuple = ()) -> pd.DataFrame:
    if name not in f:                      # a dataset newer than the file's schema version (checked)
        data, fields = schema.dataset(f, name), list(schema.DATASETS[name].names)
    else:
        dataset = f[name]
        missing = [c for c in schema.DATASETS[name].names if c not in (dataset.dtype.names or ())]
        if missing:
            raise TimelineError(f"{f.filename}: dataset {name} lacks the fields {missing} "
                                f"of schema version {schema.SCHEMA_VERSION}")
        fields = [c for c in dataset.dtype.names if c not in skip]
        data = dataset.fields(fields)[...] if skip else dataset[...]
    columns = {}
    for column in fields:
        values = data[column]
        if column in _STRING_COLUMNS[name]:
            columns[column] = _decode_strings(values, (name, column) in _CATEGORICAL_COLUMNS)
        else:
            columns[column] = values
    return pd.DataFrame(columns, index=pd.RangeIndex(len(data)))


def _decode_strings(values: np.ndarray, categorical: bool):
    """Decode a fixed-size bytes column; distinct values are decoded once."""
    codes, uniques = pd.factorize(values.astype(object), sort=True)
    decoded = [u.decode("utf-8", errors="replace") for u in uniques]
    if categorical:
        return pd.Categorical.from_codes(codes, categories=decoded)
    return np.array(decoded, dtype=object)[codes] if len(codes) else np.array([], dtype=object)


def parse_config(text: str, path: str | os.PathLike = "") -> dict:
    """Parse the run config (YAML written by the run; JSON is accepted too) into a dict."""
    if not text or not text.strip():
        return {}
    try:
        parsed = json.loads(text)
    except ValueError:
        try:
            import yaml
        except ImportError as e:
            raise ImportError("reading the run config of a timeline needs PyYAML (pip install "
                              "pyyaml; it is installed with hydra-core/omegaconf)") from e
        try:
            parsed = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise TimelineError(f"{path}: the config attribute is not valid YAML ({e})") from e
    if parsed is None:
        return {}
    if not isinstance(parsed, dict):
        raise TimelineError(f"{path}: the config attribute is not a mapping "
                            f"(got {type(parsed).__name__})")
    return parsed
