"""`dynaresize-sim suite`: the comparison a reviewer can trust, one table per workload.

    dynaresize-sim suite --ranks 64                       # 8 workloads, H100 / Qwen2.5-7B
    dynaresize-sim suite --ranks 64 256 1024 --hardware h100 h200 --out suite
    dynaresize-sim suite --ranks 64 --workloads stationary,dapo run.iterations=50

For every (hardware, ranks, workload) it simulates, with the same seed and cost model
(dynaresize/conf/experiment/suite.yaml plus the workload preset of dynaresize/conf/workload/):

    static, hindsight-best   the best of a sweep over every split (train units 1 .. units-1)
    static, pilot            the split that was best over the first PILOT_ITERATIONS iterations
                             (what a user picks from a short trial run), run to the end
    colocated                every rank generates, then trains (max_lag 0)
    dynamic                  policy=dynamic
    dynamic + stealing       policy=dynamic with trainer.work_stealing (rollout ranks done generating
                             compute micro-batches of the train step; dynaresize/plan/stealing.py)
    oracle, expected lengths the per-iteration best split for the distribution of the lengths it
                             is about to generate (not their sampled values), switching for free:
                             what knowing the workload, but not the future, is worth (sim/oracle.py)
    oracle                   the per-iteration best split for the batch's true lengths, switching
                             for free
    bound                    per iteration max(the longest sample decoded alone, all rollout and
                             train work / all ranks), summed: what no placement can beat

and with --tail the tail mechanisms the cost model prices (TAIL_MECHANISMS), one at a time and
together:

    dynamic + speculation    tail speculation once a rank runs few sequences (rollout.speculation)
    dynamic + migration      tail migration at the cost model's threshold (rollout.migration_threshold=auto)
    dynamic + tail           the mechanisms the cost model prices together: speculation and
                             stealing (it prices migration and speculation one at a time)
    static + tail            the best of the static sweep with them: what a system with these
                             mechanisms but a fixed split gets
    bound + speculation      the bound with the longest sample decoded with speculation

and writes, per workload, table.csv, table.md and table.png (throughput relative to the hindsight
static split), and over all workloads summary.md / summary.csv. The timelines of the runs in the
table stay in runs/NAME/timeline.h5 for `dynaresize-analyze` (`--keep all` keeps the whole static
sweep too: ~5 MB a run at 64 ranks, ~80 MB at 1,024; `--keep none` none).
"""
from __future__ import annotations

import argparse
import copy
import math
import multiprocessing
import os
import shutil
import sys
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

WORKLOADS = ("stationary", "growth", "dapo", "deepscaler", "r1zero", "mixture_blocks", "mixture_alternating",
             "oscillating")
ROWS = ("static, hindsight-best", "static, pilot", "colocated", "dynamic", "dynamic + stealing",
        "oracle, expected lengths", "oracle", "bound")
TAIL_ROWS = ("dynamic + speculation", "dynamic + migration", "dynamic + tail", "static + tail", "bound + speculation")
# The tail mechanisms (--tail) as config changes: speculation once a rollout rank runs 32
# sequences or fewer (the cost model prices speculation per rank's running batch), migration of a
# rank's last sequences to a tail rank at the threshold the cost model finds best, and stealing:
# rollout ranks that are done compute micro-batches of the train step.
TAIL_MECHANISMS = {"speculation": {"rollout": {"speculation": "tail", "speculation_below": 32}},
                   "migration": {"rollout": {"migration_threshold": "auto"}},
                   "stealing": {"trainer": {"work_stealing": True}}}
# The rows "+ tail": the cost model prices tail migration or speculation, not both in one run
# (validation refuses the pair in a simulation), and speculation shortens the tail that migration
# would move.
TOGETHER = ("speculation", "stealing")
PILOT_ITERATIONS = 5
PROGRESS_EVERY_S = 60.0     # a cell's progress line this often (a 1,024-rank cell can take an hour)


# --- the runs ----------------------------------------------------------------------------------

