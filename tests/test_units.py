"""Unit tests of the pieces that need no MPI: roles, placement, workload, sampling, config."""
from __future__ import annotations

import pytest
import torch

from dynaresize.config import ConfigError, load_config
from dynaresize.roles import Role, RoleTable
from dynaresize.rollout.base import place_groups
from dynaresize.rollout.torch_engine import sample_token
from dynaresize.workload import make_batch, reward, sample_seed
from dynaresize.config import WorkloadConfig


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


def test_place_groups_balances_longest_first_and_covers_all():
    caps = [90, 10, 10, 10, 40, 40, 5, 5]
    placed = place_groups(caps, 3)
    assert sorted(i for p in placed for i in p) == list(range(8))
    loads = [sum(caps[i] for i in p) for p in placed]
    assert max(loads) == 90                      # the longest prompt alone sets the floor
    assert place_groups(caps, 3) == placed       # deterministic


def test_workload_is_a_pure_function_of_seed_and_batch():
    cfg = WorkloadConfig()
    a, b = make_batch(cfg, 7, 3, 16), make_batch(cfg, 7, 3, 16)
    assert a == b and make_batch(cfg, 7, 4, 16) != a
    caps = [p.length_cap for p in make_batch(cfg, 7, 0, 2000)]
    assert cfg.length_min <= min(caps) and max(caps) <= cfg.length_max
    median = sorted(caps)[len(caps) // 2]
    assert abs(median - cfg.length_median) <= 2
    late = [p.length_cap for p in make_batch(cfg, 7, 20, 2000)]
    assert sorted(late)[1000] > median           # lengths drift upward with the batch index
    assert sample_seed(1, 2, 3, 4) == sample_seed(1, 2, 3, 4) != sample_seed(1, 2, 3, 5)


def test_reward_is_fraction_of_answer_positions():
    p = make_batch(WorkloadConfig(task="reverse"), 0, 0, 1)[0]
    assert reward(p, list(p.answer)) == 1.0
    assert reward(p, []) == 0.0
    half = list(p.answer[: len(p.answer) // 2])
    assert reward(p, half) == pytest.approx(len(half) / len(p.answer))


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
