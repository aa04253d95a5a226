"""Gantt chart of a run: ranks on y, time on x, colour by role and stage.

Each rank row shows, per iteration, a light tint of the rank's role over the whole span (so idle
time shows the role), the stage events on top in the upper part of the row, and switch
operations: a critical switch op (it blocked the next stage) fills the whole row height in red; a
background one is a hatched purple bar in the lower part of the row, under the stage it overlaps.
Dashed vertical lines mark iteration boundaries, numbered on the top axis.

Up to `max_rows` (64) ranks every event is drawn as a rectangle. Above that (or with very many
events) rows aggregate blocks of consecutive ranks and time is binned to the pixel columns: the
upper part of a row shows the dominant state of the block in that column (the stage that
occupies most GPU time, or idle tinted by the dominant role), the lower part is red where any
critical switch op runs and purple where any background one runs.

Drawing uses matplotlib's Agg canvas directly (no pyplot, no global backend change), so it
works headless.
"""
from __future__ import annotations

import json
import math
import os

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.collections import LineCollection, PolyCollection
from matplotlib.colors import to_rgba, to_rgba_array
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from dynaresize.timeline import schema

from .load import Timeline
from .metrics import attempts, rank_iterations, busy_segments, spans

STAGE_COLORS = {
    "rollout": "#1f77b4",
    "train": "#ff7f0e",
    "weight_sync": "#2ca02c",
    "exchange": "#8c8c8c",
    "steal": "#a65200",       # train work on a rank outside the train group (work stealing)
    "migrate": "#17becf",     # a rollout rank handing its last sequences to a tail rank
    "eval": "#bcbd22",        # generating for the held-out prompts (eval.every)
    "other": "#8c564b",       # schema.OTHER: startup, decide, checkpoint
}
ROLE_TINTS = {"rollout": "#d5e5f4", "train": "#fde2c4", "both": "#d7efd1", "none": "#eeeeee"}
CRITICAL_COLOR = "#d62728"
BACKGROUND_COLOR = "#9467bd"
OUTSIDE_COLOR = "#ffffff"

MAX_ROWS = 64
MAX_VECTOR_EVENTS = 20_000
MAX_BOUNDARY_LINES = 100
MAX_ITERATION_LABELS = 25

# Figure layout, inches.
_LEFT, _RIGHT, _TOP, _BOTTOM = 1.0, 0.3, 0.8, 1.15


def _stage_class(names) -> np.ndarray:
    """Map event names to the keys of STAGE_COLORS ("switch" for switch ops)."""
    names = np.asarray(names, dtype=object)
    out = np.full(len(names), "other", dtype=object)
    for stage in schema.STAGES:
        out[names == stage] = stage
    out[np.isin(names, schema.SWITCH_OPS)] = "switch"
    return out


def _event_class(names) -> np.ndarray:
    """_stage_class of an events["name"] column; categoricals are mapped once per category."""
    if hasattr(names, "cat"):
        classes = _stage_class(np.asarray(names.cat.categories, dtype=object))
        codes = names.cat.codes.to_numpy()
        return classes[codes] if len(classes) else np.full(len(codes), "other", dtype=object)
    return _stage_class(np.asarray(names, dtype=object))


def _time_range(tl: Timeline) -> tuple[float, float]:
    sp = spans(tl)
    if len(sp):
        t0, t1 = float(sp["start"].min()), float(sp["end"].max())
    elif len(tl.events):
        t0, t1 = float(tl.events["start"].min()), float(tl.events["end"].max())
    else:
        t0, t1 = 0.0, 1.0
    if not t1 > t0:
        t1 = t0 + 1.0
    return t0, t1