def min_train_ranks(base: dict) -> int:
    """The fewest train ranks whose train side fits the GPU (plan/memory.py) in a cell's config."""
    from ..plan import memory
    from .config import prepare
    spec = copy.deepcopy(base)
    spec["policy"].update(name="dynamic", train_ranks="auto")
    spec["sim"]["train_units"] = 0
    setup = prepare(spec)              # refuses a cell where no split fits, naming what would help
    cfg = setup.cfg
    unit = cfg.policy.resize_unit
    return memory.min_train_ranks(setup.profile, *memory.job_train_side(cfg, setup.profile),
                                  cfg.cluster.ranks - unit, unit)


def with_mechanisms(spec: dict, *names: str) -> dict:
    """A copy of a run's config with those of the tail mechanisms `names` (TAIL_MECHANISMS) on
    that the workload allows (mechanisms())."""
    spec = copy.deepcopy(spec)
    for name in (m for m in mechanisms(spec) if m in names):
        for section, values in TAIL_MECHANISMS[name].items():
            spec[section].update(values)
    return spec


def mechanisms(spec: dict) -> tuple[str, ...]:
    """The tail mechanisms a run's config allows: a tail migration cannot cross the rounds of
    dynamic sampling (trainer.filter_groups, the dapo workload), which validation refuses."""
    return tuple(m for m in TAIL_MECHANISMS if not (m == "migration" and spec["trainer"].get("filter_groups")))


