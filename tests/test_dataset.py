"""Issue 16, your model, data and reward: a tiny model with a trained BPE tokenizer and a chat
template, 200 arithmetic word problems in JSONL, the GSM8K-style reward and TensorBoard metrics, on
real MPI ranks. Resizing, resume and the reward's error policy hold as for the built-in tasks."""
from __future__ import annotations

import importlib.util
import json
import os

import numpy as np
import pytest
from conftest import run_cli
from test_resize import assert_same_rl, resizes, timeline
from word_problems import write_word_problems

from dynaresize.data import tiny_model

# 5 synchronous iterations (a resumed run may add iterations only without lag), small batches and
# short responses: the random model rarely ends a response, so most run to the cap.
COMMON = ("workload=dataset", "data.prompt_key=question", "data.answer_key=answer", "workload.length_max=24",
          "rollout.prompts_per_batch=4", "rollout.samples_per_prompt=4", "trainer.micro_batch_size=4",
          "run.iterations=5", "run.max_lag=0", "run.report=false")


@pytest.fixture(scope="module")
def user_files(tmp_path_factory):
    """What a user brings: a dataset file and a model directory with its own tokenizer."""
    root = tmp_path_factory.mktemp("user")
    data = root / "train.jsonl"
    write_word_problems(data, n=200, seed=0)
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    model = tiny_model.build([r["question"] for r in rows] + [r["answer"] for r in rows], root / "model")
    return data, model


def user_args(user_files) -> tuple[str, ...]:
    data, model = user_files
    return (*COMMON, f"model.path={model}", f"data.train_files=[{data}]")


@pytest.fixture(scope="module")
def static_dataset_run(user_files, tmp_path_factory):
    run = tmp_path_factory.mktemp("static_dataset")
    run_cli(run, *user_args(user_files), "policy.train_ranks=2", "logger=[console,tensorboard]")
    return run


