"""Per-iteration metrics for TensorBoard / W&B: values on a hand-made iteration, and the files the
backends really write, read back with their own readers."""
from __future__ import annotations

import json
import math

import pytest

from dynaresize.analysis.metrics import iteration_role_bubbles
from dynaresize.runtime.metrics_logger import MetricsLogger, check_backends, iteration_metrics
from dynaresize.timeline.schema import BACKGROUND, CRITICAL, NOT_A_SWITCH
from dynaresize.runtime.types import Sample

START, END = 10.0, 20.0
ROLES = {0: "train", 1: "train", 2: "rollout", 3: "rollout"}


def ev(rank, name, start, end, critical=NOT_A_SWITCH, tokens=0) -> dict:
    return {"rank": rank, "name": name, "start": start, "end": end, "critical": critical, "tokens": tokens}


# Busy (union of stage + switch events, clipped to [10, 20]; exchange and decide are not busy):
#   rank 0: train 12-19 (two overlapping events) + weight_sync 19-20 -> 12-20 = 8 s, idle 2
#   rank 1: train 12-17 -> 5 s, idle 5
#   rank 2: rollout 10-16, stage_out 16-18, weight_sync 19-20 (clipped) -> 9 s, idle 1
#   rank 3: reshard 10-11 (clipped), rollout 10-18, commit 18-19 -> 9 s, idle 1
EVENTS = [
    ev(0, "decide", 10, 12),
    ev(0, "train", 12, 17, tokens=50),
    ev(0, "train", 16, 19, tokens=50),
    ev(0, "weight_sync", 19, 20),
    ev(1, "train", 12, 17, tokens=50),
    ev(1, "exchange", 17, 20),
    ev(2, "drain", 9, 10, CRITICAL),
    ev(2, "rollout", 10, 16, tokens=300),
    ev(2, "stage_out", 16, 18, BACKGROUND),
    ev(2, "weight_sync", 19, 20.5),
    ev(3, "reshard", 8, 11, CRITICAL),
    ev(3, "rollout", 10, 18, tokens=500),
    ev(3, "commit", 18, 19, CRITICAL),
]


def sample(i: int, reward: float, response_len: int, prompt_len: int) -> Sample:
    return Sample(batch=0, index=i, prompt=i, rank=2, prompt_tokens=[1] * prompt_len,
                  response=[7] * response_len, logprobs=[0.0] * response_len,
                  length_cap=response_len, reward=reward)


SAMPLES = [sample(0, 0.0, 1, 3), sample(1, 1.0, 2, 3), sample(2, 0.0, 3, 5),
           sample(3, 1.0, 4, 5), sample(4, 0.5, 100, 4)]


def test_iteration_metrics_hand_made():
    m = iteration_metrics(EVENTS, SAMPLES, START, END, ROLES, train_ranks=2, rollout_ranks=2)
    expected = {
        "reward/mean": 0.5,
        "reward/std": math.sqrt(0.2),             # population std of [0, 1, 0, 1, .5]
        "response_length/mean": 22.0,
        "response_length/p50": 3.0,
        "response_length/p99": 4 + 0.96 * 96,     # linear: position 0.99 x 4 = 3.96 in [1,2,3,4,100]
        "response_length/max": 100.0,
        "prompt_length/mean": 4.0,
        "split/train_ranks": 2.0,
        "split/rollout_ranks": 2.0,
        "time/iteration": 10.0,
        "time/rollout": 8.0,                      # rank 3
        "time/train": 8.0,                        # rank 0: 5 + 3, summed, not the union
        "time/weight_sync": 1.5,                  # rank 2, not clipped
        "time/switch_critical": 4.0,              # rank 3: reshard 3 + commit 1 (rank 2: drain 1)
        "time/switch_total": 7.0,                 # 1 + 2 + 3 + 1
        "bubble/all": 9 / 40,                     # idle 2 + 5 + 1 + 1 of 4 x 10 s
        "bubble/train": 7 / 20,
        "bubble/rollout": 2 / 20,
        "throughput/tokens_per_s": 80.0,          # (300 + 500) rollout tokens / 10 s
        "response/truncated": 1.0,                # `finished` not given: every response counts as cut
    }
    assert set(m) == set(expected)
    for key, value in expected.items():
        assert m[key] == pytest.approx(value, rel=1e-12, abs=1e-12), key
        assert isinstance(m[key], float), key


