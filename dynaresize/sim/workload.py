"""The simulated workload and placement: the runtime's, made fast enough for 1,024 ranks.

- `batch_caps` draws a batch's per-prompt length caps exactly as dynaresize.workload.make_batch
  does (same seed sequence, same draws; tested equal), without building the prompts.
- Prompt lengths: make_batch's own prompts when the run is small enough to afford it
  (`exact_prompts`), else drawn from the same distribution (digits_min..digits_max digits plus
  the task's fixed tokens) from a separate stream. They only enter the cost of prefill, attention
  and training, never the caps.
- `place` assigns prompt groups to rollout ranks exactly as dynaresize.rollout.base.place_groups
  (longest first onto the least-loaded rank, ties to the lower rank; tested equal) with a heap.

Nothing here imports torch.
"""
from __future__ import annotations

import heapq

import numpy as np

# The key of make_batch's generator for the caps and prompts of one batch (workload._rng).
_PROMPT_STREAM = 0x70726F6D
_SIM_STREAM = 0x73696D


def _rng(*key: int) -> np.random.Generator:
    """dynaresize.workload._rng: a generator keyed by integers."""
    return np.random.default_rng(np.random.SeedSequence([abs(int(k)) for k in key]))


def batch_caps(w, seed: int, batch: int, num_prompts: int) -> np.ndarray:
    """The response-length caps of batch `batch` (make_batch's `length_cap`s, in prompt order)."""
    rng = _rng(seed, batch, _PROMPT_STREAM)
    median = w.length_median * (1.0 + w.length_growth) ** batch
    return np.clip(np.round(rng.lognormal(np.log(median), w.length_sigma, num_prompts)),
                   w.length_min, w.length_max).astype(np.int64)


def prompt_extra_tokens(task: str) -> int:
    """Tokens of a prompt besides its digits: <bos> and '=' (and '+' for add)."""
    return 3 if task == "add" else 2


def sampled_prompt_lens(w, seed: int, batch: int, num_prompts: int) -> np.ndarray:
    """Prompt lengths drawn from make_batch's distribution (not its exact values)."""
    rng = _rng(seed, batch, _SIM_STREAM)
    digits = rng.integers(w.digits_min, w.digits_max + 1, num_prompts)
    return digits.astype(np.int64) + prompt_extra_tokens(w.task)


def exact_prompt_lens(w, seed: int, batch: int, num_prompts: int) -> np.ndarray:
    """make_batch's prompt lengths (builds the prompts: imports the runtime's workload module)."""
    from dynaresize.workload import make_batch
    return np.array([len(p.tokens) for p in make_batch(w, seed, batch, num_prompts)], dtype=np.int64)


def place(caps, ranks: int) -> np.ndarray:
    """The rollout rank (0..ranks-1) of each prompt, as place_groups places them.

    A heap of the ranks keyed by (load, rank), packed into one integer so that the heap compares
    plain ints: the same order as place_groups' `min(range(ranks), key=(load, rank))`.
    """
    caps = np.asarray(caps, dtype=np.int64)
    n = len(caps)
    assign = np.empty(n, dtype=np.int64)
    if n == 0:
        return assign
    if ranks < 1:
        raise ValueError("place: no rollout rank")
    if caps.min() < 0:
        raise ValueError("place: negative length cap")
    shift = max(int(ranks - 1).bit_length(), 1)
    mask = (1 << shift) - 1
    order = np.lexsort((np.arange(n), -caps))            # longest first, ties by prompt index
    ordered_caps = caps[order].tolist()
    heap = list(range(ranks))                           # load 0 on every rank
    out = []
    replace = heapq.heapreplace
    for cap in ordered_caps:
        top = heap[0]
        out.append(top & mask)
        replace(heap, top + (cap << shift))
    assign[order] = out
    return assign


def placement_lists(assign: np.ndarray, ranks: int) -> list[list[int]]:
    """`assign` in place_groups' format: the sorted prompt indices of each rank."""
    out: list[list[int]] = [[] for _ in range(ranks)]
    for i, r in enumerate(assign.tolist()):
        out[r].append(i)
    return out