def run_specs(base: dict, fewest: int, tail: bool = False) -> dict[str, dict]:
    """The composed config of every run of one workload (name -> plain config dict): the static
    splits of at least `fewest` train ranks (those that fit; the others would be refused), and
    every other row; with `tail`, also the rows of the tail mechanisms (TAIL_ROWS)."""
    units = int(base["sim"]["units"])
    unit = int(base["cluster"]["ranks"]) // units
    specs = {}
    for u in range(-(-fewest // unit), units):
        spec = copy.deepcopy(base)
        spec["policy"]["name"] = "static"
        spec["sim"]["train_units"] = u
        specs[f"static_{u:02d}"] = spec
        if tail:
            specs[f"tail_static_{u:02d}"] = with_mechanisms(spec, *TOGETHER)
    dyn = copy.deepcopy(base)
    dyn["policy"]["name"] = "dynamic"
    dyn["policy"]["train_ranks"] = "auto"
    dyn["sim"]["train_units"] = 0
    specs["dynamic"] = dyn
    specs["dynamic_stealing"] = with_mechanisms(dyn, "stealing")
    if tail:
        for name in mechanisms(dyn):
            if name != "stealing":                  # dynamic + stealing is a row without --tail too
                specs[f"dynamic_{name}"] = with_mechanisms(dyn, name)
        specs["dynamic_tail"] = with_mechanisms(dyn, *TOGETHER)
    coloc = copy.deepcopy(base)
    coloc["policy"]["name"] = "colocated"
    coloc["run"]["max_lag"] = 0
    specs["colocated"] = coloc
    for name in ("oracle", "oracle_expected"):
        oracle = copy.deepcopy(base)
        oracle["policy"]["name"] = name
        oracle["sim"]["charge_decisions"] = False      # a bound: its search costs nothing
        specs[name] = oracle
    return specs


def _simulate(job: tuple[dict, str]) -> dict:
    """Simulate one run and read its metrics back from its timeline (in a worker process)."""
    from dynaresize import analysis

    from .config import prepare
    from .core import Simulator
    spec, folder = job
    tl = analysis.load_timeline(Simulator(prepare(spec), folder).run())
    its = analysis.iteration_metrics(tl)
    first = its[its["iteration"] < PILOT_ITERATIONS]
    metrics = analysis.run_metrics(tl)
    metrics["pilot_tokens_per_s"] = float(first["tokens"].sum() / first["span_s"].sum())
    metrics["turns"] = direction_changes(its["train_ranks"].tolist())
    return metrics


def direction_changes(splits: list[int]) -> int:
    """How often a sequence of splits reverses direction (more train ranks, then fewer, ...)."""
    steps = [b > a for a, b in zip(splits, splits[1:]) if b != a]
    return sum(1 for a, b in zip(steps, steps[1:]) if a != b)


def acceptance(r, dynamic: dict) -> dict:
    """The dynamic policy's figures of merit from a workload's throughputs `r` (row -> x hindsight
    static): against the oracle and against the oracle without foresight (expected lengths), the
    share of the oracle's gain over the pilot split it captures, its resizes and reversals of
    direction, the median error of its prediction of the next iteration's time
    (analysis.predictions: |predicted / measured - 1|, switch included), and its decisions' wall
    time here: the median, and the total as a share of the run (rank 0 decides while every rank
    waits: suite.yaml's sim.charge_decisions adds them to the simulated time of every row but the
    oracles; `sim.charge_decisions=false` leaves them out)."""
    gain = r["oracle"] / r["static, pilot"] - 1
    captured = lambda row: (r[row] / r["static, pilot"] - 1) / gain if gain > 1e-9 else math.nan  # noqa: E731
    out = {"dynamic_vs_oracle": r["dynamic"] / r["oracle"],
           "dynamic_vs_expected": r["dynamic"] / r["oracle, expected lengths"],
           "captured": captured("dynamic"), "captured_stealing": captured("dynamic + stealing"),
           "resizes": dynamic["resizes"], "turns": dynamic["turns"],
           "prediction_error": dynamic["prediction_error_median"],
           "decide_s": dynamic["decide_s_median"],
           "decide_share": dynamic["decide_share"]}
    if "dynamic + tail" in r:
        out.update(tail_figures(r))
    return out


def tail_figures(r) -> dict:
    """What the tail mechanisms add (rows of --tail): dynamic + tail against static + tail (what
    resizing adds to a fixed split with the same mechanisms), and the share of dynamic's gap to
    the bound with speculation that each mechanism closes on its own and together (TOGETHER)."""
    gap = r["bound + speculation"] - r["dynamic"]
    closed = lambda row: (r[row] - r["dynamic"]) / gap if gap > 1e-9 else math.nan  # noqa: E731
    return {"tail_vs_static_tail": r["dynamic + tail"] / r["static + tail"],
            **{f"gap_closed_{m}": closed(f"dynamic + {m}") for m in ("speculation", "migration", "stealing", "tail")}}


def bound(spec: dict) -> dict:
    """The bound of a run config: per iteration (one step off-policy: the stages overlap)
    max(longest sample decoded alone, (rollout work + train work) / ranks), summed; and the
    generated tokens, for its throughput. Rounds of dynamic sampling follow each other: their
    longest samples add up."""
    from ..plan.costmodel import CostModel
    from ..data.shapes import filtered_shape, generation_rounds
    from ..plan.prediction import Lengths
    from .config import prepare
    setup = prepare(spec)
    cfg = setup.cfg
    cm = CostModel.for_job(cfg, setup.profile)
    W, spp, mbs = cfg.cluster.ranks, cfg.rollout.samples_per_prompt, cfg.trainer.micro_batch_size
    iterations, lag = cfg.run.iterations, 1
    rounds = generation_rounds(cfg.trainer)
    shape = lambda b: filtered_shape(cfg.workload, cfg.run.seed, b, cfg.rollout.prompts_per_batch, spp,  # noqa: E731
                                     rounds)
    total = work = tokens = 0.0
    for it in range(iterations + lag):
        longest = rollout = train = 0.0
        if it < iterations:
            s = shape(it)
            longest = sum(cm.longest_decode_time(s.prompt_lens[part], s.response_lens[part])
                          for part in Lengths.of(s).round_slices())
            rollout = cm.rollout_work(s.prompt_lens, s.response_lens)
            tokens += float(s.response_lens.sum())
        if it >= lag:
            s = shape(it - lag)
            rows = s.trained
            train = float(cm.train_compute_time((s.prompt_lens[rows, None] + s.response_lens[rows]).sum(),
                                                len(rows) * spp / mbs))
        total += max(longest, (rollout + train) / W)
        work += rollout + train
    return {"total_time_s": total, "tokens": tokens, "busy_share": work / (W * total) if total > 0 else math.nan}


# --- the table ---------------------------------------------------------------------------------

def workload_table(metrics: dict[str, dict], bounds: dict[str, dict]):
    """One row per baseline (ROWS, and TAIL_ROWS when their runs are there) from the runs' metrics
    (analysis.run_metrics) and the bounds (row -> bound()): throughput and total time relative to
    the hindsight-best static split, busy share of rank-time, critical switch seconds per rank and
    iteration, hidden share of switch work."""
    import pandas as pd

    def best_of(prefix: str, key: str = "tokens_per_s") -> str:
        return max((n for n in metrics if n.startswith(prefix)), key=lambda n: metrics[n][key])
    best = best_of("static_")
    ref = metrics[best]
    picks = {"static, hindsight-best": best, "static, pilot": best_of("static_", "pilot_tokens_per_s"),
             "colocated": "colocated", "dynamic": "dynamic", "dynamic + stealing": "dynamic_stealing",
             "oracle, expected lengths": "oracle_expected", "oracle": "oracle"}
    rows = ROWS
    if "dynamic_tail" in metrics:
        picks.update({"dynamic + speculation": "dynamic_speculation", "dynamic + migration": "dynamic_migration",
                      "dynamic + tail": "dynamic_tail", "static + tail": best_of("tail_static_")})
        rows = ROWS[:5] + TAIL_ROWS[:4] + ROWS[5:] + TAIL_ROWS[4:]
    out = []
    for row in rows:
        if row not in bounds and picks[row] not in metrics:         # a mechanism the workload does not allow
            out.append({"row": row, "run": "-", "split": "not allowed", **dict.fromkeys(
                ("tokens_per_s", "throughput_x", "total_time_x", "busy_share", "critical_switch_s", "hidden_share"),
                math.nan)})
            continue
        if row.startswith("bound"):
            bound_row = bounds[row]
            tput = bound_row["tokens"] / bound_row["total_time_s"]
            out.append({"row": row, "run": "-", "split": "-", "tokens_per_s": tput,
                        "throughput_x": tput / ref["tokens_per_s"],
                        "total_time_x": bound_row["total_time_s"] / ref["total_time_s"],
                        "busy_share": bound_row["busy_share"], "critical_switch_s": 0.0,
                        "hidden_share": math.nan})
            continue
        m = metrics[picks[row]]
        if row == "colocated":
            split = "all ranks"
        elif row.startswith("oracle"):
            split = "per iteration"
        elif m["final_split"] == m["split"]:
            split = m["split"]
        else:
            split = f"{m['split']} .. {m['final_split']}"
        out.append({"row": row, "run": picks[row], "split": split, "tokens_per_s": m["tokens_per_s"],
                    "throughput_x": m["tokens_per_s"] / ref["tokens_per_s"],
                    "total_time_x": m["total_time_s"] / ref["total_time_s"],
                    "busy_share": 1.0 - m["bubble_all"],
                    "critical_switch_s": m["switch_critical_s"] / max(m["iterations"] * m["world_size"], 1),
                    "hidden_share": m["hidden_share"] if m["hidden_share"] is not None else math.nan})
    return pd.DataFrame(out)


def markdown(df, columns=None) -> str:
    columns = columns or list(df.columns)

    def cell(v):
        if isinstance(v, float):
            if math.isnan(v):
                return "-"
            return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.3f}"
        return str(v)
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r[c]) for c in columns) + " |" for _, r in df.iterrows()]
    return "\n".join(lines)