def scalars(run_dir, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def test_dataset_run_with_resizes_equals_static_and_logs_to_tensorboard(user_files, static_dataset_run, tmp_path):
    run = tmp_path / "scripted"
    proc = run_cli(run, *user_args(user_files), "policy=scripted", "policy.schedule=[1,3,2,1,3]",
                   "logger=[console,tensorboard]")
    assert "dataset: 200 prompts from 1 file(s)" in proc.stdout       # checked before the ranks start
    splits, grows, shrinks = resizes(run)
    assert splits == [1, 3, 2, 1, 3] and grows == 2 and shrinks == 2
    assert_same_rl(run, static_dataset_run, exact=True)

    tl, _ = timeline(run)
    samples = tl["samples"]
    assert len(samples) == 5 * 16 and samples["prompt_len"].min() > 20      # chat-templated BPE prompts
    assert samples["response_len"].max() <= 24
    for tag in ("reward/mean", "reward/std", "response_length/mean", "response_length/p99",
                "response_length/max", "split/train_ranks", "time/rollout", "bubble/all"):
        assert [step for step, _ in scalars(run, tag)] == list(range(5)), tag
    by_iteration = {int(i): samples["response_len"][samples["iteration"] == i] for i in range(5)}
    assert [v for _, v in scalars(run, "response_length/max")] == [float(by_iteration[i].max()) for i in range(5)]
    rewards = {int(i): samples["reward"][samples["iteration"] == i] for i in range(5)}
    assert np.allclose([v for _, v in scalars(run, "reward/mean")], [rewards[i].mean() for i in range(5)],
                       rtol=0, atol=1e-6)
    assert [v for _, v in scalars(run, "split/train_ranks")] == [1, 3, 2, 1, 3]


def test_dataset_batches_walk_every_row_once_per_epoch(user_files, static_dataset_run):
    """The 20 prompts of 5 batches are 20 different rows (a shuffled epoch, no repeats), and the
    sample digests do not depend on the split (the static and scripted runs agree, above)."""
    from omegaconf import OmegaConf

    from dynaresize.launch.validate import load_config
    from dynaresize.data.datasets import DatasetTask
    data, model = user_files
    cfg = load_config(OmegaConf.load(static_dataset_run / "config.yaml"))
    task = DatasetTask(cfg, str(model))
    rows = [task.row_indices(cfg.run.seed, b, 8) for b in range(50)]        # 400 prompts: two epochs
    first, second = sum(rows[:25], []), sum(rows[25:], [])
    assert sorted(first) == sorted(second) == list(range(200)) and first != second
    tl, _ = timeline(static_dataset_run)
    prompt_lens = tl["samples"]["prompt_len"][tl["samples"]["batch"] == 0]
    batch0 = task.batch(cfg.run.seed, 0, 4, 4)
    assert sorted(set(prompt_lens)) == sorted({len(p.tokens) for p in batch0})


REWARD_MODULE = '''
def picky(prompt, response, answer, extra):
    if extra["row"] % 3 == 0:
        raise ValueError("cannot parse " + repr(response[:10]))
    return 1.0
'''


@pytest.mark.fault("a reward function that raises",
                   "reward.on_error=fail: the job ends naming the sample; zero: scored 0, counted on the timeline")
def test_reward_errors_name_the_sample_and_follow_the_policy(user_files, tmp_path):
    (tmp_path / "my_rewards.py").write_text(REWARD_MODULE)
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    args = (*user_args(user_files), "reward._target_=my_rewards.picky", "run.iterations=1", "run.save_model=false",
            "cluster.ranks=2", "policy.train_ranks=1")
    proc = run_cli(tmp_path / "fail", *args, check=False, env=env)
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "my_rewards.picky" in out and "batch 0, prompt" in out and "cannot parse" in out, out[-3000:]
    assert "reward.on_error=zero" in out                                  # the way out is named

    run = tmp_path / "zero"
    run_cli(run, *args, "reward.on_error=zero", env=env)
    tl, _ = timeline(run)
    rewards = tl["samples"]["reward"]
    assert set(np.unique(rewards)) == {0.0, 1.0}
    errors = sum(json.loads(a).get("reward_errors", 0) for a in tl["events"]["attrs"] if a)
    assert errors == int((rewards == 0).sum()) > 0


@pytest.mark.fault("a dataset without the prompt field; a prompt over data.max_prompt_length; a reward path "
                   "that does not import", "exit 2 before any rank starts, naming the field, the row and the fix")
def test_bad_dataset_or_reward_is_refused_before_any_rank_starts(user_files, static_dataset_run, tmp_path):
    proc = run_cli(tmp_path / "bad", *user_args(user_files), "data.prompt_key=problem", check=False)
    assert proc.returncode == 2 and "data.prompt_key: row 0 of data.train_files has no field 'problem'" in proc.stderr, proc.stderr
    assert not (tmp_path / "bad" / "config.yaml").exists()                 # no rank started

    # The same checks in this process (what the launcher runs before starting the ranks).
    from omegaconf import OmegaConf

    from dynaresize.launch.cli import check_inputs
    from dynaresize.config import ConfigError
    from dynaresize.launch.validate import load_config
    cases = [({"data": {"max_prompt_length": 8}}, "data.max_prompt_length: 200 prompt(s) are longer than 8"),
             ({"data": {"max_prompt_length": 8, "truncation": "left"}}, None),
             ({"workload": {"length_max": 2000}}, "max_position_embeddings"),
             ({"reward": {"_target_": "nowhere.reward"}}, "reward._target_: 'nowhere.reward' cannot be loaded (ModuleNotFoundError"),
             ({"reward": {"kwargs": {"fromat_score": 0.1}}}, "reward.kwargs: ['fromat_score'] do not fit"),
             ({"model": {"path": None}}, "model.path: is unset but workload.task is dataset"),
             ({"data": {"train_files": ["missing.jsonl"]}}, "data.train_files[0]: 'missing.jsonl' does not exist")]
    base = OmegaConf.load(static_dataset_run / "config.yaml")
    for change, message in cases:
        raw = OmegaConf.merge(base, change)
        if message is None:
            check_inputs(load_config(raw))
            continue
        with pytest.raises(ConfigError) as e:
            check_inputs(load_config(raw))
        assert message in str(e.value), (change, str(e.value))


@pytest.mark.fault('dataset rows whose prompt is null, a number, NaN or empty, or whose answer is null or NaN',
                   'exit 2 before any rank starts, naming the file, the row and the field; with data.skip_bad_rows '
                   'they are left out and counted')
def test_bad_rows_are_refused_or_skipped_before_any_rank_starts(user_files, tmp_path):
    data, model = user_files
    good = [json.loads(line) for line in data.read_text().splitlines()][:40]
    bad = dict(good[0])
    rows = good[:10] + [{**bad, "question": None}, {**bad, "question": 17}, {**bad, "question": "  "},
                        {**bad, "answer": None}] + good[10:]
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + json.dumps({**bad, "question": float("nan")}) + "\n")
    args = (*COMMON, f"model.path={model}", f"data.train_files=[{path}]", "run.iterations=1", "cluster.ranks=2",
            "policy.train_ranks=1")
    proc = run_cli(tmp_path / "refused", *args, check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    for row, why in ((10, "'question' is None, not text"), (11, "'question' is 17, not text"),
                     (12, "'question' is empty"), (13, "'answer' is None, not text or a finite number"),
                     (44, "'question' is nan, not text")):
        assert f"data.train_files: {path} row {row}: {why}" in proc.stderr, proc.stderr
    assert "data.skip_bad_rows=true" in proc.stderr and not (tmp_path / "refused" / "config.yaml").exists()

    proc = run_cli(tmp_path / "skipped", *args, "data.skip_bad_rows=true")
    assert "dataset: 40 prompts, 5 bad rows skipped (data.skip_bad_rows)" in proc.stdout, proc.stdout
    prompts = {s["prompt"] for s in timeline(tmp_path / "skipped")[0]["samples"]}
    assert len(prompts) == 4                                          # the batch, from good rows only


def test_resumed_dataset_run_continues_the_same_sequence(user_files, static_dataset_run, tmp_path):
    """Stopped after 3 iterations and resumed to 5: the same samples and weights as 5 in one go."""
    resumed = tmp_path / "resumed"
    run_cli(resumed, *user_args(user_files), "policy.train_ranks=2", "run.checkpoint_every=1", "run.iterations=3")
    proc = run_cli(resumed, *user_args(user_files), "policy.train_ranks=2", "run.checkpoint_every=1")
    assert "resumed from" in proc.stdout
    assert_same_rl(resumed, static_dataset_run, exact=True)


def test_parquet_rows_are_the_jsonl_rows(tmp_path):
    from dynaresize.data.datasets import read_rows
    write_word_problems(tmp_path / "a.jsonl", n=20, seed=3)
    write_word_problems(tmp_path / "a.parquet", n=20, seed=3, fmt="parquet")
    assert read_rows([str(tmp_path / "a.parquet")]) == read_rows([str(tmp_path / "a.jsonl")])


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
@pytest.mark.timeout(900)
def test_dataset_run_on_vllm(user_files, tmp_path):
    """The same dataset, model and reward with vLLM generating (3 ranks: 1 train, 2 rollout)."""
    run = tmp_path / "vllm"
    run_cli(run, *user_args(user_files), "rollout=vllm", "cluster.ranks=3", "policy.train_ranks=1",
            "run.iterations=2", timeout=840)
    samples = timeline(run)[0]["samples"]
    assert len(samples) == 2 * 16 and samples["prompt_len"].min() > 20
    assert 1 <= samples["response_len"].min() and samples["response_len"].max() <= 24
    assert np.isin(samples["reward"], [0.0, 1.0]).all()                # gsm8k: right or wrong