def gantt(tl: Timeline, path: str | os.PathLike | None = None, *, width: float = 16.0,
          height: float | None = None, dpi: int = 100, max_rows: int = MAX_ROWS,
          title: str | None = None) -> Figure:
    """Draw the Gantt chart of `tl`; save it as PNG to `path` if given; return the Figure.

    The image is exactly ``round(width * dpi)`` x ``round(height * dpi)`` pixels. `height`
    defaults to a size that fits the number of rows (4 to 12 inches plus the legend).
    """
    n_ranks = len(tl.ranks)
    block = max(1, math.ceil(n_ranks / max_rows))
    aggregate = block > 1 or len(tl.events) > MAX_VECTOR_EVENTS
    n_rows = math.ceil(n_ranks / block) if n_ranks else 1
    if height is None:
        height = min(12.0, max(3.0, 0.9 + 0.18 * n_rows)) + _TOP + _BOTTOM
    fig = Figure(figsize=(width, height), dpi=dpi)
    FigureCanvasAgg(fig)
    ax = fig.add_axes((_LEFT / width, _BOTTOM / height, 1 - (_LEFT + _RIGHT) / width,
                       1 - (_TOP + _BOTTOM) / height))
    t0, t1 = _time_range(tl)
    if aggregate:
        columns = max(16, int(round(ax.get_position().width * width * dpi)))
        _draw_binned(ax, tl, block, n_rows, t0, t1, columns)
    else:
        _draw_events(ax, tl)
    _draw_iterations(ax, tl, n_rows)
    _draw_attempts(ax, tl)

    ax.set_xlim(t0, t1)
    ax.set_ylim(n_rows - 0.5, -0.5)
    _rank_ticks(ax, tl.ranks, block, n_rows, _hosts(tl))
    ax.set_xlabel("time since job start [s]")
    ax.set_ylabel(("rank and host" if _hosts(tl) else "rank") if block == 1 else f"ranks (blocks of {block})")
    if title is None:
        title = (f"{tl.name}: policy {tl.policy}, {n_ranks} ranks, {len(spans(tl))} iterations"
                 + (f" (rows: blocks of {block} ranks, dominant state per pixel column)"
                    if block > 1 else " (binned to pixel columns)" if aggregate else ""))
    fig.suptitle(title, y=1 - 0.12 / height, fontsize=11)
    _legend(fig, height)
    if path is not None:
        fig.savefig(path, dpi=dpi, format="png")
    return fig


def _rects(x0, x1, y0, y1) -> np.ndarray:
    """Vertices of axis-aligned rectangles, shape (n, 4, 2)."""
    x0, x1, y0, y1 = (np.broadcast_to(np.asarray(v, dtype=float), np.shape(x0)) for v in (x0, x1, y0, y1))
    return np.stack([np.stack([x0, y0], -1), np.stack([x1, y0], -1),
                     np.stack([x1, y1], -1), np.stack([x0, y1], -1)], axis=1)


def _draw_events(ax, tl: Timeline) -> None:
    """One rectangle per event (few ranks and events)."""
    ri = rank_iterations(tl)
    sp = spans(tl).set_index("iteration")
    row_of = {int(r): i for i, r in enumerate(tl.ranks)}
    if len(ri):
        rows = ri["rank"].map(row_of).to_numpy(dtype=float)
        starts = sp.loc[ri["iteration"], "start"].to_numpy()
        ends = sp.loc[ri["iteration"], "end"].to_numpy()
        colors = [ROLE_TINTS.get(r, ROLE_TINTS["none"]) for r in ri["role"]]
        ax.add_collection(PolyCollection(_rects(starts, ends, rows - 0.46, rows + 0.46),
                                         facecolors=colors, edgecolors="none", zorder=1))
    ev = tl.events
    if not len(ev):
        return
    rows = ev["rank"].map(row_of).to_numpy(dtype=float)
    kind = _event_class(ev["name"])
    start, end = ev["start"].to_numpy(), ev["end"].to_numpy()
    crit = ev["critical"].to_numpy() == schema.CRITICAL
    stage = kind != "switch"
    ax.add_collection(PolyCollection(
        _rects(start[stage], end[stage], rows[stage] - 0.40, rows[stage] + 0.12),
        facecolors=[STAGE_COLORS[k] for k in kind[stage]], edgecolors="none", zorder=2))
    sw_crit = (kind == "switch") & crit
    ax.add_collection(PolyCollection(
        _rects(start[sw_crit], end[sw_crit], rows[sw_crit] - 0.44, rows[sw_crit] + 0.44),
        facecolors=CRITICAL_COLOR, edgecolors="black", linewidths=0.6, zorder=4))
    sw_bg = (kind == "switch") & ~crit
    ax.add_collection(PolyCollection(
        _rects(start[sw_bg], end[sw_bg], rows[sw_bg] + 0.16, rows[sw_bg] + 0.42),
        facecolors=to_rgba(BACKGROUND_COLOR, 0.35), edgecolors=BACKGROUND_COLOR,
        linewidths=0.6, hatch="////", zorder=3))


