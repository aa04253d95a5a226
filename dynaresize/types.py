"""Types handed between mechanisms: a generated sample (rollout -> exchange -> trainer,
checkpoint), a range of optimizer state (trainer -> staging -> trainer, checkpoint) and what a
rank holds (job -> switch -> job). They live here so that staging and checkpoints need not import
the trainer."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from .roles import RoleTable

if TYPE_CHECKING:      # torch only in annotations: the launcher imports this module without it
    import torch

    from .rollout.base import RolloutEngine
    from .trainer import ShardedTrainer


@dataclass
class Sample:
    """One generated sample, as handed from rollout to training (and recorded on the timeline)."""
    batch: int
    index: int
    prompt: int
    rank: int
    prompt_tokens: list[int]
    response: list[int]
    logprobs: list[float]
    length_cap: int                # the hidden response length the workload gave it (see shapes.py)
    reward: float


@dataclass
class ShardState:
    """Optimizer state of one contiguous range [lo, hi) of the flat vector."""
    lo: int
    hi: int
    params: torch.Tensor      # float32 master copy of the range
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    step: int


@dataclass
class RankState:
    """What one rank holds between iterations. Set at start-up; afterwards only a switch changes
    it (`resize.switch` takes the state and the plan and returns the next state)."""
    table: RoleTable                          # the role table this rank runs under
    engine: Optional["RolloutEngine"]         # generating (the table says it generates)
    trainer: Optional["ShardedTrainer"]       # training: its shard of the optimizer state
    parked_engine: Optional["RolloutEngine"] = None   # released by a switch, kept for a return to rollout
    parked_ranks: frozenset = frozenset()     # every rank holding a parked engine, as the switch plans see them
