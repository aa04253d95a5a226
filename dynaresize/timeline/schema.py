"""The timeline file format: one HDF5 file per run, written by rank 0 (or the simulator).

This module is the single definition of the format. It imports only numpy and h5py, so the
offline analysis can use it on a laptop without torch or MPI.

Layout (schema version 2; version 1, without `metrics`, is read too)::

    /                 attrs: kind="dynaresize-timeline", schema_version, mode, world_size,
                             mpi_world_size, config (resolved YAML), created, complete, ...
    /events           one row per timed piece of work on one rank (EVENT_DTYPE)
    /iterations       one row per iteration: the role table it ran with and its span
    /samples          one row per generated sample: lengths, reward, token digest
    /decisions        one row per policy decision (kept or moved) with its reason
    /metrics          one row per (iteration, metric): what the loggers got (train/*, reward/*, ...)

All times are seconds on rank 0's clock since the job started (ranks' clocks are aligned at start
up). Datasets are chunked and grow along axis 0, so a reader can follow a running job (HDF5 SWMR).
"""
from __future__ import annotations

import json

import h5py
import numpy as np

KIND = "dynaresize-timeline"
SCHEMA_VERSION = 2
READABLE_VERSIONS = (1, 2)      # version 1 has no `metrics` dataset: read as empty

# Roles as written in the file. "both" is a rank of a colocated run (rollout then training).
ROLES = ("train", "rollout", "both", "none")

# Stage names: useful work of an iteration. "steal": a micro-batch of the train step computed by a
# rank outside the train group (work stealing, dynaresize/plan/stealing.py); "migrate": a rollout rank
# handing its last sequences to a tail rank (tail migration, dynaresize/plan/migration.py); "eval":
# generating for the held-out prompts (eval.every).
STAGES = ("rollout", "train", "weight_sync", "exchange", "steal", "migrate", "eval")
# Switch operations: the fine-grained plan of one resize (see dynaresize.runtime.resize).
SWITCH_OPS = ("drain", "release", "stage_out", "reshard", "stage_in", "engine_start",
              "weight_load", "group_switch", "commit")
# Bookkeeping that belongs to neither (start-up, policy decision, checkpoints).
OTHER = ("startup", "decide", "checkpoint")
EVENT_NAMES = STAGES + SWITCH_OPS + OTHER

# `critical` column: whether a switch operation blocked the next stage.
NOT_A_SWITCH, BACKGROUND, CRITICAL = -1, 0, 1

ATTRS_BYTES = 256

EVENT_DTYPE = np.dtype([
    ("iteration", "<i4"),
    ("rank", "<i4"),
    ("role", "S8"),
    ("name", "S16"),
    ("start", "<f8"),
    ("end", "<f8"),
    ("tokens", "<i8"),      # tokens generated (rollout) or trained on (train)
    ("bytes", "<i8"),       # bytes moved (weight sync, staging)
    ("critical", "<i1"),    # NOT_A_SWITCH, BACKGROUND or CRITICAL
    ("attrs", f"S{ATTRS_BYTES}"),  # small JSON object, free-form
])

ITERATION_DTYPE = np.dtype([
    ("iteration", "<i4"),
    ("table_version", "<i4"),
    ("train_ranks", "<i4"),
    ("rollout_ranks", "<i4"),
    ("start", "<f8"),
    ("end", "<f8"),
    ("trained_batch", "<i4"),    # batch index trained in this iteration, -1 if none
    ("generated_batch", "<i4"),  # batch index generated in this iteration, -1 if none
])

SAMPLE_DTYPE = np.dtype([
    ("iteration", "<i4"),     # iteration in which the sample was generated
    ("batch", "<i4"),
    ("index", "<i4"),         # sample index within the batch (placement independent)
    ("prompt", "<i4"),        # prompt index within the batch
    ("rank", "<i4"),          # rank that generated it
    ("prompt_len", "<i4"),
    ("response_len", "<i4"),
    ("length_cap", "<i4"),    # the hidden response length the workload gave the sample (its end unless <eos> came first)
    ("reward", "<f4"),
    ("digest", "<u8"),        # hash of the response token ids: equal digests, equal tokens
])

