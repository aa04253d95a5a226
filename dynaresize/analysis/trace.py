"""Chrome trace event format (JSON) of a run, for Perfetto (ui.perfetto.dev) or chrome://tracing.

Layout:
  * one process per rank: ``pid = rank``, named "rank N" (``process_name`` metadata) and sorted
    by rank;
  * one track (``tid``) per stage type within each process, named by ``thread_name`` metadata:
    ``busy`` (tid 0), ``rollout`` 1, ``train`` 2, ``weight_sync`` 3, ``exchange`` 4,
    ``switch (critical)`` 5, ``switch (background)`` 6, ``other`` 7. Events of one type that
    overlap on one rank go to extra lanes (tid + 100 x lane) so no slice is cut;
  * every event is an ``"X"`` (complete) event with ``ts`` and ``dur`` in microseconds since job
    start, category ``stage``, ``switch`` or ``other``, and args iteration, role, tokens, bytes,
    critical and the event's attrs;
  * the ``busy`` track holds the merged busy intervals of each rank in each iteration (category
    ``busy``, see dynaresize.analysis.metrics): the durations of a rank's busy events sum to its busy time;
  * iteration starts are global instant events (``"ph": "i", "s": "g"``).
"""
from __future__ import annotations

import json
import os
from typing import Iterator

import numpy as np
import pandas as pd

from dynaresize.timeline import schema

from .load import Timeline
from .metrics import busy_segments, spans



def _us(start, end) -> tuple[list, list]:
    """ts and dur in microseconds, quantised to whole nanoseconds so that consecutive events
    that touch do not overlap by a rounding error (Perfetto needs slices on a track to nest)."""
    ts = np.rint(np.asarray(start, dtype=np.float64) * 1e9).astype(np.int64)
    stop = np.rint(np.asarray(end, dtype=np.float64) * 1e9).astype(np.int64)
    return (ts / 1000).tolist(), (np.maximum(stop - ts, 0) / 1000).tolist()

TRACKS = {  # tid -> track name
    0: "busy",
    1: "rollout",
    2: "train",
    3: "weight_sync",
    4: "exchange",
    5: "switch (critical)",
    6: "switch (background)",
    7: "other",
    8: "eval",
}
_STAGE_TID = {"rollout": 1, "train": 2, "weight_sync": 3, "exchange": 4, "eval": 8}
LANE_STRIDE = 100


def _tids(names: np.ndarray, critical: np.ndarray) -> np.ndarray:
    tid = np.full(len(names), 7, dtype=np.int64)
    for name, t in _STAGE_TID.items():
        tid[names == name] = t
    switch = np.isin(names, schema.SWITCH_OPS)
    tid[switch & (critical == schema.CRITICAL)] = 5
    tid[switch & (critical != schema.CRITICAL)] = 6
    return tid


def _lanes(rank: np.ndarray, tid: np.ndarray, start: np.ndarray, end: np.ndarray) -> np.ndarray:
    """Lane of each event so that events on one (rank, tid, lane) do not overlap."""
    lane = np.zeros(len(rank), dtype=np.int64)
    if not len(rank):
        return lane
    order = np.lexsort((start, tid, rank))
    r, t, s, e = rank[order], tid[order], start[order], end[order]
    same = np.zeros(len(r), dtype=bool)
    same[1:] = (r[1:] == r[:-1]) & (t[1:] == t[:-1])
    group_id = np.cumsum(~same) - 1
    reach = pd.Series(e).groupby(group_id, sort=False).cummax().to_numpy()  # latest end so far
    overlap = np.zeros(len(r), dtype=bool)
    overlap[1:] = same[1:] & (s[1:] < reach[:-1])
    bounds = np.append(np.flatnonzero(~same), len(r))
    for g in np.unique(group_id[overlap]):        # greedy lanes only where something overlaps
        lane_end: list[float] = []
        for i in range(bounds[g], bounds[g + 1]):
            for k, free_at in enumerate(lane_end):
                if s[i] >= free_at:
                    lane_end[k] = e[i]
                    lane[order[i]] = k
                    break
            else:
                lane_end.append(e[i])
                lane[order[i]] = len(lane_end) - 1
    return lane


def _select(frame, iterations):
    if iterations is None:
        return frame
    first, last = iterations
    it = frame["iteration"]
    return frame[(it >= first) & (it <= last)]