def occupancy(row: np.ndarray, start: np.ndarray, end: np.ndarray, n_rows: int, t0: float,
              t1: float, columns: int) -> np.ndarray:
    """Time covered by intervals in each (row, time column), shape (n_rows, columns).

    Overlapping intervals of one row add up. Vectorised: the covered time up to column edge k
    is G(k) = sum over interval ends p (+1 at a start, -1 at an end) of d * max(0, k - p), so
    with S1(k) = sum of d and S2(k) = sum of d * p over ends with p <= k, G(k) = k S1 - S2.
    """
    width = (t1 - t0) / columns
    a = np.clip((np.asarray(start, float) - t0) / width, 0, columns)
    b = np.clip((np.asarray(end, float) - t0) / width, 0, columns)
    keep = b > a
    row, a, b = np.asarray(row, np.int64)[keep], a[keep], b[keep]
    pos = np.concatenate([a, b])
    d = np.concatenate([np.ones(len(a)), -np.ones(len(b))])
    rows = np.concatenate([row, row])
    index = rows * (columns + 1) + np.ceil(pos).astype(np.int64)
    size = n_rows * (columns + 1)
    s1 = np.bincount(index, weights=d, minlength=size).reshape(n_rows, columns + 1).cumsum(1)
    s2 = np.bincount(index, weights=d * pos, minlength=size).reshape(n_rows, columns + 1).cumsum(1)
    g = np.arange(columns + 1) * s1 - s2
    return np.diff(g, axis=1) * width