DECISION_DTYPE = np.dtype([
    ("iteration", "<i4"),
    ("table_version", "<i4"),     # version of the table decided for the next iteration
    ("from_train", "<i4"),
    ("to_train", "<i4"),
    ("action", "S8"),             # "keep" or "move"
    ("reason", "S48"),
    ("rollout_time", "<f8"),      # smoothed stage times the decision was based on
    ("train_time", "<f8"),
    ("predicted_gain", "<f8"),    # seconds saved per iteration by the move (NaN if none)
    ("predicted_cost", "<f8"),    # seconds the move is predicted to cost
    ("attrs", f"S{ATTRS_BYTES}"),
])

METRIC_DTYPE = np.dtype([
    ("iteration", "<i4"),
    ("name", "S40"),              # e.g. train/kl_behaviour (dynaresize.analysis.metrics defines each)
    ("value", "<f8"),
])

DATASETS = {
    "events": EVENT_DTYPE,
    "iterations": ITERATION_DTYPE,
    "samples": SAMPLE_DTYPE,
    "decisions": DECISION_DTYPE,
    "metrics": METRIC_DTYPE,
}
ADDED_IN = {"metrics": 2}         # datasets newer than schema version 1


class TimelineError(ValueError):
    """A file that is not a readable timeline of this schema version."""


def encode_attrs(attrs: dict | None) -> bytes:
    """JSON-encode a small attribute dict into the fixed-size attrs column."""
    if not attrs:
        return b""
    raw = json.dumps(attrs, separators=(",", ":"), sort_keys=True).encode()
    if len(raw) > ATTRS_BYTES:
        raise ValueError(f"event attrs are {len(raw)} bytes, the schema allows {ATTRS_BYTES}: {raw[:80]!r}...")
    return raw


def decode_attrs(raw: bytes) -> dict:
    return json.loads(raw) if raw else {}


def dataset(f, name: str, fields: list[str] | None = None) -> np.ndarray:
    """Dataset `name` of an open, checked timeline file (only its `fields`, if given: a large run's
    events are mostly their attrs); empty if its schema version predates it."""
    if name not in f:
        empty = np.zeros(0, dtype=DATASETS[name])
        return empty[fields] if fields else empty
    return f[name].fields(fields)[...] if fields else f[name][...]


def rows(dtype: np.dtype, records: list[dict]) -> np.ndarray:
    """Build a structured array from dicts; missing numeric fields are 0, attrs are encoded."""
    out = np.zeros(len(records), dtype=dtype)
    if "critical" in dtype.names:
        out["critical"] = NOT_A_SWITCH
    for i, rec in enumerate(records):
        for key, value in rec.items():
            if key == "attrs":
                value = encode_attrs(value)
            elif isinstance(value, str):
                value = value.encode()
            out[key][i] = value
    return out


def check_file(f) -> None:
    """Raise TimelineError unless the open h5py file is a timeline of this schema version."""
    kind = f.attrs.get("kind")
    if isinstance(kind, bytes):
        kind = kind.decode()
    if kind != KIND:
        raise TimelineError(f"{f.filename} is not a DynaResize timeline (attribute kind={kind!r}, "
                            f"expected {KIND!r})")
    version = int(f.attrs.get("schema_version", -1))
    if version not in READABLE_VERSIONS:
        raise TimelineError(f"{f.filename} has timeline schema version {version}; this version of "
                            f"DynaResize reads versions {', '.join(map(str, READABLE_VERSIONS))}. Re-run the "
                            f"analysis with the DynaResize release that wrote it.")
    missing = [name for name in DATASETS if name not in f and ADDED_IN.get(name, 1) <= version]
    if missing:
        raise TimelineError(f"{f.filename} lacks datasets {missing}: the file is incomplete")