def trace_events(tl: Timeline, iterations: tuple[int, int] | None = None) -> Iterator[dict]:
    """The trace events of `tl`, one dict at a time (metadata first); with `iterations` =
    (first, last), only events of those iterations (inclusive)."""
    ev = _select(tl.events, iterations)
    names = ev["name"].astype(str).to_numpy(dtype=object) if len(ev) else np.array([], object)
    critical = ev["critical"].to_numpy()
    rank = ev["rank"].to_numpy().astype(np.int64)
    start, end = ev["start"].to_numpy(), ev["end"].to_numpy()
    tid = _tids(names, critical)
    tid = tid + LANE_STRIDE * _lanes(rank, tid, start, end)

    used = {}
    for r, t in set(zip(rank.tolist(), tid.tolist())):
        used.setdefault(r, set()).add(t)
    seg = _select(busy_segments(tl), iterations)
    for r in seg["rank"].unique().tolist():
        used.setdefault(int(r), set()).add(0)
    for r in tl.ranks.tolist():
        yield {"ph": "M", "name": "process_name", "pid": r, "tid": 0, "args": {"name": f"rank {r}"}}
        yield {"ph": "M", "name": "process_sort_index", "pid": r, "tid": 0, "args": {"sort_index": r}}
        for t in sorted(used.get(r, ())):
            base, lane = t % LANE_STRIDE, t // LANE_STRIDE
            label = TRACKS[base] + (f" #{lane + 1}" if lane else "")
            yield {"ph": "M", "name": "thread_name", "pid": r, "tid": t, "args": {"name": label}}
            yield {"ph": "M", "name": "thread_sort_index", "pid": r, "tid": t, "args": {"sort_index": t}}

    sp = _select(spans(tl), iterations)
    for i, ts in zip(sp["iteration"].tolist(), _us(sp["start"], sp["end"])[0]):
        yield {"ph": "i", "s": "g", "name": f"iteration {i}", "cat": "iteration", "pid": 0,
               "tid": 0, "ts": ts, "args": {"iteration": i}}

    ts, dur = _us(seg["start"], seg["end"])
    for i, r, t0, d in zip(seg["iteration"].tolist(), seg["rank"].tolist(), ts, dur):
        yield {"ph": "X", "name": "busy", "cat": "busy", "pid": r, "tid": 0, "ts": t0, "dur": d,
               "args": {"iteration": i}}

    category = np.where(np.isin(names, schema.SWITCH_OPS), "switch",
                        np.where(np.isin(names, schema.STAGES), "stage", "other"))
    attrs = ev["attrs"].tolist() if "attrs" in ev.columns else [""] * len(ev)
    ts, dur = _us(start, end)
    columns = zip(names.tolist(), category.tolist(), rank.tolist(), tid.tolist(), ts, dur,
                  ev["iteration"].tolist(), ev["role"].astype(str).tolist(),
                  ev["tokens"].tolist(), ev["bytes"].tolist(), critical.tolist(), attrs)
    for name, cat, r, t, t0, d, it, role, tokens, nbytes, crit, raw in columns:
        args = {"iteration": it, "role": role, "tokens": tokens, "bytes": nbytes}
        if cat == "switch":
            args["critical"] = bool(crit == schema.CRITICAL)
        if raw:
            try:
                args["attrs"] = schema.decode_attrs(raw.encode())
            except ValueError:
                args["attrs"] = raw
        yield {"ph": "X", "name": name, "cat": cat, "pid": r, "tid": t, "ts": t0, "dur": d,
               "args": args}


def _metadata(tl: Timeline) -> dict:
    return {"run": tl.name, "policy": tl.policy, "world_size": tl.world_size,
            "schema_version": schema.SCHEMA_VERSION, "time_unit": "microseconds since job start"}


def perfetto_trace(tl: Timeline, iterations: tuple[int, int] | None = None) -> dict:
    """The trace as a dict: ``{"traceEvents": [...], "displayTimeUnit": "ms", "otherData": ...}``
    (`json.dump` it). `iterations` = (first, last) limits it to those iterations."""
    return {"traceEvents": list(trace_events(tl, iterations)), "displayTimeUnit": "ms",
            "otherData": _metadata(tl)}


def write_trace(tl: Timeline, path: str | os.PathLike,
                iterations: tuple[int, int] | None = None) -> None:
    """Write the trace JSON to `path`, one event at a time (no full copy in memory).
    Large runs give large files (about 220 bytes an event): limit them with `iterations`."""
    with open(path, "w") as f:
        f.write('{"displayTimeUnit": "ms", "otherData": ')
        json.dump(_metadata(tl), f)
        f.write(', "traceEvents": [\n')
        first = True
        for event in trace_events(tl, iterations):
            if not first:
                f.write(",\n")
            f.write(json.dumps(event, separators=(",", ":")))
            first = False
        f.write("\n]}\n")
