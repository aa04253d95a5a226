"""Split policies: given the stage times of the last iterations, choose the next split.

One interface for the runtime and the simulator: `decide(stats) -> Decision`, where `stats` are
the measured (or simulated) stage times of one iteration. Decisions are made on rank 0 and
broadcast, and every decision, kept or moved, is recorded on the timeline with its reason.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from .config import PolicyConfig


@dataclass(frozen=True)
class IterationStats:
    iteration: int
    train_ranks: int
    world: int
    rollout_time: float            # slowest rollout rank's generation time (s); 0 if none ran
    train_time: float              # slowest train rank's update time (s); 0 if none ran
    switch_time: float = 0.0       # critical-path time of the switch at the start of the iteration
    mean_length: float = 0.0       # mean response length of the batch generated
    generated: bool = True
    trained: bool = True


@dataclass(frozen=True)
class Decision:
    iteration: int
    from_train: int
    to_train: int
    reason: str
    rollout_time: float = math.nan
    train_time: float = math.nan
    predicted_gain: float = math.nan
    predicted_cost: float = math.nan
    attrs: dict = field(default_factory=dict)

    @property
    def moves(self) -> bool:
        return self.to_train != self.from_train

    def row(self, table_version: int) -> dict:
        return {"iteration": self.iteration, "table_version": table_version, "from_train": self.from_train,
                "to_train": self.to_train, "action": "move" if self.moves else "keep",
                "reason": self.reason, "rollout_time": self.rollout_time, "train_time": self.train_time,
                "predicted_gain": self.predicted_gain, "predicted_cost": self.predicted_cost,
                "attrs": self.attrs}


class Policy:
    name = "policy"

    def __init__(self, cfg: PolicyConfig, world: int, max_lag: int = 1):
        self.cfg, self.world, self.max_lag = cfg, world, max_lag

    def initial_train_ranks(self) -> int:
        return self.cfg.train_ranks

    def decide(self, stats: IterationStats) -> Decision:
        raise NotImplementedError

    def state(self) -> dict:
        """What a checkpoint must hold to resume the policy exactly."""
        return {}

    def load_state(self, state: dict) -> None:
        pass


class StaticPolicy(Policy):
    """A fixed split: the baseline every dynamic result is compared with."""
    name = "static"

    def decide(self, stats: IterationStats) -> Decision:
        return Decision(stats.iteration, stats.train_ranks, stats.train_ranks, "static",
                        stats.rollout_time, stats.train_time)



class ColocatedPolicy(StaticPolicy):
    """Every rank generates, then every rank trains: a switch of engine memory every iteration.

    The placement most RL frameworks default to, kept as a baseline in the same runtime.
    """
    name = "colocated"

    def initial_train_ranks(self) -> int:
        return self.world


class ScriptedPolicy(Policy):
    """Splits by iteration from `policy.schedule` (train ranks of iterations 0, 1, ...; the last holds)."""
    name = "scripted"

    def initial_train_ranks(self) -> int:
        return self.cfg.schedule[0]

    def decide(self, stats: IterationStats) -> Decision:
        schedule = self.cfg.schedule
        target = schedule[min(stats.iteration + 1, len(schedule) - 1)]
        return Decision(stats.iteration, stats.train_ranks, target,
                        "scripted" if target != stats.train_ranks else "scripted: keep",
                        stats.rollout_time, stats.train_time)


class DynamicPolicy(Policy):
    """Move `resize_unit` ranks at a time toward the split that minimises the predicted iteration time.

    Prediction: each stage's work is its smoothed time x its ranks (time ~ work / ranks); rollout work
    is scaled by the trend of response lengths (they drift up as training proceeds). The predicted
    iteration time is max(rollout, train) when the stages overlap (max_lag 1) and their sum when they
    do not (max_lag 0). Hysteresis keeps it from thrashing:
    - dead band: a relative imbalance below `dead_band` counts as balanced;
    - patience: the same imbalance must persist `patience` iterations;
    - cooldown: no move for `cooldown` iterations after one;
    - a cap of `max_units_per_move` units per move;
    - payback: the predicted gain over `horizon` iterations must exceed the predicted switch cost,
      a running average of measured switch times (starting from `switch_cost_s`).
    """
    name = "dynamic"

    def __init__(self, cfg: PolicyConfig, world: int, max_lag: int = 1):
        super().__init__(cfg, world, max_lag)
        self.rollout_ema = self.train_ema = self.length_ema = None
        self.length_growth = 1.0           # smoothed ratio of mean length to the previous iteration's
        self.switch_cost = cfg.switch_cost_s
        self.streak = 0                    # signed count of consecutive iterations out of balance
        self.since_move = cfg.cooldown     # iterations since the last move
        self.just_moved = False

    def _smooth(self, old, new):
        a = self.cfg.smoothing
        return new if old is None else a * new + (1 - a) * old

    def predict(self, k: int) -> tuple[float, float]:
        """Predicted (rollout, train) stage times of the next iteration with k train ranks."""
        cur = self.current_train
        rollout_work = self.rollout_ema * (self.world - cur) * self.length_growth
        train_work = self.train_ema * cur * self.length_growth
        return rollout_work / (self.world - k), train_work / k

    def iteration_time(self, k: int) -> float:
        r, t = self.predict(k)
        return max(r, t) if self.max_lag >= 1 else r + t

    def decide(self, s: IterationStats) -> Decision:
        self.current_train = s.train_ranks
        self.since_move += 1
        if self.just_moved and s.switch_time > 0:      # learn what a switch really costs
            self.switch_cost = 0.5 * self.switch_cost + 0.5 * s.switch_time
        self.just_moved = False
        if not (s.generated and s.trained) or s.rollout_time <= 0 or s.train_time <= 0:
            return self._keep(s, "warming up: not both stages ran")

        self.rollout_ema = self._smooth(self.rollout_ema, s.rollout_time)
        self.train_ema = self._smooth(self.train_ema, s.train_time)
        if s.mean_length > 0:
            if self.length_ema is not None:
                self.length_growth = self._smooth(self.length_growth, s.mean_length / self.length_ema)
            self.length_ema = self._smooth(self.length_ema, s.mean_length)

        r, t = self.predict(s.train_ranks)
        imbalance = (r - t) / max(r, t)               # > 0: rollout-bound, < 0: train-bound
        direction = 1 if imbalance > 0 else -1
        numbers = {"imbalance": round(imbalance, 4), "cost": round(self.switch_cost, 4)}
        if abs(imbalance) < self.cfg.dead_band:
            self.streak = 0
            return self._keep(s, "balanced (inside dead band)", r, t, numbers)
        self.streak = self.streak + direction if self.streak * direction > 0 else direction
        if abs(self.streak) < self.cfg.patience:
            return self._keep(s, f"patience {abs(self.streak)}/{self.cfg.patience}", r, t, numbers)
        if self.since_move <= self.cfg.cooldown:
            return self._keep(s, f"cooldown {self.since_move}/{self.cfg.cooldown}", r, t, numbers)

        unit = self.cfg.resize_unit
        # Rollout-bound: give rollout ranks (fewer train ranks); train-bound: the other way.
        step = -unit if direction > 0 else unit
        candidates = [s.train_ranks + step * n for n in range(1, self.cfg.max_units_per_move + 1)]
        candidates = [k for k in candidates if unit <= k <= self.world - unit]
        if not candidates:
            return self._keep(s, "at the limit of the allocation", r, t, numbers)
        now = self.iteration_time(s.train_ranks)
        best = min(candidates, key=self.iteration_time)
        gain = now - self.iteration_time(best)
        horizon = self.cfg.patience + self.cfg.cooldown + 1
        numbers.update(horizon=horizon)
        if gain * horizon <= self.switch_cost:
            return self._keep(s, "predicted gain below switch cost", r, t, numbers, gain)
        self.streak, self.since_move, self.just_moved = 0, 0, True
        why = "rollout-bound" if direction > 0 else "train-bound"
        return Decision(s.iteration, s.train_ranks, best, f"move: {why}", r, t, gain, self.switch_cost, numbers)

    def _keep(self, s, reason, r=math.nan, t=math.nan, attrs=None, gain=math.nan) -> Decision:
        return Decision(s.iteration, s.train_ranks, s.train_ranks, reason, r, t, gain, self.switch_cost,
                        attrs or {})

    def state(self) -> dict:
        return {k: getattr(self, k) for k in ("rollout_ema", "train_ema", "length_ema", "length_growth",
                                               "switch_cost", "streak", "since_move", "just_moved")}

    def load_state(self, state: dict) -> None:
        for k, v in state.items():
            setattr(self, k, v)


POLICIES = {p.name: p for p in (StaticPolicy, ColocatedPolicy, ScriptedPolicy, DynamicPolicy)}


def make_policy(cfg: PolicyConfig, world: int, max_lag: int = 1) -> Policy:
    return POLICIES[cfg.name](cfg, world, max_lag)
