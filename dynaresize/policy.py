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

    def __init__(self, cfg: PolicyConfig, world: int):
        self.cfg, self.world = cfg, world

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


def make_policy(cfg: PolicyConfig, world: int) -> Policy:
    policies = {"static": StaticPolicy}
    return policies[cfg.name](cfg, world)
