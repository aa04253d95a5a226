"""Where prompts come from: the built-in verifiable digit tasks, or your dataset (dynaresize/data/datasets.py).

A task hands the rollout ranks the prompts of a batch (token ids, the text and the reference
answer a reward sees) and turns response tokens back into text for the reward (dynaresize/data/rewards.py).

Built-in tasks: prompts are digit strings ("<bos>4 7 1 9=") and the answer is a rule of them
(reversed, sorted, or the sum of two numbers). The reward (rewards.digit_match) is the fraction of
answer positions the response gets right, plus stopping right after it, so a random policy already
earns some and GRPO has a signal.

How many prompts a batch has, how long they are and where each sample's response ends come from
dynaresize.data.shapes (one pure function, shared with the simulator): long-tailed, drifting hidden
response lengths stand in for the reasoning lengths of real RL post-training. An optional
instruction context (random digits before the question) gives prompts a realistic length spread.

Everything here is a pure function of (seed, batch index, prompt index, sample index): where or by
how many ranks a batch is generated never changes it.
"""
from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from ..config import WorkloadConfig
from .vocab import BOS_ID, CHARS, SPECIAL
from .shapes import batch_shape, keyed_rng, round_seed

DIGIT_IDS = [3 + CHARS.index(d) for d in "0123456789"]
EQUALS_ID = 3 + CHARS.index("=")
PLUS_ID = 3 + CHARS.index("+")
_TOKEN_STREAM = 0x746F6B              # "tok": the digit values of a batch's prompts
HELD_OUT = 0x6576616C                 # "eval": the seed key of the held-out prompts (and their samples)


@dataclass(frozen=True)
class Prompt:
    index: int                     # position in the batch
    tokens: tuple[int, ...]
    answer: str                    # the reference answer, for the reward
    response_lens: tuple[int, ...]  # where each sample's response is cut at the latest (engines stop there)
    text: str = ""                 # the prompt as the reward sees it
    extra: dict[str, Any] = field(default_factory=dict)  # a dataset row's other fields, for the reward


class Task(Protocol):
    """A source of prompts: the built-in digit tasks or a dataset."""

    def batch(self, seed: int, batch: int, num_prompts: int, samples_per_prompt: int, round: int = 0) -> list[Prompt]:
        """The prompts of batch `batch` (of its round `round`: dynamic sampling's later rounds
        generate other prompts), a pure function of its arguments; indexed from 0."""

    def held_out(self, seed: int, num_prompts: int, samples_per_prompt: int, cap: int) -> list[Prompt]:
        """The evaluation's prompts (never trained on), each sample allowed up to `cap` tokens."""

    def decode(self, tokens: list[int]) -> str:
        """Response tokens as the reward reads them (special tokens dropped)."""


class DigitTask:
    """The built-in tasks (workload.task reverse | sort | add) with the character vocabulary."""

    def __init__(self, cfg: WorkloadConfig):
        self.cfg = cfg

    def batch(self, seed: int, batch: int, num_prompts: int, samples_per_prompt: int, round: int = 0) -> list[Prompt]:
        return make_batch(self.cfg, seed, batch, num_prompts, samples_per_prompt, round)

    def held_out(self, seed: int, num_prompts: int, samples_per_prompt: int, cap: int) -> list[Prompt]:
        """Prompts of their own random stream (keyed by HELD_OUT), the same task and digit counts."""
        prompts = make_batch(self.cfg, seed ^ HELD_OUT, 0, max(num_prompts, 1), samples_per_prompt)
        return [dataclasses.replace(p, response_lens=(cap,) * samples_per_prompt) for p in prompts]

    def decode(self, tokens: list[int]) -> str:
        return decode_chars(tokens)


def decode_chars(tokens) -> str:
    """Text of the built-in character vocabulary (ids below len(SPECIAL) are special, dropped)."""
    n = len(SPECIAL)
    return "".join(CHARS[t - n] for t in tokens if n <= t < n + len(CHARS))


def make_batch(cfg: WorkloadConfig, seed: int, batch: int, num_prompts: int,
               samples_per_prompt: int, round: int = 0) -> list[Prompt]:
    """The `num_prompts` prompts of batch `batch` (of its round `round`)."""
    shape = batch_shape(cfg, seed, batch, num_prompts, samples_per_prompt, round)
    rng = keyed_rng(round_seed(seed, round), batch, _TOKEN_STREAM)
    prompts = []
    for i in range(shape.prompts):
        n = int(shape.digits[i])
        context = [DIGIT_IDS[d] for d in rng.integers(0, 10, int(shape.context_lens[i]))]
        digits = [int(d) for d in rng.integers(0, 10, n)]
        if cfg.task == "add":
            split = max(1, n // 2)
            a, b = digits[:split], digits[split:] or [0]
            question = [DIGIT_IDS[d] for d in a] + [PLUS_ID] + [DIGIT_IDS[d] for d in b]
            total = int("".join(map(str, a))) + int("".join(map(str, b)))
            answer = [DIGIT_IDS[int(d)] for d in str(total)]
        else:
            question = [DIGIT_IDS[d] for d in digits]
            answer = [DIGIT_IDS[d] for d in (digits[::-1] if cfg.task == "reverse" else sorted(digits))]
        tokens = (BOS_ID, *context, *question, EQUALS_ID)
        prompts.append(Prompt(index=i, tokens=tokens, answer=decode_chars(answer),
                              response_lens=tuple(int(x) for x in shape.response_lens[i]),
                              text=decode_chars(tokens), extra={"task": cfg.task}))
    return prompts


def sample_seed(seed: int, batch: int, prompt: int, sample: int) -> int:
    """The RNG seed of one sample: a function of its identity only, never of its placement."""
    return int(keyed_rng(seed, batch, prompt, sample).integers(0, 2**62))


def digest(tokens: list[int]) -> int:
    """A 64-bit hash of a token sequence, recorded on the timeline to compare runs cheaply."""
    raw = np.asarray(tokens, dtype=np.int64).tobytes()
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little")
