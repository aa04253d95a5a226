"""The rows `dynaresize.plan.calibrate` fits: each stage's events read from real timelines, with the
work of every event rebuilt from the samples rows (who generated what) and the run config (batch
shape). h5py and numpy only. One function per stage returns (features X, durations y), or, for the
switch operations and the iteration overhead, the durations whose median is the coefficient.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import numpy as np

from ..timeline import schema
from ..timeline.reader import TIMELINE_FILE, read_arrays, resolve_path

# ---------------------------------------------------------------------------------------------
# Reading timelines (h5py and numpy only)

@dataclass
class Run:
    path: str
    attrs: dict
    config: dict
    events: np.ndarray
    iterations: np.ndarray
    samples: np.ndarray

    @property
    def label(self) -> str:
        """A short name (the run folder's), never an absolute path."""
        p = os.path.abspath(self.path)
        folder = os.path.dirname(p) if os.path.basename(p) == TIMELINE_FILE else p
        return os.path.basename(folder) or os.path.basename(p)


def load_run(path: str) -> Run:
    import yaml
    path = str(resolve_path(path))
    attrs, data = read_arrays(path, ("events", "iterations", "samples"), swmr=True)
    config = yaml.safe_load(attrs.get("config") or "") or {}
    return Run(path, attrs, config, data["events"], data["iterations"], data["samples"])


def run_config(run: Run, section: str, key: str, default):
    """A value of the run's config (its section, key), or `default` where the run did not set it."""
    value = (run.config.get(section) or {}).get(key)
    return default if value is None else value


def as_xy(X: list, y: list) -> tuple[np.ndarray, np.ndarray]:
    cols = len(X[0]) if X else 1
    return np.asarray(X, dtype=np.float64).reshape(len(X), cols), np.asarray(y, dtype=np.float64)


def _dur(ev: np.ndarray) -> np.ndarray:
    return ev["end"] - ev["start"]


def _named(run: Run, name: str) -> np.ndarray:
    return run.events[run.events["name"] == name.encode()]


def rollout_rows(runs: list[Run], batching: str) -> tuple[np.ndarray, np.ndarray]:
    """Per (iteration, rank) rollout event: features (see costmodel.rollout_features) and duration."""
    X, y = [], []
    for run in runs:
        ev = _named(run, "rollout")
        s = run.samples
        if len(ev) == 0 or len(s) == 0:
            continue
        lens = s["response_len"].astype(np.float64)
        plen = s["prompt_len"].astype(np.float64)
        # one group = (iteration, rank, prompt)
        gkey = np.stack([s["iteration"], s["rank"], s["prompt"]], axis=1)
        groups, ginv = np.unique(gkey, axis=0, return_inverse=True)
        ginv = ginv.reshape(-1)
        glongest = np.zeros(len(groups))
        np.maximum.at(glongest, ginv, lens)
        gtokens = np.bincount(ginv, weights=lens, minlength=len(groups))
        gkv = np.bincount(ginv, weights=plen * lens + lens * (lens - 1) / 2, minlength=len(groups))
        gprompt = np.bincount(ginv, weights=plen, minlength=len(groups))
        rkey, rinv = np.unique(groups[:, :2], axis=0, return_inverse=True)
        rinv = rinv.reshape(-1)
        n = len(rkey)
        feats = {
            "groups": np.bincount(rinv, minlength=n).astype(np.float64),
            "steps_seq": np.bincount(rinv, weights=glongest, minlength=n),
            "tokens": np.bincount(rinv, weights=gtokens, minlength=n),
            "kv": np.bincount(rinv, weights=gkv, minlength=n),
            "prompt_tokens": np.bincount(rinv, weights=gprompt, minlength=n),
        }
        longest = np.zeros(n)
        np.maximum.at(longest, rinv, glongest)
        feats["steps_cont"] = longest
        index = {(int(a), int(b)): i for i, (a, b) in enumerate(rkey)}
        for e, d in zip(ev, _dur(ev)):
            i = index.get((int(e["iteration"]), int(e["rank"])))
            if i is None:
                continue
            f = {k: v[i] for k, v in feats.items()}
            if batching == "sequential":
                X.append([1.0, f["groups"], f["steps_seq"], f["kv"]])
            else:
                X.append([1.0, f["steps_cont"], f["tokens"], f["kv"], f["prompt_tokens"]])
            y.append(d)
    return as_xy(X, y)


def _switch_iterations(run: Run, names=("stage_in", "reshard")) -> set[int]:
    ev = run.events
    mask = np.isin(ev["name"], [n.encode() for n in names])
    return set(int(i) for i in np.unique(ev["iteration"][mask]))


def train_iterations(runs: list[Run]) -> list[tuple[np.ndarray, np.ndarray, int, float]]:
    """Per iteration with training: (micro-batches of each train rank, its tokens, k, the stage
    time = the slowest rank's train event). Iterations with a stage_in or reshard are left out."""
    out = []
    for run in runs:
        ev = _named(run, "train")
        if len(ev) == 0:
            continue
        spp = int(run_config(run, "rollout", "samples_per_prompt", 4))
        mbs = int(run_config(run, "trainer", "micro_batch_size", 4))
        prompts = int(run_config(run, "rollout", "prompts_per_batch", 8))
        n_mb = -(-prompts * spp // mbs)
        skip = _switch_iterations(run)
        for it in np.unique(ev["iteration"]):
            if int(it) in skip:
                continue
            part = ev[ev["iteration"] == it]
            part = part[np.argsort(part["rank"])]
            k = len(part)
            counts = [json.loads(a or b"{}").get("micro_batches") for a in part["attrs"]]
            mb = (np.array(counts, dtype=np.float64) if None not in counts   # as recorded
                  else np.array([len(range(i, n_mb, k)) for i in range(k)], dtype=np.float64))  # older files
            out.append((mb, part["tokens"].astype(np.float64), k, float(_dur(part).max())))
    return out


def per_iteration(runs: list[Run], name: str) -> list[tuple[Run, int, np.ndarray]]:
    out = []
    for run in runs:
        ev = _named(run, name)
        for it in np.unique(ev["iteration"]):
            out.append((run, int(it), ev[ev["iteration"] == it]))
    return out


def sync_rows(runs):
    X, y = [], []
    for run, it, part in per_iteration(runs, "weight_sync"):
        X.append([1.0, math.ceil(math.log2(max(len(part), 1)))])
        y.append(float(np.median(_dur(part))))
    return as_xy(X, y)


def exchange_rows(runs):
    X, y = [], []
    for run in runs:
        s = run.samples
        tok = {}
        if len(s):
            its = s["iteration"]
            weights = (s["prompt_len"].astype(np.float64) + s["response_len"].astype(np.float64))
            uniq, inv = np.unique(its, return_inverse=True)
            sums = np.bincount(inv.reshape(-1), weights=weights)
            tok = {int(a): float(b) for a, b in zip(uniq, sums)}
        ev = _named(run, "exchange")
        for it in np.unique(ev["iteration"]):
            part = ev[ev["iteration"] == it]
            X.append([1.0, tok.get(int(it), 0.0)])
            y.append(float(_dur(part).min()))
    return as_xy(X, y)


def _summed(run: Run, name: str) -> list[tuple[int, int, float, float, float]]:
    """(iteration, rank, total duration, bytes, first start) of an op split into parts."""
    ev = _named(run, name)
    out = {}
    for e in ev:
        key = (int(e["iteration"]), int(e["rank"]))
        d, b, s = out.get(key, (0.0, 0.0, math.inf))
        out[key] = (d + float(e["end"] - e["start"]), b + float(e["bytes"]), min(s, float(e["start"])))
    return [(it, r, d, b, s) for (it, r), (d, b, s) in out.items()]


def staging_rows(runs, name: str):
    """stage_out: duration vs bytes (parts of a split op summed). stage_in: from the later of its
    start and the end of its old owners' stage_out (it waits for their files) to its end."""
    X, y = [], []
    for run in runs:
        outs = {(it, r): (d, b, st) for it, r, d, b, st in _summed(run, "stage_out")}
        ends = {}
        for e in _named(run, "stage_out"):
            key = (int(e["iteration"]), int(e["rank"]))
            ends[key] = max(ends.get(key, -math.inf), float(e["end"]))
        if name == "stage_out":
            for (it, r), (d, b, st) in outs.items():
                if b > 0:
                    X.append([1.0, b])
                    y.append(d)
            continue
        splits = {int(row["iteration"]): int(row["train_ranks"]) for row in run.iterations}
        numel = int(run.attrs.get("parameters", 0) or 0)
        ins = _named(run, "stage_in")
        for it, r, d, b, st in _summed(run, "stage_in"):
            k, k2 = splits.get(it - 1), splits.get(it)
            if not (k and k2 and numel and b > 0):
                continue
            size_old, size_new = -(-numel // k), -(-numel // k2)
            lo, hi = min(r * size_new, numel), min((r + 1) * size_new, numel)
            owners = range(lo // size_old, min(max(hi - 1, lo) // size_old, k - 1) + 1)
            ready = max((ends.get((it, q), -math.inf) for q in owners), default=-math.inf)
            mine = ins[(ins["iteration"] == it) & (ins["rank"] == r)]
            end = float(mine["end"].max())
            X.append([1.0, b])
            y.append(end - max(st, ready))
    return as_xy(X, y)


def op_durations(runs, name: str, role: str | None = None, per_iteration_min: bool = False,
                 restored: bool | None = None) -> list[float]:
    """Durations of critical `name` events (all events for startup); `restored`: only engine
    starts that did (True) or did not (False) restore the rank's released engine - colocated
    restores and parked engines (attrs "restored") under rollout.release=sleep."""
    vals = []
    for run in runs:
        ev = _named(run, name)
        if restored is not None:
            sleep = run_config(run, "rollout", "release", "sleep") == "sleep"
            mask = (ev["role"] == b"both") | np.array([b'"restored":true' in a for a in ev["attrs"]], dtype=bool)
            ev = ev[mask & sleep] if restored else ev[~(mask & sleep)]
        if role is not None:
            ev = ev[ev["role"] == role.encode()]
        if per_iteration_min:
            for it in np.unique(ev["iteration"]):
                vals.append(float(_dur(ev[ev["iteration"] == it]).min()))
        elif name == "startup":
            vals += [float(d) for d in _dur(ev)]
        else:
            vals += [float(d) for d in _dur(ev[ev["critical"] == schema.CRITICAL])]
    return vals


def overhead_values(runs) -> list[float]:
    vals = []
    for run in runs:
        ev = run.events
        for row in run.iterations:
            part = ev[ev["iteration"] == row["iteration"]]
            if len(part):
                vals.append(max(float(row["end"] - part["end"].max()), 0.0))
    return vals
