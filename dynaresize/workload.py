"""A verifiable synthetic task with a rule-based reward and long-tailed, drifting response lengths.

Prompts are digit strings ("<bos>4 7 1 9=") and the answer is a rule of them (reversed, sorted, or
the sum of two numbers) followed by <eos>. The reward is the fraction of answer positions the
response gets right, so a random policy already earns some and GRPO has a signal.

Each prompt carries a response-length cap drawn from a log-normal distribution whose median grows
with the batch index. It stands in for the reasoning length of real RL post-training: long-tailed
(a few samples take many times the median) and drifting (responses grow as training proceeds).
Default shape (median 16, sigma 0.8, +5 % per iteration): p99 / median = exp(2.326 * 0.8) ~ 6.4,
in the range reported for RL post-training length distributions (p99 about 10x the median in verl
issue reports); scale it with workload.length_sigma.

Everything here is a pure function of (seed, batch index, prompt index, sample index): where or by
how many ranks a batch is generated never changes it.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from .config import WorkloadConfig
from .model import BOS_ID, CHARS, EOS_ID

DIGIT_IDS = [3 + CHARS.index(d) for d in "0123456789"]
EQUALS_ID = 3 + CHARS.index("=")
PLUS_ID = 3 + CHARS.index("+")


@dataclass(frozen=True)
class Prompt:
    index: int             # position in the batch
    tokens: tuple[int, ...]
    answer: tuple[int, ...]   # expected response, ending in <eos>
    length_cap: int        # most response tokens a sample of this prompt may generate


def _rng(*key: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([abs(int(k)) for k in key]))


def make_batch(cfg: WorkloadConfig, seed: int, batch: int, num_prompts: int) -> list[Prompt]:
    rng = _rng(seed, batch, 0x70726F6D)
    median = cfg.length_median * (1.0 + cfg.length_growth) ** batch
    caps = np.clip(np.round(rng.lognormal(np.log(median), cfg.length_sigma, num_prompts)),
                   cfg.length_min, cfg.length_max).astype(int)
    prompts = []
    for i in range(num_prompts):
        n = int(rng.integers(cfg.digits_min, cfg.digits_max + 1))
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
        prompts.append(Prompt(index=i, tokens=(BOS_ID, *question, EQUALS_ID),
                              answer=(*answer, EOS_ID), length_cap=int(caps[i])))
    return prompts


def sample_seed(seed: int, batch: int, prompt: int, sample: int) -> int:
    """The RNG seed of one sample: a function of its identity only, never of its placement."""
    return int(_rng(seed, batch, prompt, sample).integers(0, 2**62))


def reward(prompt: Prompt, response: list[int]) -> float:
    """Fraction of answer positions (the <eos> included) that the response matches."""
    hits = sum(1 for want, got in zip(prompt.answer, response) if want == got)
    return hits / len(prompt.answer)


def digest(tokens: list[int]) -> int:
    """A 64-bit hash of a token sequence, recorded on the timeline to compare runs cheaply."""
    raw = np.asarray(tokens, dtype=np.int64).tobytes()
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little")
