"""The report folder of a run (summary.csv, summary.json, gantt.png, trace.json) and the text
summary printed by the command line."""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
import pandas as pd

from .gantt import gantt
from dynaresize.timeline.schema import TimelineError

from .load import Timeline
from .metrics import attempts, decisions, iteration_metrics, predictions, run_metrics, spans
from .trace import write_trace

REPORT_DIR = "report"


def jsonable(obj):
    """`obj` with numpy/pandas scalars made plain and NaN/NA made None (strict JSON)."""
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, np.generic):
        obj = obj.item()
    if obj is pd.NA or obj is pd.NaT or (isinstance(obj, float) and not math.isfinite(obj)):
        return None
    return obj


def write_report(tl: Timeline, out_dir: str | os.PathLike | None = None, *, png: bool = True,
                 trace: bool = True, trace_iterations: tuple[int, int] | None = None
                 ) -> dict[str, Path]:
    """Write the report files of `tl` into `out_dir` (default: ``report/`` beside the timeline).

    Files: summary.csv (per iteration), summary.json (``run``, ``iterations``, ``decisions``,
    ``predictions``), gantt.png, prediction.png (the policy's error per iteration, when its
    decisions record predictions), learning.png (reward, evaluation, KL, entropy, loss per
    iteration, when the run logged its training metrics) and trace.json (Chrome trace for Perfetto; only iterations
    first..last if `trace_iterations` = (first, last)). Returns {name: path}.
    """
    out = Path(out_dir) if out_dir is not None else Path(tl.path).parent / REPORT_DIR
    out.mkdir(parents=True, exist_ok=True)
    its = iteration_metrics(tl)
    files = {"summary.csv": out / "summary.csv", "summary.json": out / "summary.json"}
    its.to_csv(files["summary.csv"], index=False)
    summary = {"run": run_metrics(tl),
               "iterations": its.astype(object).to_dict("records"),
               "decisions": decisions(tl).astype(object).to_dict("records"),
               "predictions": predictions(tl).astype(object).to_dict("records"),
               "definitions": "see the module docs of dynaresize.analysis.metrics"}
    with open(files["summary.json"], "w") as f:
        json.dump(jsonable(summary), f, indent=1, allow_nan=False)
    if png:
        files["gantt.png"] = out / "gantt.png"
        gantt(tl, files["gantt.png"])
        pred = predictions(tl)
        if len(pred):
            files["prediction.png"] = out / "prediction.png"
            plot_predictions(pred, files["prediction.png"], tl.attrs.get("policy", ""))
        if any(str(c).startswith("train/") for c in its.columns):
            files["learning.png"] = out / "learning.png"
            plot_learning(its, files["learning.png"])
    if trace:
        files["trace.json"] = out / "trace.json"
        write_trace(tl, files["trace.json"], trace_iterations)
    return files


def closing_summary(tl: Timeline, report: dict[str, Path] | None) -> str:
    """What a finished run prints last: throughput, resizes, bubbles per role, the hidden share
    of switch work, the policy's prediction error, and where the report is (`report`: the files
    write_report wrote) or how to draw it."""
    m = run_metrics(tl)
    sp = spans(tl)
    label = lambda k: f"{k}T/{m['world_size'] - k}R"   # noqa: E731
    generating = sp["generated_batch"].to_numpy() >= 0
    splits = sp["train_ranks"].to_numpy()[generating]
    path = [label(k) for i, k in enumerate(splits) if i == 0 or k != splits[i - 1]]
    drain = sp["train_ranks"].to_numpy()[~generating]            # the pipeline's drain: trains only
    after = ("" if not len(drain) else f", the drain on {label(drain[-1])}" if len(splits) and drain[-1] != splits[-1]
             else "")
    lines = [f"{len(splits)} iterations{' and the pipeline' + chr(39) + 's drain' if len(drain) else ''} in "
             f"{_num(m['total_time_s'], '{:.1f}')} s, {_num(m['tokens_per_s'], '{:,.0f}')} tokens/s; "
             f"{len(path) - 1} resizes" + (f" ({' -> '.join(path)}{after})" if len(path) > 1 or after
                                           else f" (split {m['split']})"),
             f"bubbles: train {_pct(m['bubble_train'])}, rollout {_pct(m['bubble_rollout'])}"
             + (f", both {_pct(m['bubble_both'])}" if not pd.isna(m["bubble_both"]) else "")
             + f"; switch work {_num(m['switch_total_s'])} s, {_pct(m['hidden_share'])} of it hidden"
             + _policy_figures(m)]
    resumed = attempts(tl)
    if len(resumed):
        lost = resumed["lost_s"].sum()
        each = "; ".join(f"attempt {n + 2} resumed after iteration {int(a.after_iteration)}, "
                         f"{_num(a.lost_s, '{:.1f}')} s after it ended" for n, a in enumerate(resumed.itertuples()))
        lines.append(f"resumed {len(resumed)} time{'s' if len(resumed) > 1 else ''}: {_num(lost, '{:.1f}')} s lost "
                     f"({each}); the times above include them")
    folder = Path(tl.path).parent
    if report:
        lines.append(f"report: {next(iter(report.values())).parent} ({', '.join(report)}); redraw it "
                     f"with `dynaresize-analyze {folder}`")
    else:
        lines.append(f"report: `dynaresize-analyze {folder}` writes it to {folder / REPORT_DIR}")
    return "\n".join(lines)


