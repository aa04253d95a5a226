"""Hand-built timelines for tests/test_analysis.py, written with the real TimelineWriter."""
from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from dynaresize.timeline import schema  # noqa: E402
from dynaresize.timeline.writer import TimelineWriter  # noqa: E402


def config_yaml(policy: str, train_ranks: int, world_size: int) -> str:
    return (f"policy:\n  name: {policy}\n  train_ranks: {train_ranks}\n"
            f"world_size: {world_size}\nmodel:\n  name: tiny\n")


def write_timeline(path, *, events=(), iterations=(), samples=(), decisions=(), world_size=4,
                   policy="dynamic", train_ranks=2, complete=True) -> Path:
    """Write a timeline with TimelineWriter; `events` etc. are lists of dicts (schema fields)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {"mode": "sim", "world_size": world_size, "mpi_world_size": world_size,
            "config": config_yaml(policy, train_ranks, world_size)}
    writer = TimelineWriter(path, meta)
    writer.append("events", list(events))
    writer.append("iterations", list(iterations))
    writer.append("samples", list(samples))
    writer.append("decisions", list(decisions))
    writer.close(complete=complete)
    return path


def ev(iteration, rank, role, name, start, end, critical=None, tokens=0, attrs=None):
    if critical is None:
        critical = schema.NOT_A_SWITCH
    row = dict(iteration=iteration, rank=rank, role=role, name=name, start=start, end=end,
               critical=critical, tokens=tokens)
    if attrs:
        row["attrs"] = attrs
    return row


def it(iteration, train_ranks, rollout_ranks, start, end, table_version=None):
    return dict(iteration=iteration, table_version=iteration if table_version is None else table_version,
                train_ranks=train_ranks, rollout_ranks=rollout_ranks, start=start, end=end,
                trained_batch=iteration - 1, generated_batch=iteration)


def sample(iteration, rank, index, response_len, reward, prompt_len=8):
    return dict(iteration=iteration, batch=iteration, index=index, prompt=index // 2, rank=rank,
                prompt_len=prompt_len, response_len=response_len, length_cap=64, reward=reward,
                digest=1000 + 100 * iteration + index)


# The hand-built 4-rank, 2-iteration run of test 1 (numbers worked out in the test).
#
#   iteration 0, span [0, 10]:  ranks 0, 1 rollout; ranks 2, 3 train
#   iteration 1, span [10, 20]: ranks 0, 1, 2 rollout; rank 3 train (rank 2 moved)
HAND_EVENTS = [
    ev(0, 0, "rollout", "startup", -2.0, 0.0),              # before the span: not busy anyway
    ev(0, 0, "rollout", "rollout", 0.0, 6.0, tokens=60),
    ev(0, 0, "rollout", "weight_sync", 8.0, 9.0),
    ev(0, 1, "rollout", "rollout", 0.0, 8.0, tokens=40),
    ev(0, 1, "rollout", "weight_sync", 8.0, 9.0),
    ev(0, 2, "train", "train", 1.0, 7.0),
    ev(0, 2, "train", "exchange", 7.0, 8.0),
    ev(0, 2, "train", "weight_sync", 8.0, 9.0),
    ev(0, 2, "train", "stage_out", 6.0, 9.5, critical=schema.BACKGROUND, attrs={"to": "rollout"}),
    ev(0, 3, "train", "train", 1.0, 7.0),
    ev(0, 3, "train", "exchange", 7.0, 8.0),
    ev(0, 3, "train", "weight_sync", 8.0, 9.0),
    ev(1, 0, "rollout", "rollout", 10.0, 16.0, tokens=20),
    ev(1, 0, "rollout", "weight_sync", 18.0, 19.0),
    ev(1, 0, "rollout", "decide", 19.0, 19.2),
    ev(1, 1, "rollout", "rollout", 10.0, 15.0, tokens=15),
    ev(1, 1, "rollout", "exchange", 15.0, 18.0),
    ev(1, 1, "rollout", "weight_sync", 18.0, 19.0),
    ev(1, 2, "rollout", "stage_in", 9.0, 10.5, critical=schema.BACKGROUND),  # starts before span
    # tagged with the rank's old role: the role of the rank's stage events (rollout) wins
    ev(1, 2, "train", "engine_start", 10.0, 12.0, critical=schema.CRITICAL),
    ev(1, 2, "rollout", "weight_load", 11.5, 12.5, critical=schema.BACKGROUND),
    ev(1, 2, "rollout", "rollout", 12.0, 17.0, tokens=10),
    ev(1, 2, "rollout", "weight_sync", 18.0, 19.0),
    ev(1, 3, "train", "train", 10.0, 18.0),
    ev(1, 3, "train", "weight_sync", 18.0, 19.0),
    ev(1, 3, "train", "commit", 19.5, 20.5, critical=schema.BACKGROUND),   # runs past the span
]
HAND_ITERATIONS = [it(0, 2, 2, 0.0, 10.0), it(1, 1, 3, 10.0, 20.0)]
HAND_SAMPLES = [
    sample(0, 0, 0, 10, 1.0), sample(0, 0, 1, 20, 0.0), sample(0, 1, 2, 30, 1.0),
    sample(0, 1, 3, 40, 0.0),
    sample(1, 0, 0, 5, 1.0), sample(1, 1, 1, 15, 1.0), sample(1, 2, 2, 25, 0.0),
]
HAND_DECISIONS = [
    dict(iteration=0, table_version=1, from_train=2, to_train=1, action="move",
         reason="rollout_bound", rollout_time=8.0, train_time=6.0, predicted_gain=1.5,
         predicted_cost=0.5),
    dict(iteration=1, table_version=1, from_train=1, to_train=1, action="keep",
         reason="balanced", rollout_time=6.0, train_time=8.0, predicted_gain=float("nan"),
         predicted_cost=0.0),
]


def write_hand_timeline(path, **kwargs) -> Path:
    return write_timeline(path, events=HAND_EVENTS, iterations=HAND_ITERATIONS,
                          samples=HAND_SAMPLES, decisions=HAND_DECISIONS, world_size=4,
                          policy=kwargs.pop("policy", "dynamic"), train_ranks=2, **kwargs)


def write_simple_run(folder, policy, train_ranks, iteration_spans, tokens_per_iteration,
                     world_size=4, overrides=None) -> Path:
    """A run folder with timeline.h5 (and .hydra/overrides.yaml): each iteration has one
    rollout event per rollout rank and one train event per train rank, and one sample per
    iteration with `tokens_per_iteration` response tokens."""
    folder = Path(folder)
    events, iterations, samples = [], [], []
    for i, (start, end) in enumerate(iteration_spans):
        iterations.append(it(i, train_ranks, world_size - train_ranks, start, end))
        for rank in range(world_size):
            role = "train" if rank < train_ranks else "rollout"
            events.append(ev(i, rank, role, role, start, start + 0.5 * (end - start)))
        samples.append(sample(i, world_size - 1, 0, tokens_per_iteration, 0.5))
    write_timeline(folder / "timeline.h5", events=events, iterations=iterations, samples=samples,
                   world_size=world_size, policy=policy, train_ranks=train_ranks)
    if overrides is not None:
        (folder / ".hydra").mkdir(parents=True, exist_ok=True)
        (folder / ".hydra" / "overrides.yaml").write_text(
            "".join(f"- {item}\n" for item in overrides))
    return folder


def child_env() -> dict:
    """Environment for subprocesses: the repository root importable."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["MPLBACKEND"] = "Agg"
    return env