def bar_chart(df, title: str, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 3.2))
    ax.barh(df["row"][::-1], df["throughput_x"][::-1], color="#4477aa")
    ax.axvline(1.0, color="k", lw=0.8)
    for y, v in enumerate(df["throughput_x"][::-1]):
        ax.text(v, y, f" {v:.3f}", va="center", fontsize=8)
    ax.set_xlabel("throughput / hindsight-best static split")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --- the command -------------------------------------------------------------------------------

def compose_base(workload: str, hardware: str, ranks: int, overrides: list[str]) -> dict:
    from omegaconf import OmegaConf

    from .config import compose
    raw = compose(["+experiment=suite", f"workload={workload}", f"hardware={hardware}",
                   f"cluster.ranks={ranks}", *overrides])
    data = OmegaConf.to_container(raw, resolve=True)
    data.pop("hydra", None)
    data["sim"]["train_units"] = max(int(data["sim"]["units"]) // 2, 1)    # runs that move start half/half
    return data


def run_all(pool, fn, jobs: dict[str, object], label: str, log, every_s: float = PROGRESS_EVERY_S) -> dict:
    """fn(job) for every job on the pool; the results in the jobs' order. Every `every_s` seconds
    while some are left, a progress line: the runs done and those running, also while none ends
    (a 1,024-rank dynamic run can take more than half an hour)."""
    started = last = time.perf_counter()
    futures = {pool.submit(fn, job): name for name, job in jobs.items()}
    results, pending = {}, set(futures)
    while pending:
        done, pending = wait(pending, timeout=max(every_s - (time.perf_counter() - last), 0.0),
                             return_when=FIRST_COMPLETED)
        for future in done:
            results[futures[future]] = future.result()
        now = time.perf_counter()
        if pending and now - last >= every_s:
            running = [futures[f] for f in futures if f in pending and f.running()]
            log(f"[suite] {label}: {len(results)}/{len(jobs)} runs done, running {', '.join(running) or '-'}, "
                f"{now - started:.0f} s")
            last = now
    return {name: results[name] for name in jobs}


def run_suite(out: str, ranks: list[int], hardware: list[str], workloads: list[str], overrides: list[str],
              jobs: int = 2, keep: str = "table", log=None, page=None, tail: bool = False) -> "object":
    """Run the suite; returns the summary DataFrame (one row per hardware x ranks x workload).
    `page`: (path, command) of a results page to write after every cell, or None; `tail`: also
    the rows of the tail mechanisms (TAIL_ROWS)."""
    import pandas as pd
    log = log or (lambda line: print(line, flush=True))
    summary, details = [], []
    started = time.perf_counter()
    context = multiprocessing.get_context("fork")
    with ProcessPoolExecutor(max_workers=max(jobs, 1), mp_context=context) as pool:
        for hw in hardware:
            for n in ranks:
                folder = os.path.join(out, f"{hw}-{n}")
                tables = []
                for w in workloads:
                    t0 = time.perf_counter()
                    base = compose_base(w, hw, n, overrides)
                    fewest = min_train_ranks(base)
                    specs = run_specs(base, fewest, tail)
                    wdir = os.path.join(folder, w)
                    # the dynamic runs first: they take longest (a decision prices many splits)
                    names = sorted(specs, key=lambda name: not name.startswith("dynamic"))
                    jobs_ = {name: (specs[name], os.path.join(wdir, "runs", name)) for name in names}
                    metrics = run_all(pool, _simulate, jobs_, f"{hw} {n} ranks {w}", log)
                    bounds = {"bound": bound(base)}
                    if tail:
                        bounds["bound + speculation"] = bound(with_mechanisms(base, "speculation"))
                    df = workload_table(metrics, bounds)
                    drop = set(specs) if keep == "none" else set() if keep == "all" else set(specs) - set(df["run"])
                    for name in drop:
                        shutil.rmtree(os.path.join(wdir, "runs", name), ignore_errors=True)
                    df.insert(0, "workload", w)
                    df.to_csv(os.path.join(wdir, "table.csv"), index=False)
                    title = f"{w}: {n} ranks, {hw}"
                    with open(os.path.join(wdir, "table.md"), "w") as f:
                        f.write(f"## {title}\n\n{markdown(df.drop(columns=['workload']))}\n")
                    bar_chart(df, title, os.path.join(wdir, "table.png"))
                    tables.append(df)
                    r = df.set_index("row")["throughput_x"]
                    log(f"[suite] {hw} {n:>5} ranks  {w:<20} dynamic {r['dynamic']:.3f}  "
                        f"+ stealing {r['dynamic + stealing']:.3f}  oracle {r['oracle, expected lengths']:.3f} "
                        f"(expected lengths) {r['oracle']:.3f} (true)  "
                        f"bound {r['bound']:.3f}  x hindsight static  ({time.perf_counter() - t0:.0f} s, "
                        f"{time.perf_counter() - started:.0f} s in all)")
                    if tail:
                        log(f"[suite] {hw} {n:>5} ranks  {w:<20} dynamic + tail {r['dynamic + tail']:.3f}  "
                            f"static + tail {r['static + tail']:.3f}  bound + speculation "
                            f"{r['bound + speculation']:.3f}  x hindsight static")
                    summary.append({"hardware": hw, "ranks": n, "workload": w, "min_train": fewest,
                                    **{row: float(x) for row, x in r.items()}, **acceptance(r, metrics["dynamic"])})
                    result = write_summary(out, summary)   # after every cell: a stopped suite keeps its cells
                    details.append((title, df))
                    if page is not None:
                        write_suite_page(*page, summary, details)
                both = pd.concat(tables)
                both.to_csv(os.path.join(folder, "tables.csv"), index=False)
    log(f"[suite] done in {time.perf_counter() - started:.0f} s: {out}/summary.md, per workload table.md/.csv/.png")
    return result


def write_summary(out: str, summary: list[dict]) -> "object":
    """summary.csv and summary.md of the cells done so far; returns their DataFrame."""
    import pandas as pd
    df = pd.DataFrame(summary)
    df.to_csv(os.path.join(out, "summary.csv"), index=False)
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write("Throughput relative to the hindsight-best static split (same seed and cost model per row); "
                "dynamic_vs_oracle, dynamic_vs_expected (dynamic / the oracle without foresight), the share "
                "of the oracle's gain over the pilot split that dynamic captures, "
                "the dynamic run's resizes and reversals of direction (turns), the median error of its "
                "prediction of the next iteration's time (prediction_error: |predicted / measured - 1|), "
                "and its decisions' wall time on "
                "this machine (decide_s: the median in seconds; decide_share: their total / the run's simulated "
                "time); with --tail, tail_vs_static_tail (dynamic + tail / static + tail) and gap_closed_* (the "
                "share of dynamic's gap to the bound with speculation that each mechanism closes).\n\n")
        f.write(markdown(df) + "\n")
    return df


PAGE_COLUMNS = (("static, pilot", "static, pilot"), ("colocated", "colocated"), ("dynamic", "dynamic"),
                ("dynamic + stealing", "dynamic + stealing"),
                ("oracle, expected lengths", "oracle, expected lengths"), ("oracle", "oracle"), ("bound", "bound"))
TAIL_COLUMNS = ("dynamic + speculation", "dynamic + migration", "dynamic + stealing", "dynamic + tail",
                "static + tail", "bound + speculation")


def write_suite_page(path: str, command: list[str], summary: list[dict], details: list) -> None:
    """The results page of a suite run: one table per (hardware, ranks), then every workload's rows."""
    from ..analysis.pages import write_page
    pct = lambda v: "-" if v is None or math.isnan(v) else f"{v:.0%}"  # noqa: E731
    body = ["Throughput relative to the hindsight-best static split, the same seeds and cost model in every "
            "row; what the rows and columns are: [the comparison suite](suite.md).", ""]
    for hw, n in dict.fromkeys((c["hardware"], c["ranks"]) for c in summary):
        body += [f"## {hw.upper()}, {n:,} ranks", "",
                 "| workload | min train ranks | " + " | ".join(t for _, t in PAGE_COLUMNS)
                 + " | dynamic / expected | dynamic / oracle "
                 "| + stealing / oracle | oracle's gain captured | reversals | prediction error | decisions |",
                 "|" + "---|" * (len(PAGE_COLUMNS) + 9)]
        for c in (c for c in summary if (c["hardware"], c["ranks"]) == (hw, n)):
            share, decide = c["decide_share"], c["decide_s"]
            decisions = "-" if math.isnan(decide) else \
                f"{decide:.2f} s, {'<0.1%' if share < 0.001 else f'{share:.1%}'}"
            body.append(f"| `{c['workload']}` | {c.get('min_train', '-')} | " + " | ".join(f"{c[row]:.3f}" for row, _ in PAGE_COLUMNS)
                        + f" | {c['dynamic_vs_expected']:.3f} | {c['dynamic_vs_oracle']:.3f} "
                        f"| {c['dynamic + stealing'] / c['oracle']:.3f} "
                        f"| {pct(c['captured'])}, {pct(c['captured_stealing'])} | {c['turns']} "
                        f"| {c['prediction_error']:.1%} "
                        f"| {decisions} |")
        body.append("")
        tail = [c for c in summary if (c["hardware"], c["ranks"]) == (hw, n) and "dynamic + tail" in c]
        if tail:
            body += tail_table(tail)
    body += ["## Each workload in full", ""]
    for title, df in details:
        body += [f"### {title}", "", markdown(df.drop(columns=["workload"])), ""]
    write_page(path, "Comparison suite", command, "\n".join(body))


def tail_table(cells: list[dict]) -> list[str]:
    """The page's table of the tail mechanisms (--tail) for one (hardware, ranks)."""
    pct = lambda v: "-" if math.isnan(v) else f"{round(v, 2) + 0.0:.0%}"  # noqa: E731  (no "-0%")
    lines = ["With the tail mechanisms (`--tail`): throughput x hindsight-best static split; "
             "gap closed: the share of dynamic's gap to the bound with speculation that each mechanism "
             "closes alone (speculation, migration, stealing) and together (tail: speculation and "
             "stealing, which the cost model prices in one run; migration it prices without speculation).", "",
             "| workload | dynamic | " + " | ".join(TAIL_COLUMNS) + " | dynamic + tail / static + tail "
             "| gap closed: speculation, migration, stealing, tail |",
             "|" + "---|" * (len(TAIL_COLUMNS) + 4)]
    for c in cells:
        closed = ", ".join(pct(c[f"gap_closed_{m}"]) for m in ("speculation", "migration", "stealing", "tail"))
        lines.append(f"| `{c['workload']}` | {c['dynamic']:.3f} | "
                     + " | ".join("-" if math.isnan(c[row]) else f"{c[row]:.3f}" for row in TAIL_COLUMNS)
                     + f" | {c['tail_vs_static_tail']:.3f} | {closed} |")
    return lines + [""]


def cell_arguments(p: argparse.ArgumentParser) -> None:
    """The cells of a comparison (hardware x ranks x workloads), as `suite` and `inside` take them."""
    p.add_argument("--ranks", type=int, nargs="+", default=[64], help="allocation sizes (default 64)")
    p.add_argument("--hardware", nargs="+", default=["h100"], help="profiles of dynaresize/conf/hardware/ (default h100)")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated presets of dynaresize/conf/workload/")


def unknown_cells(args) -> str | None:
    """What is wrong with the cells of `args` (cell_arguments), with the fix; None if nothing."""
    from .. import CONF_DIR
    from ..plan.hardware import available_profiles
    known = sorted(f[:-5] for f in os.listdir(os.path.join(CONF_DIR, "workload")) if f.endswith(".yaml"))
    bad = [w for w in args.workloads.split(",") if w and w not in known]
    bad += [h for h in args.hardware if h not in available_profiles()]
    return f"unknown {bad}. Fix: workloads from {known}, hardware from {available_profiles()}" if bad else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="dynaresize-sim suite", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    cell_arguments(p)
    p.add_argument("--out", default="suite", help="output folder (default ./suite)")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="simulations in parallel")
    p.add_argument("--keep", choices=("table", "all", "none"), default="table",
                   help="timelines kept: the table's runs (default), every run, or none")
    p.add_argument("--page", default=None,
                   help="also write the tables as a results page (Markdown), after every cell")
    p.add_argument("--tail", action="store_true",
                   help="also the rows of the tail mechanisms (speculation, migration, stealing; about twice the runs)")
    p.add_argument("overrides", nargs="*", help="Hydra overrides for every run, e.g. run.iterations=50")
    args = p.parse_intermixed_args(argv)
    from ..config import ConfigError
    from ..plan.hardware import ProfileError
    problem = unknown_cells(args)
    if problem:
        print(f"dynaresize-sim suite: {problem}", file=sys.stderr)
        return 2
    workloads = [w for w in args.workloads.split(",") if w]
    try:
        page = (args.page, ["dynaresize-sim", "suite", *(argv if argv is not None else sys.argv[2:])]) \
            if args.page else None
        run_suite(os.path.abspath(args.out), args.ranks, args.hardware, workloads, args.overrides, args.jobs,
                  args.keep, page=page, tail=args.tail)
    except (ConfigError, ProfileError) as e:
        print(f"dynaresize-sim suite: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