def write_learning_page(tl: Timeline, path: str, command: list[str]) -> str:
    """A results page of the run's learning: its config's command, learning.png beside the page,
    and the mean reward, evaluation, KL and entropy over each tenth of the run."""
    from .pages import write_page
    its = iteration_metrics(tl)
    if not any(str(c).startswith("train/") for c in its.columns):
        raise TimelineError(f"{tl.path}: the run logged no training metrics (a simulated run, or one of an "
                            f"older version): it has no learning to show")
    image = Path(path).with_suffix(".png")
    image.parent.mkdir(parents=True, exist_ok=True)
    plot_learning(its, image)
    evals = [c for c in its.columns if str(c).startswith("eval/")]
    step = max(1, len(its) // 10)
    rows = ["| iterations | mean reward | " + " | ".join(evals) + " | KL(behaviour) | entropy |",
            "|" + "---|" * (4 + len(evals))]
    for first in range(0, len(its), step):
        part = its.iloc[first:first + step]
        cells = [f"{part['mean_reward'].mean():.3f}"] + [
            f"{part[c].dropna().iloc[-1]:.3f}" if part[c].notna().any() else "-" for c in evals] + [
            f"{part['train/kl_behaviour'].mean():.4f}", f"{part['train/entropy'].mean():.2f}"]
        rows.append(f"| {int(part['iteration'].iloc[0])}-{int(part['iteration'].iloc[-1])} | " + " | ".join(cells) + " |")
    from .compare import hydra_overrides
    generating = int((tl.iterations["generated_batch"] >= 0).sum())
    overrides = hydra_overrides(Path(tl.path))
    body = (f"The run: `dynaresize {overrides}`".rstrip() + f" ({generating} iterations of policy `{tl.policy}` on "
            f"{tl.world_size} ranks). "
            f"What each metric means: [metric definitions](../reference/metrics.md).\n\n"
            f"![learning curves]({image.name})\n\n" + "\n".join(rows))
    return write_page(path, "Learning: the tiny model on the reversal task", command, body)


def plot_learning(its: pd.DataFrame, path) -> None:
    """Is it learning? Per iteration: the batch's mean reward and the held-out evaluation's,
    the KL estimates, the policy's entropy, and the losses and clip fraction (metrics module)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(2, 2, figsize=(10, 6), sharex=True)
    x = its["iteration"]
    ax = axes[0, 0]
    ax.plot(x, its["mean_reward"], ".-", ms=3, label="batch generated")
    evals = [c for c in its.columns if str(c).startswith("eval/reward_mean")]
    if evals:
        e = its[["iteration", evals[0]]].dropna()
        ax.plot(e["iteration"], e[evals[0]], "s-", ms=5, label="held-out evaluation")
    ax.set_ylabel("mean reward")
    ax.legend(loc="best")
    ax = axes[0, 1]
    for column, label in (("train/kl_behaviour", "KL(behaviour || policy)"), ("train/kl_ref", "KL(policy || reference)")):
        if column in its:
            ax.plot(x, its[column], ".-", ms=3, label=label)
    ax.set_ylabel("KL (k3)")
    ax.legend(loc="best")
    ax = axes[1, 0]
    ax.plot(x, its["train/entropy"], ".-", ms=3)
    ax.set_ylabel("entropy [nats]")
    ax.set_xlabel("iteration")
    ax = axes[1, 1]
    ax.plot(x, its["train/policy_loss"], ".-", ms=3, label="policy loss")
    ax.plot(x, its["train/clip_fraction"], ".-", ms=3, label="clip fraction")
    ax.set_xlabel("iteration")
    ax.legend(loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_predictions(pred: pd.DataFrame, path, policy: str = "") -> None:
    """Predicted and measured iteration times, and the relative error, per iteration."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 5), sharex=True, height_ratios=(2, 1))
    top.plot(pred["iteration"], pred["measured_s"], "o-", ms=3, label="measured")
    top.plot(pred["iteration"], pred["predicted_s"], "x--", ms=4, label="predicted the iteration before")
    top.set_ylabel("iteration time [s]")
    top.legend(loc="best")
    top.set_title(f"{policy} policy: prediction of the next iteration (median error "
                  f"{100 * pred['error'].abs().median():.1f}%)")
    bottom.bar(pred["iteration"], 100 * pred["error"], width=0.8)
    bottom.axhline(0, color="k", lw=0.5)
    bottom.set_ylabel("error [%]")
    bottom.set_xlabel("iteration")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _policy_figures(m: dict) -> str:
    """The policy's next-iteration prediction error and, for a dynamic policy, what its decisions
    cost (rank 0 decides while every rank waits), as a tail of a summary line."""
    out = "" if pd.isna(m["prediction_error_median"]) else \
        f"; next-iteration prediction error, median {_pct(m['prediction_error_median'])}"
    if m["kind"] == "dynamic" and not pd.isna(m["decide_s_total"]):
        out += f"; decisions: median {_num(m['decide_s_median'], '{:.2g}')} s, {_pct(m['decide_share'])} of the run"
    return out


def _pct(x) -> str:
    return "-" if x is None or pd.isna(x) else f"{100 * x:.1f}%"


def _num(x, fmt="{:.2f}") -> str:
    return "-" if x is None or pd.isna(x) else fmt.format(x)


def summary_text(tl: Timeline, max_rows: int = 20) -> str:
    """A human-readable summary: run metrics, GPU time by state and role, iteration table."""
    m = run_metrics(tl)
    its = iteration_metrics(tl)
    lines = [
        f"run       {tl.path}",
        f"policy    {m['policy']} ({m['kind']}), initial split {m['split']} (train/rollout), "
        f"final {m['final_split']}, {m['world_size']} ranks",
        f"iters     {m['iterations']}{'' if m['complete'] else '  (run not complete)'}",
        f"time      {_num(m['total_time_s'])} s; {m['tokens']} tokens "
        f"({_num(m['tokens_per_s'], '{:.1f}')} tokens/s), {m['samples']} samples "
        f"({_num(m['samples_per_s'])} samples/s)",
        f"reward    mean {_num(m['mean_reward'], '{:.3f}')}; response length mean "
        f"{_num(m['mean_response_len'], '{:.1f}')}, p99 {_num(m['p99_response_len'], '{:.1f}')}",
        f"bubbles   train {_pct(m['bubble_train'])}, rollout {_pct(m['bubble_rollout'])}"
        + (f", both {_pct(m['bubble_both'])}" if not pd.isna(m["bubble_both"]) else "")
        + f", all {_pct(m['bubble_all'])}",
        f"switches  {m['resizes']} resizes, {m['switch_ops']} switch ops, work "
        f"{_num(m['switch_total_s'])} s, critical {_num(m['switch_critical_s'])} s, hidden share "
        f"{_pct(m['hidden_share'])}" + _policy_figures(m),
        "",
        "GPU time [GPU s]   total      busy      idle  switching",
    ]
    for role, t in m["gpu_time"].items():
        lines.append(f"  {role:<14}{t['total_s']:10.1f}{t['busy_s']:10.1f}{t['idle_s']:10.1f}"
                     f"{t['switching_s']:11.1f}")
    if m["outside_iterations_s"] and m["outside_iterations_s"] > 1e-9:
        lines.append(f"  between iterations: {m['outside_iterations_s']:.1f} GPU s")
    if len(its):
        table = pd.DataFrame({
            "iter": its["iteration"],
            "split": its["train_ranks"].astype(str) + "/" + its["rollout_ranks"].astype(str),
            "span_s": its["span_s"].map(_num),
            "rollout_s": its["rollout_time_s"].map(_num),
            "train_s": its["train_time_s"].map(_num),
            "sync_s": its["weight_sync_time_s"].map(_num),
            "switch_crit_s": its["switch_critical_s"].map(_num),
            "switch_hid_s": its["switch_hidden_s"].map(_num),
            "bub_train": its["bubble_train"].map(_pct),
            "bub_rollout": its["bubble_rollout"].map(_pct),
            "tokens/s": its["tokens_per_s"].map(lambda x: _num(x, "{:.1f}")),
            "reward": its["mean_reward"].map(lambda x: _num(x, "{:.3f}")),
            "decision": its["decision"].fillna("-").astype(str),
        })
        if len(table) > max_rows:
            half = max_rows // 2
            gap = pd.DataFrame([{c: "..." for c in table.columns}])
            table = pd.concat([table.head(half).astype(str), gap, table.tail(half).astype(str)])
        lines += ["", table.to_string(index=False)]
    return "\n".join(lines)