def _draw_binned(ax, tl: Timeline, block: int, n_rows: int, t0: float, t1: float, columns: int) -> None:
    """Rows of `block` ranks, one image column per pixel column, dominant state per cell."""
    rank_row = {int(r): i // block for i, r in enumerate(tl.ranks)}
    ev = tl.events

    def occ(rows, start, end):
        return occupancy(rows, start, end, n_rows, t0, t1, columns)

    ev_rows = ev["rank"].map(rank_row).to_numpy(dtype=np.int64) if len(ev) else np.array([], np.int64)
    kind = _event_class(ev["name"])
    crit = ev["critical"].to_numpy() == schema.CRITICAL
    start, end = ev["start"].to_numpy(), ev["end"].to_numpy()
    stage_names = list(STAGE_COLORS)           # rollout, train, weight_sync, exchange, other
    stage_occ = [occ(ev_rows[kind == s], start[kind == s], end[kind == s]) for s in stage_names]
    sw_c = (kind == "switch") & crit
    sw_b = (kind == "switch") & ~crit
    crit_occ = occ(ev_rows[sw_c], start[sw_c], end[sw_c])
    bg_occ = occ(ev_rows[sw_b], start[sw_b], end[sw_b])

    # Idle: span time of the block's ranks not covered by busy segments, exchange or other.
    ri = rank_iterations(tl)
    sp = spans(tl).set_index("iteration")
    ri_rows = ri["rank"].map(rank_row).to_numpy(dtype=np.int64)
    ri_start = sp.loc[ri["iteration"], "start"].to_numpy() if len(ri) else np.array([])
    ri_end = sp.loc[ri["iteration"], "end"].to_numpy() if len(ri) else np.array([])
    roles = list(ROLE_TINTS)
    role_occ = np.stack([occ(ri_rows[(ri["role"] == r).to_numpy()],
                             ri_start[(ri["role"] == r).to_numpy()],
                             ri_end[(ri["role"] == r).to_numpy()]) for r in roles])
    seg = busy_segments(tl)
    busy_occ = occ(seg["rank"].map(rank_row).to_numpy(dtype=np.int64), seg["start"].to_numpy(),
                   seg["end"].to_numpy())
    idle_occ = np.maximum(role_occ.sum(0) - busy_occ - stage_occ[3] - stage_occ[4], 0.0)

    # Upper band: argmax over [idle, stages..., critical switch].
    candidates = np.stack([idle_occ] + stage_occ + [crit_occ])
    winner = candidates.argmax(0)
    palette = to_rgba_array([OUTSIDE_COLOR] + [STAGE_COLORS[s] for s in stage_names] + [CRITICAL_COLOR])
    upper = palette[winner]
    idle_tint = to_rgba_array([ROLE_TINTS[r] for r in roles])[role_occ.argmax(0)]
    upper[winner == 0] = idle_tint[winner == 0]
    nothing = candidates.sum(0) + role_occ.sum(0) <= 0
    upper[nothing] = to_rgba(OUTSIDE_COLOR)
    # Lower band: any critical switch op red, else any background one purple, else as above.
    lower = upper.copy()
    lower[bg_occ > 0] = to_rgba(BACKGROUND_COLOR)
    lower[crit_occ > 0] = to_rgba(CRITICAL_COLOR)
    image = np.concatenate([np.repeat(upper[:, None], 3, axis=1),
                            np.repeat(lower[:, None], 2, axis=1)], axis=1)
    image = image.reshape(n_rows * 5, columns, 4)
    ax.imshow(image, extent=(t0, t1, n_rows - 0.5, -0.5), aspect="auto",
              interpolation="nearest", zorder=1)


def _draw_iterations(ax, tl: Timeline, n_rows: int) -> None:
    sp = spans(tl)
    if not len(sp):
        return
    step = max(1, math.ceil(len(sp) / MAX_BOUNDARY_LINES))
    edges = sp["start"].to_numpy()[::step].tolist() + [float(sp["end"].iloc[-1])]
    ax.add_collection(LineCollection([[(x, -0.5), (x, n_rows - 0.5)] for x in edges],
                                     colors="black", linewidths=0.7, linestyles="--",
                                     alpha=0.55, zorder=5))
    label_step = max(1, math.ceil(len(sp) / MAX_ITERATION_LABELS))
    shown = sp.iloc[::label_step]
    top = ax.secondary_xaxis("top")
    top.set_xticks(((shown["start"] + shown["end"]) / 2).to_numpy(),
                   [str(i) for i in shown["iteration"]], fontsize=7)
    top.tick_params(length=0)
    top.set_xlabel("iteration" + (f" (boundaries of one in {step} drawn)" if step > 1 else ""),
                   fontsize=8)


def _draw_attempts(ax, tl: Timeline) -> None:
    """Each resumed attempt: the time it lost shaded, from the end of the iteration it resumed
    after to its start, and a label at its start."""
    for n, a in enumerate(attempts(tl).itertuples()):
        if a.lost_s == a.lost_s:            # not NaN: the iteration it resumed after is on the timeline
            ax.axvspan(a.start_s - a.lost_s, a.start_s, color="0.35", alpha=0.25, zorder=4, lw=0)
        ax.axvline(a.start_s, color="crimson", lw=1.2, zorder=6)
        ax.annotate(f"attempt {n + 2}", (a.start_s, 0), xycoords=("data", "axes fraction"), xytext=(3, 3),
                    textcoords="offset points", color="crimson", fontsize=8, zorder=7)


def _hosts(tl: Timeline) -> list[str]:
    """Each rank's host, when the job spans more than one (else empty: no host labels)."""
    try:
        hosts = json.loads(tl.attrs.get("hostnames") or "[]")
    except (TypeError, ValueError):
        return []
    return hosts if len(set(hosts)) > 1 else []


def _rank_ticks(ax, ranks: np.ndarray, block: int, n_rows: int, hosts: list[str]) -> None:
    step = max(1, math.ceil(n_rows / 32))
    rows = np.arange(0, n_rows, step)
    if block == 1:
        labels = [f"{int(ranks[r])} {hosts[int(ranks[r])]}" if int(ranks[r]) < len(hosts) else str(int(ranks[r]))
                  for r in rows]
    else:
        labels = [f"{int(ranks[r * block])}-{int(ranks[min(len(ranks), (r + 1) * block) - 1])}"
                  for r in rows]
    ax.set_yticks(rows, labels, fontsize=7 if n_rows > 16 else 9)


def _legend(fig, height: float) -> None:
    handles = [Patch(facecolor=STAGE_COLORS[s], label=s.replace("_", " ")) for s in STAGE_COLORS]
    handles[-1].set_label("other (startup, decide, checkpoint)")
    handles += [Patch(facecolor=CRITICAL_COLOR, edgecolor="black", label="switch op, critical"),
                Patch(facecolor=to_rgba(BACKGROUND_COLOR, 0.35), edgecolor=BACKGROUND_COLOR,
                      hatch="////", label="switch op, background")]
    handles += [Patch(facecolor=ROLE_TINTS[r], edgecolor="#bbbbbb", label=f"idle, {r} rank")
                for r in ("rollout", "train", "both")]
    fig.legend(handles=handles, loc="lower center", ncol=5, fontsize=8, frameon=False,
               bbox_to_anchor=(0.5, 0.02 / height))
