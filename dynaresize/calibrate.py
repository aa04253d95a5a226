"""`python -m dynaresize.calibrate`: fit a hardware profile's coefficients to real timelines.

    python -m dynaresize.calibrate RUN_DIR_OR_TIMELINE... --out conf/hardware/NAME.yaml [--name NAME]

Each stage of the cost model (dynaresize.costmodel) is linear in its coefficients, so each is fitted
by least squares on the events of that stage, with the work of every event rebuilt from the
timeline (samples rows: who generated what; the run config: batch shape):

  rollout   one row per (iteration, rank): duration vs groups, decode steps, tokens, KV tokens
  train     one row per iteration: the slowest train rank vs the busiest rank's micro-batches and
            tokens, and 1/k (iterations with a stage_in or reshard are left out: they may wait)
  weight_sync, exchange  one row per iteration (exchange: its shortest event, the last arrival's)
  staging   stage_out / stage_in per (iteration, rank): duration vs bytes
  switch ops, iteration overhead, start-up: medians

Residuals are relative (duration errors in %), coefficients are kept non-negative (a negative one
is dropped and the rest refitted), and rows whose residual is an outlier (beyond 4 robust standard
deviations: a rank descheduled on a shared machine) are dropped once and counted. Every fitted
value is printed with its standard error and the relative RMS residual of its stage, and written
to the YAML with the same note as its source. Terms a stage's data cannot separate are not fitted
(listed in the report): e.g. with one model the bytes of a weight sync never vary, so their cost
is part of the base.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
from dataclasses import dataclass, field

import numpy as np

from .hardware import Coefficients, HardwareProfile, load_profile
from .timeline import schema
from .timeline.reader import TIMELINE_FILE, read_arrays, resolve_path



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


def _cfg(run: Run, section: str, key: str, default):
    value = (run.config.get(section) or {}).get(key)
    return default if value is None else value


# ---------------------------------------------------------------------------------------------
# Least squares

@dataclass
class StageFit:
    stage: str
    names: list[str]                     # coefficient names (in the Coefficients section)
    values: dict[str, float] = field(default_factory=dict)
    stderr: dict[str, float] = field(default_factory=dict)
    rows: int = 0
    dropped: int = 0
    rel_rms: float = math.nan
    note: str = ""

    def source(self, name: str) -> str:
        se = self.stderr.get(name, math.nan)
        value = self.values.get(name, 0.0)
        rel = f", +-{100 * se / abs(value):.1f} %" if value and not math.isnan(se) else ""
        if not self.rows:
            return f"not fitted: {self.note}"
        clamped = ", clamped at 0 (the free fit is negative)" if self.rows and value == 0 else ""
        return f"fit: {self.stage}, {self.rows} rows, relative RMS residual {100 * self.rel_rms:.1f} %{rel}{clamped}"


def nnls_relative(X: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Non-negative least squares on relative residuals (rows weighted by 1/y).

    Returns (coefficients, their standard errors, relative residuals). Active set: a negative
    coefficient is fixed at 0 and the rest refitted.
    """
    w = 1.0 / np.maximum(y, 1e-12)
    Xw, yw = X * w[:, None], y * w
    active = list(range(X.shape[1]))
    beta = np.zeros(X.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(Xw[:, active], yw, rcond=None)
        if (sol >= 0).all():
            beta[:] = 0.0
            beta[active] = sol
            break
        active.pop(int(np.argmin(sol)))
    resid = (X @ beta - y) / np.maximum(y, 1e-12)
    stderr = np.full(X.shape[1], math.nan)
    n, p = len(y), len(active)
    if active and n > p:
        sigma2 = float((resid ** 2).sum()) / (n - p)
        try:
            cov = sigma2 * np.linalg.inv(Xw[:, active].T @ Xw[:, active])
            stderr[active] = np.sqrt(np.maximum(np.diag(cov), 0.0))
        except np.linalg.LinAlgError:
            pass
    return beta, stderr, resid


def fit_stage(stage: str, names: list[str], X: np.ndarray, y: np.ndarray, robust: bool = True) -> StageFit:
    out = StageFit(stage, names)
    X, y = np.asarray(X, dtype=np.float64), np.asarray(y, dtype=np.float64)
    ok = np.isfinite(y) & (y > 0) & np.isfinite(X).all(axis=1)
    X, y = X[ok], y[ok]
    if len(y) < len(names):
        out.note = f"{len(y)} rows for {len(names)} coefficients"
        return out
    beta, se, resid = nnls_relative(X, y)
    if robust and len(y) > 2 * len(names):
        mad = 1.4826 * float(np.median(np.abs(resid - np.median(resid))))
        keep = np.abs(resid) <= max(4 * mad, 0.02)
        if 0 < (~keep).sum() <= max(1, len(y) // 10) and keep.sum() > len(names):
            out.dropped = int((~keep).sum())
            X, y = X[keep], y[keep]
            beta, se, resid = nnls_relative(X, y)
    out.values = {n: float(b) for n, b in zip(names, beta)}
    out.stderr = {n: float(s) for n, s in zip(names, se)}
    out.rows = len(y)
    out.rel_rms = float(np.sqrt(np.mean(resid ** 2)))
    return out


def fit_median(stage: str, name: str, values) -> StageFit:
    out = StageFit(stage, [name])
    v = np.asarray([x for x in values if np.isfinite(x) and x >= 0], dtype=np.float64)
    if len(v) == 0:
        out.note = "no events"
        return out
    med = float(np.median(v))
    out.values = {name: med}
    out.stderr = {name: float(1.2533 * v.std() / math.sqrt(len(v))) if len(v) > 1 else math.nan}
    out.rows = len(v)
    out.rel_rms = float(np.sqrt(np.mean(((v - med) / med) ** 2))) if med > 0 else math.nan
    return out


# ---------------------------------------------------------------------------------------------
# Features rebuilt from timelines

def _xy(X: list, y: list) -> tuple[np.ndarray, np.ndarray]:
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
    return _xy(X, y)


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
        spp = int(_cfg(run, "rollout", "samples_per_prompt", 4))
        mbs = int(_cfg(run, "trainer", "micro_batch_size", 4))
        prompts = int(_cfg(run, "rollout", "prompts_per_batch", 8))
        n_mb = -(-prompts * spp // mbs)
        skip = _switch_iterations(run)
        for it in np.unique(ev["iteration"]):
            if int(it) in skip:
                continue
            part = ev[ev["iteration"] == it]
            part = part[np.argsort(part["rank"])]
            k = len(part)
            mb = np.array([len(range(i, n_mb, k)) for i in range(k)], dtype=np.float64)
            out.append((mb, part["tokens"].astype(np.float64), k, float(_dur(part).max())))
    return out


def fit_train(runs: list[Run]) -> StageFit:
    """The train stage: y = max over ranks of (per_micro_batch x mb + per_token x tokens) + base +
    per_inverse_rank / k. The busiest rank is picked by tokens, then by the fitted compute."""
    data = train_iterations(runs)
    names = ["base_s", "per_micro_batch_s", "per_token_s", "per_inverse_rank_s"]
    weights = (0.0, 1.0)                       # first pass: the rank with the most tokens
    fit = StageFit("train", names, note="no train events")
    for _ in range(3):
        X, y = [], []
        for mb, tok, k, dur in data:
            i = int(np.argmax(weights[0] * mb + weights[1] * tok))
            X.append([1.0, mb[i], tok[i], 1.0 / k])
            y.append(dur)
        X, y = _xy(X, y)
        fit = fit_stage("train", names, X, y)
        if not fit.rows:
            break
        weights = (fit.values["per_micro_batch_s"], fit.values["per_token_s"])
    return fit


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
    return _xy(X, y)


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
    return _xy(X, y)


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
    return _xy(X, y)


def op_durations(runs, name: str, role: str | None = None, per_iteration_min: bool = False,
                 restored: bool | None = None) -> list[float]:
    """Durations of critical `name` events (all events for startup); `restored`: only engine
    starts that did (True) or did not (False) restore the rank's released engine - colocated
    restores and parked engines (attrs "restored") under rollout.release=sleep."""
    vals = []
    for run in runs:
        ev = _named(run, name)
        if restored is not None:
            sleep = _cfg(run, "rollout", "release", "sleep") == "sleep"
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


# ---------------------------------------------------------------------------------------------
# The whole fit

@dataclass
class Calibration:
    coefficients: Coefficients
    fits: dict[str, StageFit]
    batching: str
    runs: list[str]
    fitted_params: float
    unfitted: list[str]


ROLLOUT_NAMES = {"sequential": ["base_s", "per_group_s", "per_step_s", "per_kv_token_s"],
                 "continuous": ["base_s", "per_step_s", "per_token_s", "per_kv_token_s", "per_prompt_token_s"]}


def calibrate(paths, batching: str | None = None, base: HardwareProfile | None = None) -> Calibration:
    runs = [load_run(p) for p in paths]
    if not runs:
        raise ValueError("calibrate: no timeline given")
    if batching is None:
        engines = {_cfg(r, "rollout", "engine", "torch") for r in runs}
        batching = "continuous" if engines == {"vllm"} else "sequential"
    coef = base.coefficients if (base is not None and base.coefficients is not None) else Coefficients()
    coef = Coefficients.from_dict(coef.to_dict())
    fits: dict[str, StageFit] = {}

    def apply(section: str, fit: StageFit):
        fits[f"{section}:{','.join(fit.names)}"] = fit
        sec = getattr(coef, section)
        for name, value in fit.values.items():
            setattr(sec, name, value)

    X, y = rollout_rows(runs, batching)
    apply("rollout", fit_stage("rollout", ROLLOUT_NAMES[batching], X, y))
    apply("train", fit_train(runs))
    X, y = sync_rows(runs)
    apply("sync", fit_stage("weight_sync", ["base_s", "latency_s"], X, y))
    X, y = exchange_rows(runs)
    apply("exchange", fit_stage("exchange", ["base_s", "per_token_s"], X, y))
    X, y = staging_rows(runs, "stage_out")
    apply("staging", fit_stage("stage_out", ["write_base_s", "write_per_byte_s"], X, y))
    X, y = staging_rows(runs, "stage_in")
    apply("staging", fit_stage("stage_in", ["read_base_s", "read_per_byte_s"], X, y))
    commits = []
    for run in runs:     # the cost model adds the collective latency per log2(world) step
        steps = math.ceil(math.log2(max(int(run.attrs.get("world_size", 1)), 1)))
        commits += [d - coef.sync.latency_s * steps for d in op_durations([run], "commit", per_iteration_min=True)]
    apply("ops", fit_median("commit", "commit_s", commits))
    apply("ops", fit_median("group_switch", "group_switch_s", op_durations(runs, "group_switch")))
    apply("ops", fit_median("release", "release_s", op_durations(runs, "release")))
    apply("ops", fit_median("engine_start", "engine_start_s", op_durations(runs, "engine_start", restored=False)))
    apply("ops", fit_median("engine_start (restore)", "engine_wake_s", op_durations(runs, "engine_start", restored=True)))
    local = op_durations(runs, "weight_load", role="rollout") + op_durations(runs, "weight_load", role="both")
    apply("ops", fit_median("weight_load (local)", "weight_load_local_s", local))
    apply("run", fit_median("iteration end", "iteration_overhead_s", overhead_values(runs)))
    apply("run", fit_median("startup", "startup_s", op_durations(runs, "startup")))
    # A fitted sync folds the weight-load of new train ranks' broadcasts and engine loads into its
    # base; exchange latency and per-byte terms need runs of several sizes/models to separate.
    unfitted = ["rollout.per_token_s and per_prompt_token_s (sequential batching: collinear with steps and groups)"
                if batching == "sequential" else "rollout.per_group_s",
                "train latency and per-byte terms (one model: part of base_s and per_inverse_rank_s)",
                "sync per-byte and load terms (one model: part of base_s)",
                "exchange.latency_s (one world size)", "ops.weight_load_local_per_byte_s (one model)",
                "ops.drain_s (no such op in the runtime yet)"]
    params = [float(r.attrs.get("parameters", 0) or 0) for r in runs]
    return Calibration(coef, fits, batching, [r.label for r in runs], max(params) if params else 0.0, unfitted)


def report(cal: Calibration) -> str:
    lines = [f"calibration from {len(cal.runs)} timelines ({', '.join(cal.runs)}), {cal.batching} batching",
             f"{'stage':<26}{'coefficient':<26}{'value':>12}{'std err':>11}{'rows':>7}{'dropped':>8}{'rel RMS':>9}"]
    for fit in cal.fits.values():
        for name in fit.names:
            if fit.rows == 0:
                lines.append(f"{fit.stage:<26}{name:<26}{'-':>12}{'':>11}{0:>7}{'':>8}{'':>9}  not fitted: {fit.note}")
                continue
            v, se = fit.values.get(name, 0.0), fit.stderr.get(name, math.nan)
            rel = f"{100 * se / v:.0f}%" if v > 0 and not math.isnan(se) else "-"
            lines.append(f"{fit.stage:<26}{name:<26}{v:>12.4g}{rel:>11}{fit.rows:>7}{fit.dropped:>8}"
                         f"{100 * fit.rel_rms:>8.1f}%")
    lines.append("not fitted (kept from the base profile or 0): " + "; ".join(cal.unfitted))
    return "\n".join(lines)


def profile_yaml(cal: Calibration, name: str, description: str = "", command: str = "") -> str:
    """The fitted profile as YAML, each coefficient with its fit as a comment."""
    sources: dict[str, str] = {}
    for key, fit in cal.fits.items():
        section = key.split(":")[0]
        for n in fit.names:
            sources[f"{section}.{n}"] = fit.source(n)
    today = datetime.date.today().isoformat()
    out = [f"# Fitted by `python -m dynaresize.calibrate{(' ' + command) if command else ''}` on {today}",
           f"# from the timelines of {len(cal.runs)} runs ({', '.join(cal.runs)}).",
           "# Each coefficient's source is its fit: the stage, the rows (events or iterations) it was",
           "# fitted on, the relative RMS residual of that stage's durations and the coefficient's",
           "# relative standard error. Values without a fit note were not fitted (see `fit.unfitted`).",
           f"name: {name}",
           "kind: fitted",
           f"description: {json.dumps(description or 'fitted from real timelines')}",
           f"batching: {cal.batching}              # fit: the runs' rollout engine",
           "gpus_per_node: 0                  # fit: every rank of the fitted runs ran on one host",
           "time_scale: 1.0                   # not a hardware figure: 1 = as fitted",
           f"fitted_params: {int(cal.fitted_params)}             # fit: parameters of the model the runs trained",
           "model: null                       # the job's own model (the fitted one)",
           "coefficients:"]
    for section, values in cal.coefficients.to_dict().items():
        out.append(f"  {section}:")
        for key, value in values.items():
            note = sources.get(f"{section}.{key}", "not fitted")
            out.append(f"    {key}: {value:.6g}".ljust(44) + f"# {note}")
    out.append("fit:")
    for key, fit in cal.fits.items():
        out.append(f"  {fit.stage.replace(' ', '_').replace('(', '').replace(')', '')}: "
                   f"{{rows: {fit.rows}, dropped: {fit.dropped}, relative_rms: "
                   f"{'.nan' if math.isnan(fit.rel_rms) else round(fit.rel_rms, 4)}}}")
    out.append("  runs: [" + ", ".join(cal.runs) + "]")
    out.append("  unfitted:")
    out += [f"    - \"{u}\"" for u in cal.unfitted]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dynaresize.calibrate",
                                description="Fit a hardware profile (dynaresize.hardware) to real timelines.")
    p.add_argument("paths", nargs="+", help="run folders or timeline.h5 files")
    p.add_argument("--out", help="YAML file to write (e.g. conf/hardware/cpu_tiny.yaml)")
    p.add_argument("--name", help="profile name (default: the --out file's stem)")
    p.add_argument("--description", default="")
    p.add_argument("--batching", choices=("sequential", "continuous"),
                   help="rollout batching of the runs' engine (default: from rollout.engine)")
    p.add_argument("--base", help="profile whose coefficients fill what cannot be fitted")
    args = p.parse_args(argv)
    try:
        base = load_profile(args.base) if args.base else None
        cal = calibrate(args.paths, args.batching, base)
    except (schema.TimelineError, ValueError, OSError) as e:
        print(f"calibrate: error: {e}", file=sys.stderr)
        return 2
    print(report(cal))
    if args.out:
        name = args.name or os.path.splitext(os.path.basename(args.out))[0]
        shown = os.path.relpath(args.out)
        shown = shown if not shown.startswith("..") else os.path.basename(args.out)
        command = " ".join(cal.runs) + f" --out {shown}"     # run folder names: no machine paths
        text = profile_yaml(cal, name, args.description, command)
        HardwareProfile.from_dict(__import__("yaml").safe_load(text))     # it must load back
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text)
        print(f"profile written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
