"""Hysteresis of the dynamic policy, on recorded and closed-loop stage-time sequences."""
from __future__ import annotations

import random

from dynaresize.config import PolicyConfig
from dynaresize.policy import DynamicPolicy, IterationStats, ScriptedPolicy, make_policy


def run_closed_loop(policy, world, k, rollout_work, train_work, iterations, noise=0.05, seed=0):
    """Stage times follow the split (time = work / ranks) with noise; returns the split of each iteration."""
    rng = random.Random(seed)
    splits = []
    for it in range(iterations):
        rw = rollout_work(it) if callable(rollout_work) else rollout_work
        tw = train_work(it) if callable(train_work) else train_work
        r = rw / (world - k) * (1 + rng.uniform(-noise, noise))
        t = tw / k * (1 + rng.uniform(-noise, noise))
        splits.append(k)
        k = policy.decide(IterationStats(it, k, world, r, t)).to_train
    return splits


def test_noise_around_balance_never_moves():
    policy = DynamicPolicy(PolicyConfig(name="dynamic", train_ranks=4, switch_cost_s=0.0), world=8)
    splits = run_closed_loop(policy, 8, 4, rollout_work=4.0, train_work=4.0, iterations=100, noise=0.10)
    assert set(splits) == {4}


def test_step_change_moves_after_patience_and_settles_without_oscillation():
    cfg = PolicyConfig(name="dynamic", train_ranks=4, patience=3, cooldown=2, switch_cost_s=0.01)
    policy = DynamicPolicy(cfg, world=8)
    # Balanced at 4/4 until iteration 20, then rollout work triples (responses got much longer).
    splits = run_closed_loop(policy, 8, 4, rollout_work=lambda it: 4.0 if it < 20 else 12.0,
                             train_work=4.0, iterations=80, noise=0.03)
    assert set(splits[:20]) == {4}
    first_move = next(i for i, k in enumerate(splits) if k != 4)
    assert first_move >= 20 + cfg.patience, f"moved at {first_move}, before the patience ran out"
    changes = [(i, a, b) for i, (a, b) in enumerate(zip(splits, splits[1:]), start=1) if a != b]
    assert all(b < a for _, a, b in changes), f"not monotone (oscillates): {changes}"
    assert all(a - b == 1 for _, a, b in changes)                       # one unit per move
    assert all(j - i > cfg.cooldown for (i, _, _), (j, _, _) in zip(changes, changes[1:]))
    # With 2 train ranks both stages take 12/6 = 4/2 = 2 s: the balanced split, where it must settle.
    assert splits[-1] == 2 and set(splits[-20:]) == {2}


def test_gain_below_switch_cost_keeps():
    cfg = PolicyConfig(name="dynamic", train_ranks=4, patience=1, cooldown=0, switch_cost_s=100.0)
    policy = DynamicPolicy(cfg, world=8)
    splits = run_closed_loop(policy, 8, 4, rollout_work=8.0, train_work=4.0, iterations=20, noise=0.0)
    assert set(splits) == {4}
    d = policy.decide(IterationStats(20, 4, 8, 2.0, 1.0))
    assert not d.moves and d.reason == "predicted gain below switch cost" and d.predicted_gain > 0


def test_warm_up_iterations_do_not_count():
    policy = DynamicPolicy(PolicyConfig(name="dynamic", train_ranks=2, patience=1), world=4)
    d = policy.decide(IterationStats(0, 2, 4, 5.0, 0.0, trained=False))
    assert not d.moves and d.reason.startswith("warming up")


def test_state_round_trip_resumes_identically():
    cfg = PolicyConfig(name="dynamic", train_ranks=4, patience=2, cooldown=1, switch_cost_s=0.01)
    a, b = DynamicPolicy(cfg, 8), DynamicPolicy(cfg, 8)
    stats = [IterationStats(i, 4, 8, 3.0 + 0.1 * i, 1.0) for i in range(3)]
    for s in stats:
        a.decide(s)
    b.load_state(a.state())
    s = IterationStats(3, 4, 8, 3.5, 1.0)
    assert a.decide(s) == b.decide(s)


def test_scripted_and_static():
    scripted = ScriptedPolicy(PolicyConfig(name="scripted", schedule=[1, 3, 2]), world=4)
    assert scripted.initial_train_ranks() == 1
    assert scripted.decide(IterationStats(0, 1, 4, 1, 1)).to_train == 3
    assert scripted.decide(IterationStats(5, 2, 4, 1, 1)).to_train == 2          # the last entry holds
    static = make_policy(PolicyConfig(name="static", train_ranks=2), 4)
    assert not static.decide(IterationStats(3, 2, 4, 9.0, 0.1)).moves
