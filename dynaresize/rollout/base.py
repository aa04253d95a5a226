"""The rollout engine interface (placement of prompt groups on ranks: dynaresize.placement).

An engine generates samples for prompt groups with one RNG seed per sample, takes new weights in
place, and releases / restores its memory when its rank changes role. Engines must be placement
invariant: a sample's tokens depend on (seed, weights, prompt) only, never on what else is in the
batch or which rank runs it. The torch and vLLM engines pass the same contract tests.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Protocol

import torch

from ..config import RolloutConfig
from ..workload import Prompt


@dataclass(frozen=True)
class GroupRequest:
    """All samples of one prompt: GRPO's group."""
    prompt: Prompt
    seeds: tuple[int, ...]       # one per sample
    first_index: int             # batch-wide index of the first sample


@dataclass
class Generation:
    """What the engine produced for one sample (response ends at <eos> or its hidden length)."""
    tokens: list[int]
    logprobs: list[float]        # behaviour-policy log-probabilities of `tokens`


class RolloutEngine(Protocol):
    name: str

    def generate(self, requests: list[GroupRequest], temperature: float) -> list[list[Generation]]:
        """One list of Generations per request, in request order."""

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace the weights in place (Hugging Face parameter names)."""

    def named_weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        """The engine's current weights, for checks (may be a copy)."""

    def release(self) -> None:
        """Free the engine's memory; the rank is leaving rollout."""

    def restore(self) -> None:
        """Be ready to generate again (weights must be loaded after)."""

    def close(self) -> None:
        ...


def make_engine(cfg: RolloutConfig, checkpoint: str, dtype: str, device: str, seed: int) -> RolloutEngine:
    if cfg.engine == "torch":
        from .torch_engine import TorchEngine
        return TorchEngine(checkpoint, dtype=dtype, device=device, ignore_eos=cfg.ignore_eos)
    if cfg.engine == "vllm":
        from .vllm_engine import VLLMEngine
        return VLLMEngine(cfg, checkpoint, dtype=dtype, device=device, seed=seed)
    raise ValueError(f"rollout.engine: unknown engine {cfg.engine!r}")
