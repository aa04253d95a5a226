"""Does it learn? `+experiment=learning` (the tiny model, a short reversal task, 40 iterations, a
fixed seed) on real MPI ranks, with a KL penalty to the reference so that every training metric
exists: the reward rises, the held-out evaluation rises, and every metric of the glossary is in
TensorBoard and on the timeline for every iteration."""
from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import run_cli
from dynaresize import analysis

ITERATIONS = 40
TRAIN_METRICS = ["train/policy_loss", "train/loss", "train/kl_ref", "train/kl_behaviour", "train/entropy",
                 "train/clip_fraction", "train/ratio_mean", "train/ratio_max", "train/grad_norm",
                 "train/grad_norm_clipped", "train/lr", "train/advantage_mean", "train/advantage_std",
                 "train/zero_variance_groups"]
ROLLOUT_METRICS = ["reward/mean", "reward/std", "response/truncated", "response_length/mean"]
EVAL_METRICS = ["eval/reward_mean", "eval/pass@4", "eval/response_length_mean"]
EVALUATED = [0, 10, 20, 30, ITERATIONS]          # every 10 from 0, and after the drain


@pytest.fixture(scope="module")
def learning_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("learning")
    proc = run_cli(run, "+experiment=learning", "trainer.kl_coef=0.01", "logger=[console,tensorboard]",
                   "log.generations_every=10", timeout=600)
    return run, proc


def test_the_tiny_model_learns(learning_run):
    """The margins are about half of what this seed shows (reward +0.046, evaluation +0.088)."""
    run, _ = learning_run
    its = analysis.iteration_metrics(analysis.load_timeline(run))
    reward = its["mean_reward"].to_numpy()[:ITERATIONS]
    assert reward[-10:].mean() >= reward[:10].mean() + 0.02, reward
    evals = its.set_index("iteration")["eval/reward_mean"].dropna()
    assert evals.index.tolist() == EVALUATED
    assert evals.iloc[-1] >= evals.iloc[0] + 0.04, evals.tolist()
    assert its["train/entropy"].iloc[-1] < its["train/entropy"].iloc[1]      # the policy sharpens


def test_every_metric_in_tensorboard_and_on_the_timeline(learning_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    run, _ = learning_run
    board = EventAccumulator(str(run / "tensorboard"))
    board.Reload()
    steps = {tag: [e.step for e in board.Scalars(tag)] for tag in board.Tags()["scalars"]}
    logged = analysis.load_timeline(run).metrics
    on_timeline = {name: sorted(logged.loc[logged["name"] == name, "iteration"]) for name in logged["name"].unique()}
    trained = list(range(1, ITERATIONS + 1))        # one step off-policy: iteration 0 trains nothing
    generated = list(range(ITERATIONS))
    for names, iterations in ((TRAIN_METRICS, trained), (ROLLOUT_METRICS, generated), (EVAL_METRICS, EVALUATED)):
        for name in names:
            assert steps.get(name) == iterations, (name, steps.get(name))
            assert on_timeline.get(name) == iterations, (name, on_timeline.get(name))
    values = logged.pivot_table(index="iteration", columns="name", values="value", observed=True)
    assert (values["train/lr"].dropna() == 3e-3).all()
    kl_ref = values["train/kl_ref"].dropna()      # the first step trains the reference's own weights
    assert kl_ref.iloc[0] == 0.0 and (kl_ref.iloc[1:] > 0).all()
    assert np.all(values["train/grad_norm_clipped"].dropna() <= values["train/grad_norm"].dropna() + 1e-9)


def test_generations_are_logged_as_text(learning_run):
    run, _ = learning_run
    rows = [json.loads(line) for line in (run / "generations.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [it for it in (0, 10, 20, 30) for _ in range(4)]
    for r in rows:
        assert r["prompt"].endswith("=") and isinstance(r["response"], str) and 0.0 <= r["reward"] <= 1.0
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    board = EventAccumulator(str(run / "tensorboard"), size_guidance={"tensors": 0})
    board.Reload()
    assert [e.step for e in board.Tensors("generations/text_summary")] == [0, 10, 20, 30]


def test_the_console_counts_iterations_as_the_run_does(learning_run):
    """`run.iterations=40` shows 40 iterations, numbered from 0 as the timeline, TensorBoard and
    the Gantt chart number them, then the pipeline's drain, which is not an iteration; the console
    is in the run directory's cli.log too."""
    run, proc = learning_run
    lines = [line for line in proc.stdout.splitlines() if line.startswith(("[dynaresize] iter", "[dynaresize] drain"))]
    assert lines[0].startswith("[dynaresize] iter   0 (1/40)") and lines[39].startswith("[dynaresize] iter  39 (40/40)")
    assert len(lines) == 41 and lines[40].startswith("[dynaresize] drain") and "reward" not in lines[40]
    assert "40 iterations and the pipeline's drain" in proc.stdout
    log = (run / "cli.log").read_text()
    assert all(line in log for line in lines)
