"""Run an experiment's policy sweep in simulation and compare the runs.

    python -m dynaresize.sim.experiment seed_comparison --ranks 64 [--out DIR] [OVERRIDE ...]

Four Hydra multiruns of the simulator into one sweep folder (one sub-folder per run):

    static_N    policy=static, every split: sim.train_units=1..units-1 (policy.resize_unit = ranks/units)
    dynamic     policy=dynamic
    colocated   policy=colocated run.max_lag=0 (every rank generates, then trains: nothing overlaps)
    oracle      policy.name=oracle (the per-iteration best split with free switching)

then the comparison of analysis.compare (the table and its ratios) and the headline numbers:
throughput of the best dynamic run / the best static run and / the oracle, total time of dynamic /
best static, and the hidden share of the dynamic run's switch work. The printed commands are the
plain multiruns, to run by hand.
"""
from __future__ import annotations

import argparse
import math
import os
import shlex
import subprocess
import sys

KINDS = ("static", "dynamic", "colocated", "oracle")


def sweep_commands(experiment: str, ranks: int, out: str, overrides: list[str], units: int,
                   kinds=KINDS) -> list[list[str]]:
    base = [sys.executable, "-m", "dynaresize.sim.cli", "-m", f"+experiment={experiment}",
            f"cluster.ranks={ranks}", f"hydra.sweep.dir={out}", *overrides]
    cmds = []
    if "static" in kinds:
        cmds.append(base + ["policy=static", f"sim.train_units=range(1,{units})",
                            "hydra.sweep.subdir=static_${sim.train_units}"])
    if "dynamic" in kinds:
        cmds.append(base + ["policy=dynamic", "hydra.sweep.subdir=dynamic"])
    if "colocated" in kinds:
        cmds.append(base + ["policy=colocated", "run.max_lag=0", "hydra.sweep.subdir=colocated"])
    if "oracle" in kinds:
        cmds.append(base + ["policy=static", "policy.name=oracle", "hydra.sweep.subdir=oracle"])
    return cmds


def run_multirun(args: list[str], in_subprocess: bool = False) -> int:
    """`python -m dynaresize.sim.cli ARGS`, in this process (Hydra's multirun) or a new one."""
    if in_subprocess:
        proc = subprocess.run([sys.executable, "-m", "dynaresize.sim.cli", *args], capture_output=True, text=True)
        if proc.returncode != 0:
            print(proc.stdout[-3000:] + proc.stderr[-3000:], file=sys.stderr)
        return proc.returncode
    from . import cli
    from .config import register_schema
    register_schema()                        # the simulator's schema (compose() restores the runtime's)
    saved = sys.argv
    sys.argv = ["dynaresize-sim", *args]
    try:
        cli.main()
    except SystemExit as e:
        return int(e.code or 0)
    finally:
        sys.argv = saved
    return 0


def headline(df) -> dict:
    """The seed paper's numbers from a compare table (analysis.compare): throughput of the best
    dynamic run over the best static one and over the oracle, total time of that dynamic run over
    the best static one, its hidden share of switch work, and the best colocated run over the best
    static one."""
    from analysis.compare import ratios

    r = ratios(df)
    out = {"dynamic_vs_best_static": r["dynamic_vs_best_static"], "dynamic_vs_oracle": r["dynamic_vs_oracle"],
           "time_dynamic_vs_best_static": math.nan, "hidden_share_dynamic": math.nan,
           "colocated_vs_best_static": math.nan, "oracle_vs_best_static": math.nan,
           "best_dynamic": r["best_dynamic"], "best_static": r["best_static"], "best_oracle": r["best_oracle"]}
    runs = df.set_index("run")
    if r["best_dynamic"] is not None and r["best_static"] is not None:
        dyn, static = runs.loc[r["best_dynamic"]], runs.loc[r["best_static"]]
        out["time_dynamic_vs_best_static"] = float(dyn["total_time_s"] / static["total_time_s"])
        out["hidden_share_dynamic"] = float(dyn["hidden_share"]) if dyn["hidden_share"] is not None else math.nan
        coloc = df[df["kind"] == "colocated"]
        if len(coloc):
            out["colocated_vs_best_static"] = float(coloc["tokens_per_s"].max() / static["tokens_per_s"])
        if r["best_oracle"] is not None:
            out["oracle_vs_best_static"] = float(runs.loc[r["best_oracle"]]["tokens_per_s"] / static["tokens_per_s"])
    return out


def format_headline(h: dict) -> str:
    def f(x, pct=False):
        if x is None or (isinstance(x, float) and math.isnan(x)):
            return "-"
        return f"{100 * x:.1f} %" if pct else f"{x:.3f}"
    return "\n".join([
        f"throughput dynamic / best static : {f(h['dynamic_vs_best_static'])}   (seed paper: 1.665)",
        f"throughput dynamic / oracle      : {f(h['dynamic_vs_oracle'])}",
        f"total time dynamic / best static : {f(h['time_dynamic_vs_best_static'])}",
        f"hidden share of switch work      : {f(h['hidden_share_dynamic'], pct=True)}",
        f"throughput oracle / best static  : {f(h['oracle_vs_best_static'])}",
        f"throughput colocated / best static: {f(h['colocated_vs_best_static'])}",
        f"(best static run {h['best_static']}, dynamic run {h['best_dynamic']}, oracle run {h['best_oracle']})"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dynaresize.sim.experiment", description=__doc__.split("\n\n")[0])
    p.add_argument("experiment", help="conf/experiment/NAME.yaml")
    p.add_argument("--ranks", type=int, required=True)
    p.add_argument("--out", help="sweep folder (default multirun/NAME-RANKS)")
    p.add_argument("--units", type=int, help="static splits: sim.train_units=1..units-1 (default: the experiment's sim.units)")
    p.add_argument("--kinds", default=",".join(KINDS), help="which multiruns (comma separated)")
    p.add_argument("--dry-run", action="store_true", help="print the commands only")
    p.add_argument("--subprocess", action="store_true", help="run each multirun in its own process")
    p.add_argument("overrides", nargs="*", help="more Hydra overrides for every run")
    args = p.parse_intermixed_args(argv)
    out = os.path.abspath(args.out or os.path.join("multirun", f"{args.experiment}-{args.ranks}"))
    units = args.units
    if units is None:
        from .config import compose
        raw = compose([f"+experiment={args.experiment}", f"cluster.ranks={args.ranks}", *args.overrides])
        units = int(raw.sim.units) or args.ranks
    cmds = sweep_commands(args.experiment, args.ranks, out, args.overrides, units, tuple(args.kinds.split(",")))
    for cmd in cmds:
        print("$ " + " ".join(shlex.quote(c) for c in ["python"] + cmd[1:]), flush=True)
        if args.dry_run:
            continue
        code = run_multirun(cmd[3:], args.subprocess)
        if code != 0:
            return code
    if args.dry_run:
        return 0
    from analysis.compare import compare, format_table
    errors: list = []
    df = compare(out, errors=errors)
    for path, message in errors:
        print(f"skipped {path}: {message}", file=sys.stderr)
    print(format_table(df))
    df.to_csv(os.path.join(out, "compare.csv"), index=False)
    print()
    print(format_headline(headline(df)))
    print(f"\nsweep folder {out}; compare it again with: python -m analysis.cli compare {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
