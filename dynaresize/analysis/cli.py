"""Command line: ``dynaresize-analyze`` (also ``python -m dynaresize.analysis``).

Usage::

    dynaresize-analyze RUN_DIR|TIMELINE [--out DIR] [--no-gantt] [--no-trace]
                       [--trace-iterations FIRST:LAST] [--quiet]
    dynaresize-analyze RUN_DIR|TIMELINE --follow [--interval S] [--timeout S]
    dynaresize-analyze compare DIR|TIMELINE [...] [--out CSV]
    dynaresize-analyze plan RUN_DIR|TIMELINE [ITERATION]

Exit status: 0 on success, 2 when a file is not a readable timeline (the message names the
file and the problem) or a needed package is missing, 1 when ``--follow`` timed out before the
run completed.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

from dynaresize.timeline.schema import TimelineError

# Loading the per-event attrs column (256 bytes a row) is skipped above this many events.
EVENT_ATTRS_LIMIT = 1_000_000


def _run_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dynaresize-analyze",
        description="Summarise a DynaResize run from its timeline and write a report folder "
                    "(summary.csv, summary.json, gantt.png, trace.json). "
                    "'dynaresize-analyze compare DIR' compares runs.")
    p.add_argument("path", help="run folder (containing timeline.h5) or timeline file")
    p.add_argument("--out", help="report folder (default: report/ beside the timeline)")
    p.add_argument("--no-gantt", action="store_true", help="do not draw gantt.png")
    p.add_argument("--no-trace", action="store_true", help="do not write trace.json")
    p.add_argument("--trace-iterations", metavar="FIRST:LAST", type=_iteration_range,
                   help="put only these iterations (inclusive) in trace.json")
    p.add_argument("--quiet", action="store_true", help="print only the report location")
    p.add_argument("--page", metavar="PATH", help="also write the run's learning curves as a results page "
                                                "(Markdown, with learning.png beside it)")
    p.add_argument("--follow", action="store_true",
                   help="follow a running job: print one line per new iteration until the run "
                        "completes (writes no report)")
    p.add_argument("--interval", type=float, default=2.0, help="--follow poll interval, s")
    p.add_argument("--timeout", type=float, default=None,
                   help="--follow: stop after this many seconds (exit status 1)")
    return p


def _iteration_range(text: str) -> tuple[int, int]:
    try:
        first, _, last = text.partition(":")
        return int(first), int(last or first)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected FIRST:LAST, got {text!r}") from None


def _compare_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dynaresize-analyze compare",
        description="Compare runs: one row per run found (Hydra multirun folder, or any folder "
                    "searched for timeline.h5), and the throughput ratio of the best dynamic run "
                    "to the best static run (and to the oracle run, if any).")
    p.add_argument("paths", nargs="+", help="multirun folders, run folders or timeline files")
    p.add_argument("--out", help="CSV file for the table (default: compare.csv in the folder "
                                 "when one folder is given)")
    return p


def _plan_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dynaresize-analyze plan",
        description="Print the switch plan of each resize of a run (or of the one at the start of "
                    "ITERATION): operations, ranks, critical or background, bytes per rank.")
    p.add_argument("path", help="run folder (containing timeline.h5) or timeline file")
    p.add_argument("iteration", nargs="?", type=int, help="only the resize at the start of this iteration")
    return p


def _plan(args) -> int:
    from .plan import format_plans
    print(format_plans(args.path, args.iteration))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``dynaresize-analyze``; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv and argv[0] == "compare":
            return _compare(_compare_parser().parse_args(argv[1:]))
        if argv and argv[0] == "plan":
            return _plan(_plan_parser().parse_args(argv[1:]))
        args = _run_parser().parse_args(argv)
        args.argv = argv
        if args.follow:
            from .follow import follow
            return follow(args.path, interval=args.interval, timeout=args.timeout)
        return _report(args)
    except (TimelineError, ImportError) as e:
        print(f"dynaresize-analyze: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:                   # output piped into e.g. `head`: stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def _report(args) -> int:
    from .load import load_timeline, open_timeline
    from .report import summary_text, write_report

    with open_timeline(args.path) as f:
        n_events = f["events"].shape[0]
    tl = load_timeline(args.path, event_attrs=n_events <= EVENT_ATTRS_LIMIT)
    if not args.quiet:
        print(summary_text(tl))
    files = write_report(tl, args.out, png=not args.no_gantt, trace=not args.no_trace,
                         trace_iterations=args.trace_iterations)
    if "trace.json" in files and args.trace_iterations is None and n_events > EVENT_ATTRS_LIMIT:
        print(f"note: trace.json holds all {n_events} events; --trace-iterations FIRST:LAST "
              f"writes a smaller one", file=sys.stderr)
    folder = Path(next(iter(files.values()))).parent
    print(f"\nreport written to {folder}: {', '.join(files)}")
    if args.page:
        from .report import write_learning_page
        print(f"results page: {write_learning_page(tl, args.page, ['dynaresize-analyze', *args.argv])}")
    return 0


def _compare(args) -> int:
    from .compare import compare, format_table, ratios

    errors: list = []
    df = compare(args.paths, errors=errors)
    for path, message in errors:
        print(f"dynaresize-analyze: skipped {path}: {message}", file=sys.stderr)
    if df.empty:
        raise TimelineError(f"no readable timeline in {', '.join(args.paths)}")
    print(format_table(df))
    r = ratios(df)
    print()
    if not math.isnan(r["dynamic_vs_best_static"]):
        print(f"dynamic/best static throughput: {r['dynamic_vs_best_static']:.3f} "
              f"(best dynamic run {r['best_dynamic']}, best static run {r['best_static']})")
    else:
        print("dynamic/best static throughput: - (needs a dynamic and a static run)")
    if not math.isnan(r["dynamic_vs_oracle"]):
        print(f"dynamic/oracle throughput: {r['dynamic_vs_oracle']:.3f} "
              f"(oracle run {r['best_oracle']})")
    if r["best_dynamic"] is not None and r["best_static"] is not None:
        runs = df.set_index("run")
        dyn, static = runs.loc[r["best_dynamic"]], runs.loc[r["best_static"]]
        print(f"dynamic/best static total time: {dyn['total_time_s'] / static['total_time_s']:.3f}")
        hidden = dyn["hidden_share"]
        print("hidden share of switch work (dynamic run): "
              + ("-" if hidden is None or math.isnan(hidden) else f"{hidden:.1%}"))
    out = args.out
    if out is None and len(args.paths) == 1 and Path(args.paths[0]).is_dir():
        out = Path(args.paths[0]) / "compare.csv"
    if out is not None:
        df.to_csv(out, index=False)
        print(f"table written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
