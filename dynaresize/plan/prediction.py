"""What the next iterations will take on each split: the one prediction that the dynamic policy,
the oracle (dynaresize.sim) and the start-up choice of a split (`policy.train_ranks=auto`) share.

- `IterationModel` prices one iteration of a split with the cost model, the way the simulator
  runs it: the rollout ranks' list schedules (prompts placed by placement.place_prompts, so the
  slowest rank is floored by the longest sequences it holds and by its queue), the train ranks'
  micro-batches (placement.assign_micro_batches) with every pass the trainer runs, the exchange and
  the weight sync. The stages overlap with max_lag 1 (the iteration lasts the longer) and add up
  with max_lag 0. It also prices a switch between two splits: the critical path of the plan the
  runtime runs (switchplan.critical_time).
- `LengthForecast` says what a batch not generated yet will look like, from what a real system
  knows: the lengths of the batches already generated (per task of a mixture), their trend, and the
  configuration (the response cap of each batch, how many prompts a batch has, which task it is).
  A batch of DAPO's dynamic sampling is replayed with the rounds it took and the groups it trained:
  how many rounds the next one takes depends on rewards not drawn yet.
  It never reads a batch's hidden response lengths before the batch is generated. A response cut
  at its batch's cap says only that it would have been at least that long: past a cap rise, those
  responses are given the lengths of the tail a log-normal fitted to the batch puts beyond the old
  cap (`uncensor`).

The oracle gives IterationModel the true batches (it knows the future); the dynamic policy gives it
the forecast ones and corrects the cost model by the ratio of measured to predicted stage times.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import statistics
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterable

import numpy as np

from .costmodel import CostModel, GroupWork, Placement
from .hardware import ProfileError
from .migration import tail_schedule
from .placement import assign_micro_batches, by_weight, place_prompts
from .stealing import claim_schedule, queue_order
from ..data.shapes import filtered_shape, response_cap, task_index
from . import switchplan
from .roles import RoleTable

EXHAUSTIVE = 12       # candidate splits up to which every one is evaluated
NEIGHBOURS = 3        # beyond that: how far from the stages' crossing the search descends
TREND_WINDOW = 10     # batches of a task whose mean lengths give its growth trend
ENSEMBLE = 16         # recent batches of a task a forecast replays (their predictions are averaged)
RECENT = 4            # ... in the short variant, for lengths that change faster than ENSEMBLE batches
AHEAD = 8             # batches past the newest seen batch a trend is extrapolated (then held)
CHOICE_WINDOW = 8     # a task's latest one-step errors by which its forecast variant is chosen
CHOICE_MARGIN = 0.8   # another variant replaces the default when its error is below this x the default's
GROWTH_STEP = 0.04    # a member's growth (log of its length scale) is rounded to this (4 % in length)
PERIODS = range(2, 33)    # periods (in batches) with which a task's mean lengths may be found to repeat
HISTORY = 2 * PERIODS[-1]     # a task's newest mean lengths kept to find a period in (two of the longest)
PERIOD_PAIRS = 8      # pairs of batches a period apart its test needs, at least
PERIOD_MARGIN = 0.5   # a period is found where its differences are below this x those of one batch apart
PLACEMENTS = 2 * ENSEMBLE     # prompt sets whose placements IterationModel keeps (a forecast's, and more)
assert ENSEMBLE >= TREND_WINDOW     # the trend is read from the batches a forecast keeps
_PRIOR_STREAM = 0x70726972    # "prir": the configured workload's sample batch (not a real batch)


@dataclass(frozen=True, eq=False)
class Lengths:
    """The lengths of one batch: what pricing it needs. Compared by identity: IterationModel keeps
    what it priced on a batch as long as the batch lives (a forecast's members are reused)."""
    prompt_lens: np.ndarray      # (prompts,)
    response_lens: np.ndarray    # (prompts, samples per prompt)
    trained: np.ndarray          # the prompt groups the trainer takes, in order
    rounds: tuple[int, ...] = ()     # prompt groups generated in each round (dynamic sampling); (): one

    @classmethod
    def of(cls, shape) -> "Lengths":
        return cls(np.asarray(shape.prompt_lens), np.asarray(shape.response_lens), np.asarray(shape.trained),
                   tuple(shape.rounds))

    @property
    def prompts(self) -> int:
        return len(self.prompt_lens)

    @property
    def trained_prompts(self) -> int:
        return len(self.trained)

    @functools.cached_property
    def response_stats(self) -> tuple[float, int, int]:
        """(mean, shortest, longest) response length (0s for none): read by every forecast that
        replays the batch."""
        L = self.response_lens
        return (float(L.mean()), int(L.min()), int(L.max())) if L.size else (0.0, 0, 0)

    @functools.cached_property
    def _clipped_means(self) -> dict[int, float]:
        return {}

    def clipped_mean(self, cap: int) -> float:
        """The mean response length with responses clipped at `cap` (a task's trend compares its
        batches at their lowest cap), kept by cap."""
        if cap not in self._clipped_means:
            self._clipped_means[cap] = float(np.minimum(self.response_lens, cap).mean())
        return self._clipped_means[cap]

    def round_slices(self) -> list[slice]:
        """The prompt groups of each round (one slice: one round)."""
        ends = np.cumsum(self.rounds or (self.prompts,))
        return [slice(int(a), int(b)) for a, b in zip(np.concatenate(([0], ends[:-1])), ends)]

    def to_data(self) -> dict:
        return {"prompt_lens": self.prompt_lens.tolist(), "response_lens": self.response_lens.tolist(),
                "trained": self.trained.tolist(), "rounds": list(self.rounds)}

    @classmethod
    def from_data(cls, d: dict) -> "Lengths":
        trained = d["trained"] if "trained" in d else range(d["trained_prompts"])   # a checkpoint of before
        return cls(np.asarray(d["prompt_lens"], np.int64),
                   np.asarray(d["response_lens"], np.int64).reshape(len(d["prompt_lens"]), -1),
                   np.asarray(trained, np.int64), tuple(d.get("rounds", ())))


@dataclass(frozen=True)
class Variant:
    """How a forecast replays a task's batches: how many of the newest, each grown by the trend
    fitted over the task's newest `trend` batches (0: none), or, `periodic`, each scaled to the
    mean length the task had a period before the forecast batch (LengthForecast.period)."""
    trend: int
    replayed: int
    periodic: bool = False


# The first is the default: every batch it can replay, grown by the trend of TREND_WINDOW batches
# (right on stationary and steadily drifting lengths); the others replace it where their measured
# error is lower: no trend, or few batches with the trend of those few (lengths that change fast),
# or the lengths of a period before (lengths that rise and fall in cycles: a cycling curriculum).
VARIANTS = (Variant(TREND_WINDOW, ENSEMBLE), Variant(0, ENSEMBLE), Variant(0, RECENT), Variant(RECENT, RECENT),
            Variant(0, RECENT, periodic=True))


@dataclass(frozen=True)
class Prediction:
    total: float                 # the iteration, switch excluded
    rollout: float               # the slowest rollout rank
    train: float                 # the slowest train rank, synchronisation included

    @staticmethod
    def mean(predictions: list["Prediction"]) -> "Prediction":
        """The average of equally likely predictions."""
        return Prediction(*(float(np.mean(x)) for x in zip(*((p.total, p.rollout, p.train) for p in predictions))))


class IterationModel:
    """Prices iterations and switches of a job of `world` ranks (see the module docstring)."""

    def __init__(self, cm: CostModel, world: int, max_lag: int, micro_batch_size: int, resize_unit: int = 1,
                 work_stealing: bool = False, release_mode: str = "sleep", migration: tuple[int, int] | None = None,
                 transport: str = "auto", staging_critical: bool = False, sharding: str = "optimizer"):
        self.cm, self.world, self.lag, self.mbs = cm, world, max_lag, micro_batch_size
        self.work_stealing = work_stealing
        # what a switch plan depends on: rollout.release, staging.transport and .critical, trainer.sharding, the nodes
        self.release_mode, self.transport, self.staging_critical = release_mode, transport, staging_critical
        self.sharding = sharding
        self.hosts = cm.hostnames(world)
        self.migration = migration          # tail migration: (rollout.migration_threshold, rollout.tail_ranks)
        self.engine_times = cm.helper_engine_times(release_mode)   # a helper's engine: (sleep, wake)
        unit = max(resize_unit, 1)
        # the splits whose train ranks can hold their share of the model (plan/memory.py)
        self.candidates = [k for k in range(unit, world - unit + 1, unit) if cm.train_fits(k)]
        if not self.candidates:
            raise ProfileError(f"no split of {world} ranks fits the train side of {cm.model.name} in "
                               f"hardware.gpu_memory_bytes. Fix: see the settings dynaresize's validation names")
        # The train group's collectives leave the node above gpus_per_node ranks: train time jumps
        # there, so the split just below is a candidate of every search.
        inside = [k for k in self.candidates if k <= cm.gpus_per_node]
        self.node_split = inside[-1] if cm.gpus_per_node > 0 and inside else None
        # what was priced on each batch, by (quantity, split), while the batch lives: a forecast
        # replays the same recent batches decision after decision, at the same candidate splits
        self._priced: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._placements: dict[tuple, dict] = {}     # placement(): by prompts, by R (and their sort)
        self.pool = None      # a pricing.PricingPool, if rollouts are priced on workers (price_rollouts)
        self._switches: dict[tuple, float] = {}     # switch(...) by its arguments
        self._syncs: dict[int, float] = {}          # the weight sync by train ranks

    @classmethod
    def for_job(cls, job, cm: CostModel, migration: tuple[int, int] | None = None) -> "IterationModel":
        """The model of job config `job` (config.JobConfig) priced by `cm`; `migration`: the tail
        migration it predicts with (migration.priced_migration), None for none."""
        return cls(cm, job.cluster.ranks, job.run.max_lag, job.trainer.micro_batch_size, job.policy.resize_unit,
                   job.trainer.work_stealing, job.rollout.release, migration, job.staging.transport,
                   job.staging.critical, job.trainer.sharding)

    def _memo(self, batch: Lengths, key: tuple, compute: Callable):
        priced = self._priced.get(batch)
        if priced is None:
            priced = self._priced[batch] = {}
        if key not in priced:
            priced[key] = compute()
        return priced[key]

    def rollout(self, batch: Lengths, k: int) -> float:
        return float(self.rollout_times(batch, k).max())

    def rollout_times(self, batch: Lengths, k: int) -> np.ndarray:
        """Each rollout rank's time on the split of k train ranks, until it is done with its
        rollout (read-only: kept for the batch). With tail migration: its cut, or a tail rank's
        end (migration.tail_schedule)."""
        return self._memo(batch, ("rollout", k), lambda: self._read_only(self.price_rollout(batch, k)))

    def price_rollout(self, batch: Lengths, k: int) -> np.ndarray:
        """rollout_times, computed (not kept): what a pricing worker runs (dynaresize.plan.pricing).
        Rounds of dynamic sampling run one after another, each placed on its own: a rank starts
        the next round when the last rank has ended the one before (they count the groups whose
        rewards differ together)."""
        R = self.world - k
        if self.migration is not None and R >= 2:
            return tail_schedule(self.cm, *self.rollout_cuts(batch, k), self.migration[1])[0]
        start = 0.0
        for part in batch.round_slices():
            work = self._memo(batch, ("group work", part.start, part.stop),
                              lambda: GroupWork(batch.prompt_lens[part], batch.response_lens[part]))
            f = self.cm.placed_features(self.placement(batch.prompt_lens[part], R), work)
            times = start + self.cm.rollout_from_features(f)
            start = float(times.max())
        return times

    def placement(self, prompt_lens: np.ndarray, R: int) -> Placement:
        """place_prompts on R rollout ranks, kept by the prompts' lengths: a forecast's members
        share their batch's prompts (only the responses are grown), and a batch is replayed for
        ENSEMBLE decisions. The PLACEMENTS most recent prompt sets are kept."""
        key = (prompt_lens.dtype.str, prompt_lens.shape, prompt_lens.tobytes())
        by_ranks = self._placements.pop(key, None) or {"order": by_weight(prompt_lens)}
        self._placements[key] = by_ranks                      # most recent last
        while len(self._placements) > PLACEMENTS:
            del self._placements[next(iter(self._placements))]
        if R not in by_ranks:
            by_ranks[R] = Placement(place_prompts(prompt_lens, R, by_ranks["order"]), R)
        return by_ranks[R]

    @staticmethod
    def _read_only(times: np.ndarray) -> np.ndarray:
        times.flags.writeable = False
        return times

    def price_rollouts(self, pairs: Iterable[tuple[Lengths, int]]) -> None:
        """Keep the rollout times of the (batch, train ranks) `pairs`, those not kept yet priced
        together on the pricing pool's workers (`pool`, dynaresize.plan.pricing; without one, each is
        priced where it is needed)."""
        if self.pool is None:
            return
        todo = list(dict.fromkeys((b, k) for b, k in pairs if ("rollout", k) not in self._priced.get(b, {})))
        if len(todo) < 2:
            return
        for (batch, k), times in zip(todo, self.pool.rollout_times(todo)):
            self._memo(batch, ("rollout", k), lambda times=times: self._read_only(times))

    def rollout_cuts(self, batch: Lengths, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Tail migration on the split of k train ranks: each rollout rank's cut and the sequences
        left then, each as (its rank, tokens to go, context tokens so far) (CostModel.rollout_cuts)."""
        R = self.world - k
        return self.cm.rollout_cuts(place_prompts(batch.prompt_lens, R), batch.prompt_lens,
                                    batch.response_lens, R, self.migration[0])

    def micro_batch_tokens(self, batch: Lengths) -> np.ndarray:
        """The tokens of each micro-batch of the trained samples, in index order (as the trainer cuts them)."""
        def count() -> np.ndarray:
            rows = batch.trained
            tok = (batch.prompt_lens[rows, None] + batch.response_lens[rows]).ravel().astype(np.float64)
            out = np.add.reduceat(tok, np.arange(0, len(tok), self.mbs)) if len(tok) else np.zeros(0)
            out.flags.writeable = False
            return out
        return self._memo(batch, ("micro-batch tokens",), count)

    def queue_order(self, batch: Lengths) -> np.ndarray:
        """stealing.queue_order of the batch's micro-batches, kept: every split priced sorts the same."""
        return self._memo(batch, ("queue order",), lambda: self._read_only(queue_order(self.micro_batch_tokens(batch))))

    def train_work(self, batch: Lengths, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(tokens, micro-batches) of each of k train ranks: the trained samples in index order,
        cut into micro-batches, spread by placement.assign_micro_batches (as the trainer does)."""
        mb_tok = self.micro_batch_tokens(batch)
        owner = assign_micro_batches(mb_tok, k, self.queue_order(batch))
        return np.bincount(owner, weights=mb_tok, minlength=k), np.bincount(owner, minlength=k).astype(np.float64)

    def train(self, batch: Lengths, k: int, helpers_free: np.ndarray | None = None) -> float:
        """The train stage on k train ranks. With `helpers_free` (work stealing: when each rollout
        rank is free to help, in seconds from the stage's start) every worker claims micro-batches
        from the queue, and the helpers' sums reach the train ranks before the all-reduce."""
        if helpers_free is None:
            def price() -> float:
                tok, mb = self.train_work(batch, k)
                return float(np.max(self.cm.train_compute_time(tok, mb))) + self.cm.train_sync_time(k)
            return self._memo(batch, ("train", k), price)
        owner, start, dur, _, _ = self.claims(batch, k, np.concatenate((np.zeros(k), helpers_free)))
        compute = float((start + dur).max()) if len(dur) else 0.0
        return compute + self.helper_sums(owner, k) + self.cm.train_sync_time(k)

    def claims(self, batch: Lengths, k: int, ready: np.ndarray, scale: float = 1.0):
        """Work stealing's queue priced (stealing.claim_schedule): workers free from `ready` (the k
        train ranks first, then the helpers, which join if it pays and start once their engine
        sleeps) take the micro-batches in order (stealing.queue_order), each lasting its compute
        time x `scale`. Returns (in queue order: the worker of each micro-batch, its start, its
        duration, its tokens; the helpers that joined)."""
        tokens = self.micro_batch_tokens(batch)
        order = self.queue_order(batch)
        dur = self.cm.train_compute_time(tokens[order], 1) * scale
        owner, start, _, joined = claim_schedule(dur, ready, k, self.join_time(k) * scale,
                                                 self.engine_times[0] * scale)
        return owner, start, dur, tokens[order], joined

    def join_time(self, k: int) -> float:
        """What one helper costs the train step of k train ranks (stealing.worth_joining): its
        gradient sum, and its engine's sleep and wake."""
        return self.cm.helper_sums_time(1, k, self.cm.multi_node(self.world)) + sum(self.engine_times)

    def helper_sums(self, owner: np.ndarray, k: int) -> float:
        """The time the helpers' gradient sums take to reach the k train ranks."""
        helpers = len(np.unique(owner[owner >= k]))
        return self.cm.helper_sums_time(helpers, k, self.cm.multi_node(self.world))

    def iteration(self, generate: Lengths | None, train: Lengths | None, k: int,
                  rollout_scale: float = 1.0, train_scale: float = 1.0) -> Prediction:
        """One iteration with k train ranks that generates `generate` and trains on `train` (either
        may be None); the stage times are multiplied by the given corrections."""
        times = self.rollout_times(generate, k) * rollout_scale if generate is not None else None
        roll = float(times.max()) if times is not None else 0.0
        if train is None:
            trn = 0.0
        elif self.work_stealing:       # helpers free when their rollout ends (max_lag 1) or at once
            free = times if self.lag >= 1 and times is not None else np.zeros(self.world - k)
            trn = self.train(train, k, free / train_scale) * train_scale
        else:
            trn = self.train(train, k) * train_scale
        return self.compose(roll, trn, generate, train, k)

    def compose(self, roll: float, trn: float, generate: Lengths | None, train: Lengths | None,
                k: int) -> Prediction:
        """An iteration of k train ranks from its stage times: the stages overlap (max_lag 1) or
        follow each other (max_lag 0), then the exchange, the weight sync and the overhead."""
        cm, W = self.cm, self.world
        if k not in self._syncs:
            self._syncs[k] = cm.weight_sync_time(cm.weight_bytes, 1 + W - k, multi_node=cm.multi_node(W))
        sync = self._syncs[k] if train is not None else 0.0
        exchange = cm.exchange_time(0.0, W) if generate is None else \
            self._memo(generate, ("exchange",), lambda: cm.exchange_time(float(
                generate.prompt_lens.sum() * generate.response_lens.shape[1] + generate.response_lens.sum()), W))
        stages = max(roll, trn) if self.lag >= 1 else roll + trn
        return Prediction(stages + exchange + sync + cm.iteration_overhead(), roll, trn)

    def expected(self, generate: list[Lengths] | None, train: list[Lengths] | None, k: int,
                 rollout_scale: float = 1.0, train_scale: float = 1.0) -> Prediction:
        """`iteration` averaged over equally likely batches (a forecast's ensemble)."""
        gens, trns = generate or [None], train or [None]
        if generate:
            self.price_rollouts((g, k) for g in generate)
        n = max(len(gens), len(trns))
        return Prediction.mean([self.iteration(gens[i % len(gens)], trns[i % len(trns)], k, rollout_scale,
                                               train_scale) for i in range(n)])

    def best_split(self, predict: Callable[[int], Prediction], exhaustive: bool = False,
                   near: int | None = None) -> int:
        """The candidate split with the shortest predicted iteration (ties: fewer train ranks).

        With overlapping stages (max_lag 1) the iteration lasts about max(rollout, train): rollout
        time grows with the train ranks and train time shrinks, so the best split sits where they
        cross. Beyond EXHAUSTIVE candidates, search for the crossing (`crossing`: a few
        evaluations, never a sweep of the splits whose few rollout ranks queue thousands of
        sequences), then descend from it to a neighbour while one is shorter, at most NEIGHBOURS
        from the crossing (the average of max(rollout, train) over a forecast's batches need not
        be lowest at the crossing of the averages), and compare the largest split whose train
        group fits in a node (train time is not monotone there). Rollout time is jagged in the
        rollout ranks (a rank's share of the prompt groups is rounded up): the descent can stop
        short of a better split behind a jag (measured in a test: 0.08 % longer than the best of
        every candidate). `near`: a split the crossing is likely close to (the current one),
        where the search starts. `exhaustive`: evaluate every candidate (an average over
        different batches need not have one crossing)."""
        cands = self.candidates

        def score(i: int) -> tuple[float, int]:
            return predict(cands[i]).total, i               # ties: fewer train ranks

        if len(cands) <= EXHAUSTIVE or self.lag < 1 or exhaustive:
            return cands[min(range(len(cands)), key=score)]
        start = None if near is None else int(np.searchsorted(cands, near))
        lo = crossing(lambda i: (lambda p: p.rollout >= p.train)(predict(cands[i])), len(cands), start)
        best, moved = lo, True
        while moved:
            step = min((i for i in (best - 1, best + 1) if 0 <= i < len(cands) and abs(i - lo) <= NEIGHBOURS),
                       key=score)
            best, moved = (step, True) if score(step) < score(best) else (best, False)
        if self.node_split is not None:
            best = min(best, cands.index(self.node_split), key=score)
        return cands[best]

    def switch(self, k: int, k2: int, engines_from: int) -> float:
        """Critical path of the switch from k to k2 train ranks: the plan resize.switch runs
        (switchplan.plan, its transport chosen as the runtime does on the cost model's nodes: the
        job's own in a run, the profile's in a simulation), each operation priced by the cost
        model (switchplan.critical_time). Ranks >= `engines_from` that train now hold a parked
        engine (they generated before); the others start one cold."""
        if k2 == k:
            return 0.0
        parked_from = min(max(engines_from, k2), k)    # what the plan's times depend on: which
        key = (k, k2, parked_from)                      # leaving ranks have an engine to wake
        if key not in self._switches:
            old = RoleTable.split(self.world, k)
            plan = switchplan.plan(old, old.with_split(k2), parked=frozenset(range(parked_from, k)),
                                   transport=switchplan.transport(self.transport, self.hosts, max(k, k2)),
                                   numel=self.cm.numel, release_mode=self.release_mode,
                                   staging_critical=self.staging_critical, sharding=self.sharding,
                                   hosts=self.hosts)
            self._switches[key] = switchplan.critical_time(plan, self.cm.switch_op_time)
        return self._switches[key]


def crossing(rollout_longer: Callable[[int], bool], n: int, start: int | None = None) -> int:
    """The first index of 0..n-1 where `rollout_longer` holds (n - 1 if none): it is false, then
    true (rollout time grows with the train ranks, train time falls). Bisection over the whole
    range, or, from `start`, steps of 1, 2, 4, .. away from it until the answer changes, then
    bisection between: a few evaluations near `start` where the crossing moved little since."""
    lo, hi = 0, n - 1
    if start is not None and n > 1:
        start, step = min(max(start, 0), n - 1), 1
        if rollout_longer(start):          # the crossing is at start or before it
            hi, probe = start, start - 1
            while probe >= 0 and rollout_longer(probe):
                hi, probe, step = probe, probe - 2 * step, 2 * step
            lo = max(probe + 1, 0)
        else:                              # after it
            lo, probe = min(start + 1, n - 1), start + 1
            while probe < n - 1 and not rollout_longer(probe):
                lo, probe, step = probe + 1, probe + 2 * step, 2 * step
            hi = min(probe, n - 1)
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if rollout_longer(mid) else (mid + 1, hi)
    return lo


def workload_sample(workload, seed: int, b: int, prompts_per_batch: int, samples_per_prompt: int,
                    n: int = ENSEMBLE, max_rounds: int = 1) -> list[Lengths]:
    """n equally likely batches of the configured workload at batch index b: its task, cap, growth
    and prompt count (and rounds of dynamic sampling, up to `max_rounds`, with its signal share),
    with lengths drawn from streams of their own (never the real batch b's)."""
    return [Lengths.of(filtered_shape(workload, seed + _PRIOR_STREAM + i, b, prompts_per_batch, samples_per_prompt,
                                      max_rounds)) for i in range(n)]


def uncensor(lengths: np.ndarray, cut: int) -> np.ndarray:
    """`lengths` with the responses cut at `cut` (known only to be at least that long) replaced by
    evenly spaced quantiles of the tail beyond `cut` of a log-normal fitted to the batch: its median
    and 16th percentile, both below the cut while under half the batch is cut. Unchanged if no
    response is cut, or half or more are (too little left to fit), or the fit puts the cut beyond
    its reach (cut responses of another mode than the rest: nothing to say how far they run)."""
    is_cut = lengths >= cut
    n_cut = int(is_cut.sum())
    if n_cut == 0 or 2 * n_cut >= lengths.size:
        return lengths
    q16, q50 = np.quantile(np.log(np.maximum(lengths, 1)), [0.158655, 0.5])
    normal = statistics.NormalDist(float(q50), max(float(q50 - q16), 1e-6))
    beyond = normal.cdf(math.log(cut))
    if beyond >= 1.0:
        return lengths
    tail = [math.exp(normal.inv_cdf(beyond + (1 - beyond) * (i + 0.5) / n_cut)) for i in range(n_cut)]
    out = lengths.copy()
    out[is_cut] = np.maximum(np.round(tail), cut).astype(lengths.dtype)
    return out


def lag_differences(levels: dict[int, float]) -> np.ndarray:
    """For each lag 1..PERIODS[-1]: the mean |L(b) - L(b - lag)| over the batches b with both in
    `levels` (batch -> log mean length), inf where fewer than PERIOD_PAIRS such pairs are seen.
    One array operation for all lags: a decision of every iteration finds the period anew."""
    lags = np.arange(1, PERIODS[-1] + 1)
    if not levels:
        return np.full(len(lags), math.inf)
    first, n = min(levels), max(levels) - min(levels) + 1
    series = np.full(n + lags[-1], np.nan)           # by batch from the first seen, NaN: not seen
    series[np.fromiter(levels, dtype=np.int64, count=len(levels)) - first] = list(levels.values())
    d = np.abs(series[lags[:, None] + np.arange(n)] - series[:n])      # (lag, b): |L(b + lag) - L(b)|
    pairs = np.count_nonzero(~np.isnan(d), axis=1)
    return np.where(pairs >= PERIOD_PAIRS, np.nansum(d, axis=1) / np.maximum(pairs, 1), math.inf)


class LengthForecast:
    """The batches of the coming iterations, from the batches generated so far (see the module
    docstring). Per task of a mixture (tasks rotate by a configured schedule), the forecast of a
    batch is an ensemble: the task's last ENSEMBLE generated batches, each grown by the task's
    trend over the batches between (rounded to GROWTH_STEP, so that decision after decision the
    same grown batches, and their prices, are reused) (a least-squares slope of log mean length over the last
    TREND_WINDOW, compared at the lowest cap among them; extrapolated at most AHEAD batches past
    the newest) and cut at the forecast batch's configured cap (responses cut at a lower cap of
    their own batch continue past it, as where a batch is scaled down: `uncensor`). Where that
    has predicted the task's latest batches clearly worse than replaying fewer batches, no
    trend, or the lengths of a period before (lengths that rise and fall: `period`), the better
    variant is used (`variant`). A rollout's time is floored by
    its longest sequences, which differ from batch to batch: a prediction averaged over several
    batches estimates the expected time, where one batch would chase the noise of its tail. A task
    not seen yet is a sample of the configured workload (drawn with a seed of its own, not the
    real batches)."""

    def __init__(self, workload, seed: int, prompts_per_batch: int, samples_per_prompt: int, max_rounds: int = 1):
        self.w, self.seed, self.ppb, self.spp = workload, seed, prompts_per_batch, samples_per_prompt
        self.max_rounds = max_rounds      # dynamic sampling's rounds, for the configured workload's sample
        self.generated: dict[int, Lengths] = {}          # recent generated batches, by index
        self.recent: dict[int, deque] = {}                # task -> (batch index, lengths), newest last
        self._growth: dict[tuple[int, int], float] = {}   # (task, window) -> growth(...), until it sees a batch
        # the same objects for the same forecast (IterationModel keeps prices per batch object):
        # prior(b) until batch b is generated, and each grown member by (seen batch, growth in
        # GROWTH_STEPs, cap) while decisions use it: a trend that moves little between decisions
        # grows a seen batch to the same steps, so the batches priced before are priced again for free
        self._priors: dict[int, list[Lengths]] = {}
        self._members: dict[tuple[int, int, int], Lengths] = {}
        self._used: set[tuple[int, int, int]] = set()      # members used since the last batch seen
        # task -> each variant's latest errors predicting a batch's mean length before it was seen
        # (None: the variant made no forecast of that batch)
        self.errors: dict[int, dict[Variant, deque]] = {}
        self.levels: dict[int, dict[int, float]] = {}    # task -> {batch: log mean length}, HISTORY newest
        self._periods: dict[int, int] = {}              # task -> period(task), until it sees a batch
        self._forecasts: dict[int, tuple] = {}          # b -> forecast(b), until a batch is seen

    def observe(self, b: int, batch: Lengths) -> None:
        task = task_index(self.w, b)
        self._score(task, b, batch)
        self.generated[b] = batch
        for old in [x for x in self.generated if x < b - 2]:
            del self.generated[old]
        self.recent.setdefault(task, deque(maxlen=ENSEMBLE)).append((b, batch))
        for old in [x for x in self._priors if x <= b]:
            del self._priors[old]
        replayed = {b0 for d in self.recent.values() for b0, _ in d}
        for key in [key for key in self._members if key not in self._used or key[0] not in replayed]:
            del self._members[key]
        self._used.clear()
        for key in [key for key in self._growth if key[0] == task]:
            del self._growth[key]
        levels = self.levels.setdefault(task, {})
        if batch.response_stats[0] > 0:
            levels[b] = math.log(batch.response_stats[0])
        for old in [x for x in levels if x <= b - HISTORY]:
            del levels[old]
        self._periods.pop(task, None)
        self._forecasts.clear()

    def growth(self, task: int, window: int = TREND_WINDOW) -> float:
        """The task's log growth of mean length per batch: the least-squares slope over its last
        TREND_WINDOW batches (0 until three are seen), kept from four batches on only where it
        stands out of their noise (over two standard errors). A stationary task's slope is noise;
        grown over the horizon it made the forecast, and the chosen split, wander.

        The batches are compared on equal terms: each one's mean length with its responses clipped
        at the lowest cap among them. Past a cap rise the new cap lets longer responses through,
        which is not growth: counted as growth, the step in the mean made the slope 3-5 x the
        trend for the next TREND_WINDOW batches."""
        if window <= 0:
            return 0.0
        if (task, window) not in self._growth:
            self._growth[task, window] = self._fit_growth(task, window)
        return self._growth[task, window]

    def _fit_growth(self, task: int, window: int) -> float:
        seen = [(b0, x) for b0, x in list(self.recent.get(task, ()))[-window:] if x.response_lens.size]
        cap = min((response_cap(self.w, b0) for b0, _ in seen), default=0)
        points = [(b0, x.clipped_mean(cap)) for b0, x in seen]
        points = [(b0, math.log(mean)) for b0, mean in points if mean > 0]
        if len(points) < 3:
            return 0.0
        x, y = np.array(points).T
        slope = float(np.polyfit(x, y, 1)[0])
        if len(points) < 4:
            return slope
        dx = x - x.mean()
        resid = y - y.mean() - slope * dx
        stderr = math.sqrt(float(resid @ resid) / (len(points) - 2) / float(dx @ dx))
        return slope if abs(slope) > 2.0 * stderr else 0.0

    def _score(self, task: int, b: int, batch: Lengths) -> None:
        """Record how far each variant's forecast of batch b's mean response length, made from the
        batches before it, was from the truth (|log ratio|)."""
        actual = batch.response_stats[0]
        if task not in self.recent or actual <= 0:
            return
        errors = self.errors.setdefault(task, {v: deque(maxlen=CHOICE_WINDOW) for v in VARIANTS})
        for v in VARIANTS:
            predicted = self._mean_length(task, b, v)
            errors[v].append(abs(math.log(predicted / actual)) if predicted > 0 else None)

    def _mean_length(self, task: int, b: int, v: Variant) -> float:
        """The mean response length of batch b that variant v forecasts (before any cap; 0: none)."""
        means = [x.response_stats[0] * math.exp(self._shift(task, b, b0, v))
                 for b0, x in list(self.recent[task])[-v.replayed:] if x.response_lens.size]
        return float(np.mean(means)) if means and all(m > 0 for m in means) else 0.0

    def _shift(self, task: int, b: int, b0: int, v: Variant) -> float:
        """The log of the factor by which variant v scales the task's seen batch b0 to forecast
        batch b: its trend over the batches between (held past AHEAD batches beyond the newest
        seen), or the step from b0's mean length to that of a period before b (-inf: no such
        batch seen, or no period found)."""
        if v.periodic:
            level = self.periodic_level(task, b)
            return level - self.levels[task].get(b0, math.inf) if level is not None else -math.inf
        return self.growth(task, v.trend) * (min(b, self.recent[task][-1][0] + AHEAD) - b0)

    def period(self, task: int) -> int:
        """The period (in batches, of PERIODS) with which the task's mean lengths repeat, 0 if
        none: the shortest lag whose differences of log mean length, over at least PERIOD_PAIRS
        pairs of the task's newest HISTORY batches, are within 25 % of the smallest of any lag and
        below PERIOD_MARGIN x those of batches one apart (a trend, noise or a step have no such
        lag: theirs grow with the lag or stay the same)."""
        if task not in self._periods:
            by_lag = lag_differences(self.levels.get(task, {}))      # lag 1, 2, .. PERIODS[-1]
            smallest, adjacent = by_lag[1:].min(), by_lag[0]
            found = smallest < PERIOD_MARGIN * adjacent < math.inf
            self._periods[task] = int(np.argmax(by_lag[1:] <= 1.25 * smallest)) + PERIODS[0] if found else 0
        return self._periods[task]

    def periodic_level(self, task: int, b: int) -> float | None:
        """The log mean length the task's period says batch b has: the mean of the two latest
        batches seen a whole number of periods before b (None: no period, or none seen)."""
        p, levels = self.period(task), self.levels.get(task, {})
        if not p or not levels:
            return None
        first = max(1, -(-(b - max(levels)) // p))       # the fewest periods back to a batch seen
        seen = [levels[b - j * p] for j in (first, first + 1) if b - j * p in levels]
        return float(np.mean(seen)) if seen else None

    def variant(self, task: int) -> Variant:
        """The variant the task's forecasts use: the default (VARIANTS[0]) unless another has
        predicted the task's latest batches clearly better (mean error below CHOICE_MARGIN x the
        default's over CHOICE_WINDOW batches). Chosen by measured error, not per workload: where
        lengths rise and fall, the trend points the wrong way past a turning point and the old
        batches replayed belong to another phase; where they drift steadily, the default wins."""
        default = VARIANTS[0]
        errors = self.errors.get(task)
        if not errors or sum(e is not None for e in errors[default]) < CHOICE_WINDOW // 2:
            return default
        # a variant that made no forecast of one of the latest batches is not chosen
        mean = {v: sum(e) / len(e) if None not in e else math.inf for v, e in errors.items()}
        best = min(VARIANTS, key=lambda v: mean[v])       # ties: the first (VARIANTS' order)
        return best if mean[best] < CHOICE_MARGIN * mean[default] else default

    def prior(self, b: int) -> list[Lengths]:
        """ENSEMBLE samples of the configured workload at batch b (start-up, tasks not seen yet),
        the same objects until batch b is generated."""
        if b not in self._priors:
            self._priors[b] = workload_sample(self.w, self.seed, b, self.ppb, self.spp, max_rounds=self.max_rounds)
        return self._priors[b]

    def replayed(self, b: int) -> int:
        """How many generated batches the forecast of batch b replays: ENSEMBLE where it is
        generated already or is the configured workload's sample (a task not seen yet), else the
        batches of its task seen so far (1 after the task's first batch)."""
        task = task_index(self.w, b)
        if b in self.generated or task not in self.recent:
            return ENSEMBLE
        return min(len(self.recent[task]), self.variant(task).replayed)

    def forecast(self, b: int) -> tuple[list[Lengths], tuple]:
        """(the forecast of batch b: one or more equally likely batches, a key: equal keys,
        equal forecasts), the same until a batch is seen (a plan asks for most batches twice: to
        generate, and to train on the next iteration)."""
        if b not in self._forecasts:
            self._forecasts[b] = self._forecast(b)
        return self._forecasts[b]

    def _forecast(self, b: int) -> tuple[list[Lengths], tuple]:
        if b in self.generated:
            return [self.generated[b]], ("generated", b)
        task = task_index(self.w, b)
        if task not in self.recent:
            return self.prior(b), ("prior", b)
        v, cap = self.variant(task), response_cap(self.w, b)
        if v.periodic and self.periodic_level(task, b) is None:    # no batch seen a period before b
            v = dataclasses.replace(v, periodic=False)
        members, key = [], []
        for b0, seen in list(self.recent[task])[-v.replayed:]:
            shift = self._shift(task, b, b0, v)
            steps = round(shift / GROWTH_STEP) if math.isfinite(shift) else 0
            cut = response_cap(self.w, b0)
            _, shortest, longest = seen.response_stats
            # responses cut at the seen batch's cap continue past it where the forecast can see
            # beyond that cap: it rose, or the batch is scaled down (a cut response scaled down
            # would end where the truth still runs on: the longest, which floor a rollout's time)
            sees_past_cut = longest >= cut and (cut < cap or steps < 0)
            if steps == 0 and not sees_past_cut and 1 <= shortest and longest <= cap:
                members.append(seen)                  # the batch as seen
            else:
                grown = (b0, steps, cap)
                if grown not in self._members:
                    lens = uncensor(seen.response_lens, cut) if sees_past_cut else seen.response_lens
                    lens = np.clip(np.round(lens * math.exp(steps * GROWTH_STEP)), 1, cap).astype(np.int64)
                    self._members[grown] = Lengths(seen.prompt_lens, lens, seen.trained, seen.rounds)
                self._used.add(grown)
                members.append(self._members[grown])
            key.append((b0, steps))
        return members, ("forecast", task, cap, *key)

    def state(self) -> dict:
        """What was observed, as plain data (JSON): lists of [batch or task, ...] pairs."""
        return {"generated": [[b, x.to_data()] for b, x in self.generated.items()],
                "recent": [[t, [[b, x.to_data()] for b, x in d]] for t, d in self.recent.items()],
                "errors": [[t, [list(e[v]) for v in VARIANTS]] for t, e in self.errors.items()],
                "levels": [[t, [[b, level] for b, level in d.items()]] for t, d in self.levels.items()]}

    def load_state(self, state: dict) -> None:
        self.generated = {int(b): Lengths.from_data(x) for b, x in state["generated"]}
        self.recent = {int(t): deque(((int(b), Lengths.from_data(x)) for b, x in d), maxlen=ENSEMBLE)
                       for t, d in state["recent"]}
        # a checkpoint of before: no errors, or not those of every variant; no levels
        self.errors = {int(t): {v: deque(e, maxlen=CHOICE_WINDOW) for v, e in
                                zip(VARIANTS, errors + [[None]] * (len(VARIANTS) - len(errors)))}
                       for t, errors in state.get("errors", [])}
        self.levels = {int(t): {int(b): float(level) for b, level in d} for t, d in state.get("levels", [])}
        self._growth, self._periods, self._forecasts = {}, {}, {}


__all__ = ["Lengths", "Prediction", "IterationModel", "LengthForecast", "crossing", "uncensor", "workload_sample"]
