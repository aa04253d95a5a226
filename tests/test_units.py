"""Unit tests of the pieces that need no MPI: roles, placement, workload, sampling, config."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from dynaresize.config import ConfigError, WorkloadConfig
from dynaresize.launch.validate import load_config
from dynaresize.plan.placement import place_prompts, placement_lists
from dynaresize.plan.roles import Role, RoleTable
from dynaresize.runtime.rollout.torch_engine import sample_token
from dynaresize.data.shapes import batch_shape, filtered_shape, response_cap, signal_share
from dynaresize.data.workload import make_batch, sample_seed


def test_role_table_blocks_and_validation():
    t = RoleTable.split(4, 1)
    assert t.train_ranks() == [0] and t.rollout_ranks() == [1, 2, 3] and t.describe() == "1T/3R"
    assert t.with_split(3).version == 1 and t.with_split(3).num_train == 3
    with pytest.raises(ValueError, match="at least one"):
        RoleTable(0, (Role.TRAIN,) * 4)
    with pytest.raises(ValueError, match="contiguous"):
        RoleTable(0, (Role.ROLLOUT, Role.TRAIN, Role.ROLLOUT))
    c = RoleTable.colocated(3)
    assert c.colocated_mode and c.train_ranks() == c.rollout_ranks() == [0, 1, 2]


def test_placement_spreads_groups_by_prompt_length_and_covers_all():
    plens = [90, 10, 10, 10, 40, 40, 5, 5]
    placed = placement_lists(place_prompts(plens, 3), 3)
    assert sorted(i for p in placed for i in p) == list(range(8))
    assert sorted(len(p) for p in placed) == [2, 3, 3]           # counts within one
    loads = [sum(plens[i] for i in p) for p in placed]
    assert max(loads) - min(loads) <= max(plens)
    assert placement_lists(place_prompts(plens, 3), 3) == placed  # deterministic


def test_placement_never_reads_the_hidden_response_lengths():
    """Permuting the hidden response lengths among the prompts of a batch changes no placement:
    the runtime's (job.rollout) and the simulator's placement see prompt lengths only."""
    w = WorkloadConfig(prompt_median=40, prompt_sigma=0.5, prompt_max=100, sample_sigma=0.5)
    prompts = make_batch(w, 3, 5, 24, 4)
    rng = np.random.default_rng(0)
    shuffled = [dataclasses.replace(p, response_lens=prompts[j].response_lens)
                for p, j in zip(prompts, rng.permutation(len(prompts)))]
    assert [p.response_lens for p in shuffled] != [p.response_lens for p in prompts]
    for ranks in (1, 3, 7):
        a = place_prompts([len(p.tokens) for p in prompts], ranks)
        b = place_prompts([len(p.tokens) for p in shuffled], ranks)
        assert (a == b).all()


def test_workload_is_a_pure_function_of_seed_and_batch():
    cfg = WorkloadConfig(sample_sigma=0.3)
    a, b = make_batch(cfg, 7, 3, 16, 4), make_batch(cfg, 7, 3, 16, 4)
    assert a == b and make_batch(cfg, 7, 4, 16, 4) != a
    lens = np.array([p.response_lens for p in make_batch(cfg, 7, 0, 2000, 4)])
    assert cfg.length_min <= lens.min() and lens.max() <= cfg.length_max
    assert abs(np.median(lens) - cfg.length_median) <= 2
    assert (lens.std(axis=1) > 0).mean() > 0.9               # the samples of a group differ in length
    late = np.array([p.response_lens for p in make_batch(cfg, 7, 20, 2000, 4)])
    assert np.median(late) > np.median(lens)                  # lengths drift upward with the batch index
    assert sample_seed(1, 2, 3, 4) == sample_seed(1, 2, 3, 4) != sample_seed(1, 2, 3, 5)
    # the prompts are the shape's: the simulator prices exactly what the runtime generates
    shape = batch_shape(cfg, 7, 3, 16, 4)
    assert [len(p.tokens) for p in a] == shape.prompt_lens.tolist()
    assert [list(p.response_lens) for p in a] == shape.response_lens.tolist()


def test_workload_schedules_and_mixtures():
    w = WorkloadConfig(length_median=500, length_max=1000, length_max_schedule=[[0, 1000], [5, 3000]],
                       prompt_median=50, prompt_sigma=0.3, prompt_max=80,
                       mixture=[{"length_median": 2000}, {"length_median": 50, "prompt_median": 10}],
                       mixture_block=2)
    assert [response_cap(w, b) for b in (0, 4, 5, 99)] == [1000, 1000, 3000, 3000]
    s0, s2, s6 = (batch_shape(w, 1, b, 10, 4) for b in (0, 2, 6))
    assert s0.prompts == 10 and s0.trained.tolist() == list(range(10)) and s0.rounds == ()
    assert s0.response_lens.max() <= 1000 and (s0.response_lens == 1000).mean() > 0.5   # cut at the cap
    assert np.median(s2.response_lens) < 100 and np.median(s6.response_lens) < 100       # the short task
    assert s6.response_lens.max() <= 3000 and np.median(s0.prompt_lens) > np.median(s2.prompt_lens)
    assert 0 < s0.prompt_lens.min() and s0.prompt_lens.max() <= 80 + 8 + 2


def test_dynamic_sampling_rounds_as_the_simulator_draws_them():
    """filtered_shape: rounds of prompts_per_batch new groups (round 0: the plain batch), each
    group's rewards differing with the workload's signal share, until enough differ; the trainer
    takes the first prompts_per_batch of those; at most max_rounds rounds."""
    w = WorkloadConfig(length_median=50, length_max=200, signal_share=[[0, 0.8], [10, 0.2]])
    plain = batch_shape(w, 1, 0, 100, 4)
    assert signal_share(w, 5) == pytest.approx(0.5)
    early, late = filtered_shape(w, 1, 0, 100, 4, 6), filtered_shape(w, 1, 10, 100, 4, 6)
    assert early.rounds == (100, 100) and np.array_equal(early.prompt_lens[:100], plain.prompt_lens)
    assert early.trained_prompts == 100 and early.trained.max() >= 100       # some groups of round 1 are kept
    assert not np.array_equal(early.response_lens[:100], early.response_lens[100:])   # a round of its own
    assert len(late.rounds) in (5, 6) and late.trained_prompts <= 100
    capped = filtered_shape(w, 1, 10, 100, 4, 2)
    assert capped.rounds == (100, 100) and capped.trained_prompts < 100         # short after max_rounds
    assert np.array_equal(filtered_shape(w, 1, 10, 100, 4, 1).response_lens, batch_shape(w, 1, 10, 100, 4).response_lens)


def test_workload_validation_names_the_field():
    for bad, field in (({"signal_share": [[0, 1.5]]}, "workload.signal_share"),
                       ({"length_max_schedule": [[5, 100], [2, 200]]}, "workload.length_max_schedule"),
                       ({"mixture": [{"length_mean": 3}]}, "workload.mixture[0]"),
                       ({"prompt_median": 10.0}, "workload.prompt_max"),
                       ({"length_max_schedule": [[0, 96], [3, 400]]}, "model.max_position")):
        with pytest.raises(ConfigError, match=field.replace("[", r"\[").replace("]", r"\]")):
            load_config({"workload": bad})


def test_builtin_task_is_scored_through_the_reward_interface():
    """A digit task's prompt carries its text and answer; the Scorer decodes the response tokens
    and calls digit_match as it would call a user's reward."""
    from dynaresize.config import RewardConfig
    from dynaresize.data.model import EOS_ID
    from dynaresize.data.rewards import Scorer
    from dynaresize.data.workload import DIGIT_IDS, DigitTask
    p = make_batch(WorkloadConfig(task="reverse"), 0, 0, 1, 2)[0]
    assert p.text.endswith("=") and p.answer.isdigit() and p.answer == p.text[:-1][::-1]
    score = Scorer(RewardConfig(), DigitTask(WorkloadConfig()).decode, [EOS_ID])
    exact = [DIGIT_IDS[int(d)] for d in p.answer]
    assert score(p, exact + [EOS_ID], 0, 0) == 1.0
    assert score(p, exact, 0, 0) == pytest.approx(len(p.answer) / (len(p.answer) + 1))   # cut, not stopped
    assert score(p, [], 0, 0) == 0.0
    half = exact[: len(exact) // 2]
    assert score(p, half, 0, 0) == pytest.approx(len(half) / (len(p.answer) + 1))


def test_sample_token_uses_only_its_generator():
    logits = torch.randn(32)
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    torch.manual_seed(0)
    a = [sample_token(logits, g1, 1.0) for _ in range(20)]
    torch.manual_seed(99)                         # the global RNG must not matter
    b = [sample_token(logits, g2, 1.0) for _ in range(20)]
    assert a == b
    token, logp = sample_token(logits, torch.Generator(), 0.0)
    assert token == int(logits.argmax())
    assert logp == pytest.approx(float(torch.log_softmax(logits, -1)[token]))


def test_load_config_lists_every_problem_at_once():
    with pytest.raises(ConfigError) as e:
        load_config({"cluster": {"ranks": 4}, "policy": {"train_ranks": 9}, "trainer": {"lr": 0}})
    assert "policy.train_ranks" in str(e.value) and "trainer.lr" in str(e.value)
