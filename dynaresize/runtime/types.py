"""Types handed between mechanisms: a generated sample (rollout -> exchange -> trainer,
checkpoint) and a range of optimizer state (trainer -> staging -> trainer, checkpoint). They live
here so that staging and checkpoints need not import the trainer."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:      # torch only in annotations: the launcher imports this module without it
    import torch


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