def test_truncated_responses_are_those_not_ended_by_an_eos_token():
    samples = SAMPLES + [Sample(batch=0, index=5, prompt=5, rank=2, prompt_tokens=[1], response=[7, 7, 2],
                                logprobs=[0.0] * 3, length_cap=3, reward=0.0)]
    m = iteration_metrics(EVENTS, samples, START, END, ROLES, 2, 2, finished=lambda tokens: tokens[-1] == 7)
    assert m["response/truncated"] == pytest.approx(1 / 6, abs=1e-12)


def test_iteration_metrics_without_samples_and_colocated():
    roles = {r: "colocated" for r in range(4)}
    m = iteration_metrics(EVENTS, [], START, END, roles, train_ranks=4, rollout_ranks=4)
    assert not any(k.startswith(("reward/", "response_length/", "prompt_length/")) for k in m)
    assert m["bubble/colocated"] == pytest.approx(9 / 40, abs=1e-12)
    assert m["bubble/all"] == pytest.approx(9 / 40, abs=1e-12)
    assert "bubble/train" not in m


def test_iteration_role_bubbles_any_rank_numbers():
    # Ranks of a role need not be contiguous; a rank without events is idle all the span.
    roles = {0: "train", 5: "train", 3: "rollout"}
    events = [ev(5, "train", 0, 4), ev(5, "weight_sync", 3, 6), ev(3, "rollout", -1, 2),
              ev(3, "exchange", 2, 10)]
    shares = iteration_role_bubbles(events, 0.0, 10.0, roles)
    assert shares == pytest.approx({"train": 1 - 6 / 20, "rollout": 1 - 2 / 10}, abs=1e-12)


def test_tensorboard_round_trip(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = MetricsLogger(["console", "tensorboard"], str(tmp_path))
    written = {}
    for it in range(3):
        samples = [sample(i, reward=0.25 * it + 0.1 * i, response_len=10 * it + i + 1, prompt_len=2)
                   for i in range(4)]
        m = iteration_metrics(EVENTS, samples, START, END, ROLES, 2, 2)
        logger.log(it, m)
        written[it] = m
    logger.close()

    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert set(written[0]) <= set(acc.Tags()["scalars"])
    for key in ("reward/mean", "response_length/max"):
        got = acc.Scalars(key)
        assert [s.step for s in got] == [0, 1, 2], key
        for s in got:   # stored as float32
            assert s.value == pytest.approx(written[s.step][key], rel=1e-6), key
    assert [s.value for s in acc.Scalars("response_length/max")] == [4.0, 14.0, 24.0]


def test_check_backends():
    assert check_backends(["console"]) == []
    problems = check_backends(["console", "tensorbord"])
    assert len(problems) == 1
    assert problems[0].startswith("logger:")
    assert "'tensorbord'" in problems[0]
    assert all(name in problems[0] for name in ("console", "tensorboard", "wandb"))
    with pytest.raises(ValueError, match="tensorbord"):
        MetricsLogger(["tensorbord"], "unused")


def test_wandb_offline(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    assert check_backends(["wandb"]) == []
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    # Keep wandb's settings and caches out of the home directory.
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "home" / var))
    logger = MetricsLogger(["wandb"], str(tmp_path), config={"seed": 1}, run_name="test")
    rows = [{"iteration": 0, "sample": 0, "prompt": "12=", "response": "21", "reward": 1.0}]
    for it in range(3):
        if it == 0:
            logger.log_generations(it, rows)           # a wandb Table, and generations.jsonl
        logger.log(it, {"reward/mean": 0.1 * it, "time/iteration": 1.0})
    logger.close()
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    assert list(runs[0].glob("*.wandb")), sorted(p.name for p in runs[0].iterdir())
    tables = list(runs[0].rglob("generations_0_*.table.json"))
    assert tables and json.loads(tables[0].read_text())["data"] == [[0, 0, "12=", "21", 1.0]]
    assert [json.loads(line) for line in (tmp_path / "generations.jsonl").read_text().splitlines()] == rows
