"""Per-iteration metrics for the user's own tools (TensorBoard, Weights & Biases), written by rank 0.

The HDF5 timeline stays the source of truth: these are the same numbers (definitions in
dynaresize.analysis.metrics), computed from the iteration's raw events and samples while the job runs, so
that a run can be watched live in the tools people already use.
"""
from __future__ import annotations

import importlib.util
import json
import os
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from ..timeline.schema import CRITICAL, SWITCH_OPS

if TYPE_CHECKING:               # the config check imports this module: keep torch and pandas out
    from .types import Sample

BACKENDS = ("console", "tensorboard", "wandb")
GENERATIONS_FILE = "generations.jsonl"     # in the run directory: log.generations samples as text
# Backend -> (package it needs, the extra that installs it).
_PACKAGES = {"tensorboard": ("tensorboard", "dynaresize[tensorboard]"),
             "wandb": ("wandb", "dynaresize[wandb]")}


def _slowest_rank(events: list[dict], keep) -> float:
    """The slowest rank's total duration of the events for which keep(event) is true."""
    per_rank: dict[int, float] = {}
    for e in events:
        if keep(e):
            per_rank[e["rank"]] = per_rank.get(e["rank"], 0.0) + e["end"] - e["start"]
    return max(per_rank.values(), default=0.0)


def iteration_metrics(events: list[dict], samples: list[Sample], start: float, end: float,
                      roles: dict[int, str], train_ranks: int, rollout_ranks: int,
                      step_sums: dict | None = None, step: dict | None = None,
                      finished: Callable[[list[int]], bool] = lambda tokens: False) -> dict[str, float]:
    """One iteration's metrics as a flat dict with slash-grouped keys (TensorBoard groups them).

    `events`: the iteration's events (dicts with rank, name, start, end, critical, tokens);
    `samples`: the samples generated in it; `roles`: rank -> role for every rank 0..world-1;
    `step_sums`, `step`: the train step's sums and step-wide figures (train/*, none if it did not
    train); `finished(tokens)`: whether a response ended at end-of-sequence (else it was cut).
    Reward and length keys are left out when there are no samples.
    """
    from dynaresize.analysis.metrics import (iteration_bubble, iteration_role_bubbles,   # pandas: rank 0 only
                                             train_step_metrics)

    span = end - start
    out: dict[str, float] = {}
    if samples:
        rewards = np.array([s.reward for s in samples], dtype=np.float64)
        lengths = np.array([len(s.response) for s in samples], dtype=np.float64)
        out["reward/mean"] = float(rewards.mean())
        out["reward/std"] = float(rewards.std())        # population std (ddof=0)
        out["response_length/mean"] = float(lengths.mean())
        out["response_length/p50"] = float(np.percentile(lengths, 50))
        out["response_length/p99"] = float(np.percentile(lengths, 99))
        out["response_length/max"] = float(lengths.max())
        out["prompt_length/mean"] = float(np.mean([len(s.prompt_tokens) for s in samples]))
        out["response/truncated"] = float(np.mean([not finished(s.response) for s in samples]))
    if step_sums:
        out.update(train_step_metrics(step_sums, step or {}))
    out["split/train_ranks"] = float(train_ranks)
    out["split/rollout_ranks"] = float(rollout_ranks)
    out["time/iteration"] = span
    for stage in ("rollout", "train", "weight_sync"):
        out[f"time/{stage}"] = _slowest_rank(events, lambda e, n=stage: e["name"] == n)
    out["time/switch_critical"] = _slowest_rank(
        events, lambda e: e["name"] in SWITCH_OPS and e["critical"] == CRITICAL)
    out["time/switch_total"] = float(sum(e["end"] - e["start"] for e in events if e["name"] in SWITCH_OPS))
    out["bubble/all"] = float(iteration_bubble(events, start, end, len(roles)))
    for role, share in iteration_role_bubbles(events, start, end, roles).items():
        out[f"bubble/{role}"] = float(share)
    tokens = sum(e["tokens"] for e in events if e["name"] == "rollout")
    out["throughput/tokens_per_s"] = tokens / span if span > 0 else float("nan")
    return out


def _cell(text: str, limit: int = 300) -> str:
    """Text for a Markdown table cell (TensorBoard renders text summaries as Markdown)."""
    text = text if len(text) <= limit else text[:limit] + "..."
    return text.replace("|", "\\|").replace("\n", " ")


def check_backends(backends: list[str]) -> list[str]:
    """Problems with the `logger` backends, one line each with its fix (empty: all good).
    Looks the packages up without importing them, so the check stays cheap."""
    problems = []
    for name in backends:
        if name not in BACKENDS:
            problems.append(f"logger: unknown backend {name!r}. Fix: use any of {', '.join(BACKENDS)}, "
                            f"e.g. logger=[console,tensorboard].")
        elif name in _PACKAGES:
            package, extra = _PACKAGES[name]
            if importlib.util.find_spec(package) is None:
                problems.append(f"logger: backend {name!r} needs the {package} package. "
                                f"Fix: pip install '{extra}', or drop {name} from logger.")
    return problems


class MetricsLogger:
    """Writes each iteration's metrics to the selected backends; rank 0 only.

    "console" writes nothing (the job prints its own progress line); "tensorboard" writes to
    run_dir/tensorboard; "wandb" writes under run_dir/wandb, offline unless WANDB_MODE says
    otherwise (compute nodes usually have no internet; `wandb sync` uploads it later).
    """

    def __init__(self, backends: list[str], run_dir: str, config: dict | None = None,
                 run_name: str | None = None) -> None:
        problems = check_backends(backends)
        if problems:
            raise ValueError("\n".join(problems))
        self.generations_path = os.path.join(run_dir, GENERATIONS_FILE)
        self._writer: Any = None
        self._wandb_run: Any = None
        # Imported only when selected: neither package is a dependency of the job.
        if "tensorboard" in backends:
            from torch.utils.tensorboard import SummaryWriter
            self._writer = SummaryWriter(log_dir=os.path.join(run_dir, "tensorboard"))
        if "wandb" in backends:
            import wandb
            self._wandb_run = wandb.init(project=os.environ.get("WANDB_PROJECT", "dynaresize"),
                                         dir=run_dir, config=config, name=run_name,
                                         mode=os.environ.get("WANDB_MODE", "offline"))

    def log(self, iteration: int, metrics: dict[str, float]) -> None:
        if self._writer is not None:
            for key, value in metrics.items():
                self._writer.add_scalar(key, value, iteration)
            self._writer.flush()    # a crash keeps every iteration written so far
        if self._wandb_run is not None:
            self._wandb_run.log(metrics, step=iteration)

    def log_generations(self, iteration: int, rows: list[dict]) -> None:
        """A few generated samples as text (prompt, response, reward, ...): appended to
        RUN_DIR/generations.jsonl, and to TensorBoard (text) and wandb (a Table) when selected."""
        with open(self.generations_path, "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        if self._writer is not None:
            table = "| sample | reward | prompt | response |\n|---|---|---|---|\n" + "\n".join(
                f"| {r['sample']} | {r['reward']:.3f} | {_cell(r['prompt'])} | {_cell(r['response'])} |" for r in rows)
            self._writer.add_text("generations", table, iteration)
            self._writer.flush()
        if self._wandb_run is not None:
            import wandb
            columns = list(rows[0]) if rows else []
            self._wandb_run.log({"generations": wandb.Table(columns=columns, data=[[r[c] for c in columns]
                                                                                  for r in rows])}, step=iteration)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._wandb_run is not None:
            self._wandb_run.finish()
            self._wandb_run = None
