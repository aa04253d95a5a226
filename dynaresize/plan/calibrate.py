"""`python -m dynaresize.plan.calibrate`: fit a hardware profile's coefficients to real timelines.

    python -m dynaresize.plan.calibrate RUN_DIR_OR_TIMELINE... --out dynaresize/conf/hardware/NAME.yaml [--name NAME]

Each stage of the cost model (dynaresize.plan.costmodel) is linear in its coefficients, so each is fitted
by least squares on the events of that stage, with the work of every event rebuilt from the
timeline (samples rows: who generated what; the run config: batch shape; dynaresize.plan.calibration_rows):

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

from .calibration_rows import (Run, as_xy, exchange_rows, load_run, op_durations, overhead_values,
                               rollout_rows, run_config, staging_rows, sync_rows, train_iterations)
from .hardware import Coefficients, HardwareProfile, load_profile
from ..timeline import schema


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
        X, y = as_xy(X, y)
        fit = fit_stage("train", names, X, y)
        if not fit.rows:
            break
        weights = (fit.values["per_micro_batch_s"], fit.values["per_token_s"])
    return fit


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
        engines = {run_config(r, "rollout", "engine", "torch") for r in runs}
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
    out = [f"# Fitted by `python -m dynaresize.plan.calibrate{(' ' + command) if command else ''}` on {today}",
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
    p = argparse.ArgumentParser(prog="python -m dynaresize.plan.calibrate",
                                description="Fit a hardware profile (dynaresize.plan.hardware) to real timelines.")
    p.add_argument("paths", nargs="+", help="run folders or timeline.h5 files")
    p.add_argument("--out", help="YAML file to write (e.g. dynaresize/conf/hardware/cpu_tiny.yaml)")
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
