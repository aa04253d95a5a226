"""A verifiable synthetic task with a rule-based reward, on batches shaped like RL post-training's.

Prompts are digit strings ("<bos>4 7 1 9=") and the answer is a rule of them (reversed, sorted, or
the sum of two numbers) followed by <eos>. The reward is the fraction of answer positions the
response gets right, so a random policy already earns some and GRPO has a signal.

How many prompts a batch has, how long they are and where each sample's response ends come from
dynaresize.shapes (one pure function, shared with the simulator): long-tailed, drifting hidden
response lengths stand in for the reasoning lengths of real RL post-training. An optional
instruction context (random digits before the question) gives prompts a realistic length spread.

Everything here is a pure function of (seed, batch index, prompt index, sample index): where or by
how many ranks a batch is generated never changes it.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from .config import WorkloadConfig
from .model import BOS_ID, CHARS, EOS_ID
from .shapes import batch_shape, keyed_rng

DIGIT_IDS = [3 + CHARS.index(d) for d in "0123456789"]
EQUALS_ID = 3 + CHARS.index("=")
PLUS_ID = 3 + CHARS.index("+")
_TOKEN_STREAM = 0x746F6B              # "tok": the digit values of a batch's prompts


@dataclass(frozen=True)
class Prompt:
    index: int                     # position in the batch
    tokens: tuple[int, ...]
    answer: tuple[int, ...]        # expected response, ending in <eos>
    response_lens: tuple[int, ...]  # hidden: where each sample's response ends (engines stop there)


def make_batch(cfg: WorkloadConfig, seed: int, batch: int, num_prompts: int,
               samples_per_prompt: int) -> list[Prompt]:
    """The prompts of batch `batch`: `num_prompts` trained ones, more when over-sampling."""
    shape = batch_shape(cfg, seed, batch, num_prompts, samples_per_prompt)
    rng = keyed_rng(seed, batch, _TOKEN_STREAM)
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
        prompts.append(Prompt(index=i, tokens=(BOS_ID, *context, *question, EQUALS_ID),
                              answer=(*answer, EOS_ID),
                              response_lens=tuple(int(x) for x in shape.response_lens[i])))
    return prompts


def sample_seed(seed: int, batch: int, prompt: int, sample: int) -> int:
    """The RNG seed of one sample: a function of its identity only, never of its placement."""
    return int(keyed_rng(seed, batch, prompt, sample).integers(0, 2**62))


def reward(prompt: Prompt, response: list[int]) -> float:
    """Fraction of answer positions (the <eos> included) that the response matches."""
    hits = sum(1 for want, got in zip(prompt.answer, response) if want == got)
    return hits / len(prompt.answer)


def digest(tokens: list[int]) -> int:
    """A 64-bit hash of a token sequence, recorded on the timeline to compare runs cheaply."""
    raw = np.asarray(tokens, dtype=np.int64).tobytes()
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little")
