"""The shape of every batch: how many prompt groups, their prompt lengths, and where each sample's
response ends. One pure function of (workload config, seed, batch index), numpy only: the runtime
builds its prompts from it (workload.make_batch) and the simulator prices it directly.

Response lengths are per sample and *hidden*: they stand for where a sample's <eos> falls. The
rollout engines stop a sample there; placement and scheduling never read them (a real system does
not know a response's length before generating it); training and the analysis see them afterwards.

The length model (see dynaresize/conf/workload/ for the presets and their sources):
- each prompt has a difficulty scale, log-normal around the batch median (`length_sigma`), and
  each of its samples a spread around that scale (`sample_sigma`), so a GRPO group's samples
  differ in length as they do in practice;
- the median drifts by `length_growth` per batch (responses grow as the policy learns to reason),
  and may cycle (`length_period`, `length_amplitude`: a curriculum that cycles, a stress test);
- lengths are cut at the batch's cap (`length_max`, or `length_max_schedule` as DeepScaleR
  raised its max response length 8k -> 16k -> 24k during training);
- `mixture` rotates task presets (median, sigma, prompt length) every `mixture_block` batches.

DAPO's dynamic sampling (`trainer.filter_groups`) generates a batch in rounds of
prompts_per_batch groups, each round with prompts and lengths of its own (`round`), until
prompts_per_batch groups have rewards that differ or `trainer.filter_max_rounds` rounds are done;
the trainer takes those groups. The runtime knows which groups differ from their rewards; the
simulator draws it, each group with probability `workload.signal_share` (`filtered_shape`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

_SHAPE_STREAM = 0x73686170        # "shap": prompt and response lengths of a batch
_ROUND_STREAM = 0x726F756E        # "roun": the seed of a batch's later rounds (DAPO dynamic sampling)
_SIGNAL_STREAM = 0x7369676E       # "sign": which simulated groups have rewards that differ


def keyed_rng(*key: int) -> np.random.Generator:
    """A generator keyed by integers (the same key, the same draws, on any rank)."""
    return np.random.default_rng(np.random.SeedSequence([abs(int(k)) for k in key]))


def _piecewise(points, batch: int, default: float, linear: bool) -> float:
    """The value at `batch` of [[batch, value], ...]: linear between points (or the last point's
    value from it on), constant beyond both ends; `default` when there are no points."""
    if not points:
        return default
    xs = [float(p[0]) for p in points]
    ys = [float(p[1]) for p in points]
    if linear:
        return float(np.interp(batch, xs, ys))
    value = default
    for x, y in zip(xs, ys):
        if batch >= x:
            value = y
    return value


def response_cap(w, batch: int) -> int:
    """The batch's max response length (workload.length_max, or its schedule)."""
    return int(_piecewise(w.length_max_schedule, batch, w.length_max, linear=False))


def max_response_cap(w) -> int:
    """The largest cap any batch may have (for validation)."""
    return max([int(w.length_max)] + [int(p[1]) for p in w.length_max_schedule
                                     if isinstance(p, (list, tuple)) and len(p) == 2])


def signal_share(w, batch: int) -> float:
    """The share of batch `batch`'s prompt groups whose rewards differ, as the simulator draws it
    (workload.signal_share, linear between its points; 1 without)."""
    return _piecewise(w.signal_share, batch, 1.0, linear=True)


def round_seed(seed: int, round: int) -> int:
    """The seed of round `round` of a batch (round 0: the run's own, so a batch generated in one
    round is the batch without filtering)."""
    return seed if round == 0 else int(keyed_rng(seed, round, _ROUND_STREAM).integers(0, 2**62))


