"""Compare runs: one row per run, and the ratio of the best dynamic run to the best static run.

Runs are found in a Hydra multirun folder (numbered job folders 0/, 1/, ... each holding a
timeline.h5 and .hydra/overrides.yaml) or in any folder searched recursively for timeline.h5.
The policy name and the initial split come from each file's ``config`` attribute (keys
``policy.name`` and ``policy.train_ranks``). Runs are ranked by throughput (generated tokens
per second). Policy kinds: ``static``, ``oracle`` and ``scripted`` by name, ``colocated`` for
names starting with "coloc", anything else is ``dynamic`` (see metrics.policy_kind).
"""
from __future__ import annotations

import math
import os
from pathlib import Path

import pandas as pd

from dynaresize.timeline.schema import TimelineError

from .load import TIMELINE_FILE, load_timeline
from .metrics import run_metrics

COLUMNS = ["run", "policy", "kind", "split", "final_split", "tokens_per_s", "samples_per_s",
           "total_time_s", "iterations", "bubble_train", "bubble_rollout", "bubble_all",
           "resizes", "switch_ops", "switch_critical_s", "hidden_share", "mean_reward", "final_reward",
           "eval_reward", "eval_pass", "complete", "overrides", "path"]


def _natural_key(path: Path):
    return [(0, int(part), "") if part.isdigit() else (1, 0, part) for part in path.parts]


def find_timelines(root: str | os.PathLike) -> list[Path]:
    """Timeline files under `root` (itself if a file; its timeline.h5 if a run folder; else all
    timeline.h5 below it, job folders in numeric order)."""
    root = Path(root)
    if root.is_file():
        return [root]
    if (root / TIMELINE_FILE).is_file():
        return [root / TIMELINE_FILE]
    if not root.is_dir():
        raise TimelineError(f"{root}: no such file or folder")
    found, seen = [], set()
    for folder, subfolders, files in os.walk(root, followlinks=True):
        real = os.path.realpath(folder)
        if real in seen:                     # a symbolic link loop
            subfolders.clear()
            continue
        seen.add(real)
        if TIMELINE_FILE in files:
            found.append(Path(folder) / TIMELINE_FILE)
    found.sort(key=lambda p: _natural_key(p.relative_to(root)))
    if not found:
        raise TimelineError(f"{root} contains no {TIMELINE_FILE} (searched recursively)")
    return found


def hydra_overrides(timeline: Path) -> str:
    """The job's Hydra overrides (``.hydra/overrides.yaml`` beside the timeline), space separated."""
    path = Path(timeline).parent / ".hydra" / "overrides.yaml"
    if not path.is_file():
        return ""
    text = path.read_text()
    try:
        import yaml
    except ImportError:  # Hydra writes a block list of plain strings
        return " ".join(line.strip()[2:] for line in text.splitlines() if line.strip().startswith("- "))
    try:
        items = yaml.safe_load(text) or []
    except yaml.YAMLError:  # cosmetic: show the raw text
        return " ".join(text.split())
    return " ".join(str(item) for item in items) if isinstance(items, list) else str(items)


def compare(paths, errors: list | None = None) -> pd.DataFrame:
    """One row per run (columns COLUMNS), in the order found.

    Args:
        paths: a path or a list of paths; each is a timeline file, a run folder or a folder
            searched recursively (e.g. a Hydra multirun folder).
        errors: if a list is given, runs that cannot be read are skipped and ``(path, message)``
            is appended to it; otherwise the first such run raises TimelineError.
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    rows = []
    for root in paths:
        root = Path(root)
        base = root if root.is_dir() else root.parent
        for timeline in find_timelines(root):
            try:
                tl = load_timeline(timeline, event_attrs=False)
                m = run_metrics(tl)
            except TimelineError as e:
                if errors is None:
                    raise
                errors.append((str(timeline), str(e)))
                continue
            name = timeline.parent.relative_to(base).as_posix() if timeline.parent != base else tl.name
            m["run"] = name if name != "." else tl.name
            m["overrides"] = hydra_overrides(timeline)
            rows.append({c: m.get(c) for c in COLUMNS})
    df = pd.DataFrame(rows, columns=COLUMNS)
    swept = swept_overrides(df["overrides"])
    return pd.concat([df, swept], axis=1) if not swept.empty else df


def swept_overrides(overrides: pd.Series) -> pd.DataFrame:
    """The overrides that differ between the runs (a sweep's axes): one column per key, named
    `key=` (`+key=value` counts as key), holding the run's value, or "-" without one."""
    parsed = [dict(item.lstrip("+~").split("=", 1) for item in str(text).split() if "=" in item)
              for text in overrides]
    keys = list(dict.fromkeys(k for p in parsed for k in p))
    varying = [k for k in keys if len({p.get(k, "-") for p in parsed}) > 1]
    return pd.DataFrame({f"{k}=": [p.get(k, "-") for p in parsed] for k in varying}, index=overrides.index)


def _best(df: pd.DataFrame, kind: str):
    part = df[(df["kind"] == kind) & df["tokens_per_s"].notna()]
    return None if part.empty else part.loc[part["tokens_per_s"].idxmax()]


def ratios(df: pd.DataFrame) -> dict:
    """Throughput ratios of the best dynamic run (by tokens/s): to the best static run and to the
    best oracle run. Keys best_dynamic, best_static, best_oracle (run names or None),
    dynamic_vs_best_static, dynamic_vs_oracle (NaN when a side is missing)."""
    dyn, static, oracle = _best(df, "dynamic"), _best(df, "static"), _best(df, "oracle")

    def ratio(a, b):
        if a is None or b is None or not b["tokens_per_s"] > 0:
            return math.nan
        return float(a["tokens_per_s"] / b["tokens_per_s"])

    return {"best_dynamic": None if dyn is None else dyn["run"],
            "best_static": None if static is None else static["run"],
            "best_oracle": None if oracle is None else oracle["run"],
            "dynamic_vs_best_static": ratio(dyn, static),
            "dynamic_vs_oracle": ratio(dyn, oracle)}


def format_table(df: pd.DataFrame) -> str:
    """The comparison as a fixed-width text table: the swept overrides first, then the systems
    columns, then the RL's (the final reward, the last evaluation's)."""
    swept = [c for c in df.columns if c not in COLUMNS]
    shown = df[["run", *swept, "policy", "split", "final_split", "tokens_per_s", "samples_per_s",
                "total_time_s", "bubble_train", "bubble_rollout", "resizes", "switch_critical_s",
                "hidden_share", "final_reward", "eval_reward", "eval_pass"]].copy()

    def pct(x):
        return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.1f}%"

    shown = shown.rename(columns={"tokens_per_s": "tokens/s", "samples_per_s": "samples/s",
                                  "total_time_s": "time_s", "switch_critical_s": "crit_switch_s",
                                  "hidden_share": "hidden", "final_split": "final"})
    formatters = {"tokens/s": "{:.1f}".format, "samples/s": "{:.2f}".format,
                  "time_s": "{:.2f}".format, "crit_switch_s": "{:.2f}".format,
                  "bubble_train": pct, "bubble_rollout": pct, "hidden": pct,
                  "final_reward": "{:.3f}".format, "eval_reward": "{:.3f}".format, "eval_pass": pct}
    return shown.to_string(index=False, formatters=formatters, na_rep="-")