def task_index(w, batch: int) -> int:
    """Which entry of the mixture batch `batch` draws from (0 without a mixture): configuration,
    known before the batch is generated, as a data loader knows which dataset it reads."""
    return (batch // max(w.mixture_block, 1)) % len(w.mixture) if w.mixture else 0


def task_settings(w, batch: int) -> dict:
    """The length settings of batch `batch`: the workload's, overridden by its mixture entry."""
    out = {"length_median": w.length_median, "length_sigma": w.length_sigma,
           "prompt_median": w.prompt_median, "prompt_sigma": w.prompt_sigma}
    if w.mixture:
        out.update(w.mixture[task_index(w, batch)])
    return out


def prompt_extra_tokens(task: str) -> int:
    """Tokens of a prompt besides its context and digits: <bos> and '=' (and '+' for add)."""
    return 3 if task == "add" else 2


def longest_sequence(w) -> int:
    """The longest prompt plus response a built-in task's batch may hold (a dataset's prompts are
    measured by data.check_dataset; here its instruction context counts, as workload.prompt_max)."""
    return w.prompt_max + w.digits_max + prompt_extra_tokens(w.task) + max_response_cap(w)


@dataclass(frozen=True)
class BatchShape:
    digits: np.ndarray          # (prompts,) digits of each prompt's question
    context_lens: np.ndarray    # (prompts,) instruction tokens before the question
    prompt_lens: np.ndarray     # (prompts,) all prompt tokens
    response_lens: np.ndarray   # (prompts, samples) hidden response lengths, in [length_min, the batch's cap]
    trained: np.ndarray         # the prompt groups the trainer takes, in order
    rounds: tuple[int, ...] = ()    # prompt groups generated in each round, in order (): one round

    @property
    def prompts(self) -> int:
        return len(self.prompt_lens)

    @property
    def trained_prompts(self) -> int:
        return len(self.trained)


def batch_shape(w, seed: int, batch: int, prompts_per_batch: int, samples_per_prompt: int,
                round: int = 0) -> BatchShape:
    """The shape of batch `batch` (of its round `round`; see the module docstring)."""
    n = prompts_per_batch
    s = task_settings(w, batch)
    cap = response_cap(w, batch)
    rng = keyed_rng(round_seed(seed, round), batch, _SHAPE_STREAM)
    digits = rng.integers(w.digits_min, w.digits_max + 1, n)
    if s["prompt_median"] > 0:
        context = np.clip(np.round(rng.lognormal(math.log(s["prompt_median"]), s["prompt_sigma"], n)),
                          0, w.prompt_max).astype(np.int64)
    else:
        context = np.zeros(n, dtype=np.int64)
    median = s["length_median"] * (1.0 + w.length_growth) ** batch
    if w.length_period > 0:
        median *= math.exp(w.length_amplitude * math.sin(2 * math.pi * batch / w.length_period))
    scale = rng.lognormal(math.log(median), s["length_sigma"], n)
    spread = (rng.lognormal(0.0, w.sample_sigma, (n, samples_per_prompt)) if w.sample_sigma > 0
              else np.ones((n, samples_per_prompt)))
    lens = np.clip(np.round(scale[:, None] * spread), w.length_min, cap).astype(np.int64)
    prompt_lens = context + digits + prompt_extra_tokens(w.task)
    return BatchShape(digits.astype(np.int64), context, prompt_lens.astype(np.int64), lens, np.arange(n))


def filtered_shape(w, seed: int, batch: int, prompts_per_batch: int, samples_per_prompt: int,
                   max_rounds: int) -> BatchShape:
    """A batch of DAPO's dynamic sampling as the simulator sees it: rounds of prompts_per_batch
    groups, each group's rewards differing with probability signal_share (drawn per round), until
    prompts_per_batch such groups or `max_rounds` rounds; the trainer takes the first
    prompts_per_batch of them. With max_rounds 1 it is the plain batch."""
    parts, signal = [], []
    for r in range(max(max_rounds, 1)):
        parts.append(batch_shape(w, seed, batch, prompts_per_batch, samples_per_prompt, r))
        if max_rounds <= 1:
            return parts[0]
        draw = keyed_rng(seed, batch, r, _SIGNAL_STREAM).random(prompts_per_batch) < signal_share(w, batch)
        signal.append(draw)
        if np.concatenate(signal).sum() >= prompts_per_batch:
            break
    kept = np.flatnonzero(np.concatenate(signal))[:prompts_per_batch]
    return BatchShape(*(np.concatenate([getattr(p, f) for p in parts])
                        for f in ("digits", "context_lens", "prompt_lens", "response_lens")),
                      trained=kept, rounds=tuple(p.prompts for p in parts))


def generation_rounds(trainer) -> int:
    """The most rounds a batch is generated in: trainer.filter_max_rounds with filter_groups, else 1."""
    return trainer.filter_max_rounds if trainer.filter_groups else 1


__all__ = ["BatchShape", "batch_shape", "filtered_shape", "generation_rounds", "response_cap", "max_response_cap",
           "signal_share", "round_seed", "task_index", "task_settings", "prompt_extra_tokens"]
