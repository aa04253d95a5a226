"""Split policies: given what the last iteration measured, choose the next split.

One interface for the runtime and the simulator: `decide(stats) -> Decision`, where `stats` are
the measured (or simulated) stage times of one iteration and the lengths of the batch it generated. Decisions are made on rank 0 and
broadcast, and every decision, kept or moved, is recorded on the timeline with its reason.
"""
from __future__ import annotations

import dataclasses
import importlib
import math
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from .migration import priced_migration
from .prediction import ENSEMBLE, IterationModel, LengthForecast, Lengths, Prediction, workload_sample
from .pricing import PricingPool
from ..data.shapes import generation_rounds

START_POINTS = 4      # points of the run (its start and quarters) where policy.train_ranks=auto prices splits
START_PHASES = 8      # iterations of a task period it averages over at each point (evenly spaced)
GUARD_WINDOW = 8      # iterations after a move whose realised saving the guard sums
GUARD_FACTOR = 4.0    # a move must promise this x what the window's moves lost, beyond the dead band
# Large batches price a forecast on fewer of its batches: its newest ones holding these many
# prompt groups (at least one batch, at most all: a 64-rank run's 512 prompts a batch, all 16):
# - the search for a step's best split (the plan then compares the splits found on all);
# - the train stage, which varies less from batch to batch than a rollout's tail (its
#   micro-batches are spread evenly: the busiest rank is within the largest one of the mean),
#   each batch paired in turn with the rollouts of all (different batches anyway, one step off-policy).
SEARCH_PROMPTS = 16_384
TRAIN_PROMPTS = 32_768


@dataclass(frozen=True)
class IterationStats:
    iteration: int
    train_ranks: int
    world: int
    rollout_time: float            # slowest rollout rank's generation time (s); 0 if none ran
    train_time: float              # slowest train rank's update time (s); 0 if none ran
    switch_time: float = 0.0       # critical-path time of the switch at the start of the iteration
    generated_batch: int = -1      # the batch generated in this iteration (-1: none)
    trained_batch: int = -1        # the batch trained on (-1: none)
    lengths: Any = None            # prediction.Lengths of the generated batch (None: not known)

    @property
    def generated(self) -> bool:
        return self.generated_batch >= 0

    @property
    def trained(self) -> bool:
        return self.trained_batch >= 0


@dataclass(frozen=True)
class Decision:
    iteration: int
    from_train: int
    to_train: int
    reason: str
    rollout_time: float = math.nan
    train_time: float = math.nan
    predicted_gain: float = math.nan
    predicted_cost: float = math.nan
    attrs: dict = field(default_factory=dict)

    @property
    def moves(self) -> bool:
        return self.to_train != self.from_train

    def row(self, table_version: int) -> dict:
        return {"iteration": self.iteration, "table_version": table_version, "from_train": self.from_train,
                "to_train": self.to_train, "action": "move" if self.moves else "keep",
                "reason": self.reason, "rollout_time": self.rollout_time, "train_time": self.train_time,
                "predicted_gain": self.predicted_gain, "predicted_cost": self.predicted_cost,
                "attrs": self.attrs}


class Policy:
    name = "policy"

    def __init__(self, job, cost=None):
        self.cfg, self.world, self.max_lag = job.policy, job.cluster.ranks, job.run.max_lag
        self.decide_seconds: list[float] = []     # wall time of each decision (decide_timed)

    def initial_train_ranks(self) -> int:
        return int(self.cfg.train_ranks)

    def decide(self, stats: IterationStats) -> Decision:
        raise NotImplementedError

    def decide_timed(self, stats: IterationStats) -> Decision:
        """decide(), timed: rank 0 decides while every rank waits at the end of the iteration."""
        start = time.perf_counter()
        decision = self.decide(stats)
        self.decide_seconds.append(time.perf_counter() - start)
        return decision

    def decide_time_attrs(self) -> dict[str, float]:
        """The decisions' wall time, for the timeline's file attributes (not part of its datasets:
        they stay deterministic in the simulator)."""
        s = self.decide_seconds or [0.0]
        return {"decide_s_median": statistics.median(s), "decide_s_max": max(s), "decide_s_total": sum(s)}

    def state(self) -> dict:
        """What a checkpoint must hold to resume the policy exactly, as plain data (JSON)."""
        return {}

    def load_state(self, state: dict, new_world_split: int | None = None) -> None:
        """Resume from `state`; `new_world_split`: the run resumes on another number of ranks,
        starting with this many train ranks."""


class StaticPolicy(Policy):
    """A fixed split: the baseline every dynamic result is compared with."""
    name = "static"

    def decide(self, stats: IterationStats) -> Decision:
        return Decision(stats.iteration, stats.train_ranks, stats.train_ranks, "static",
                        stats.rollout_time, stats.train_time)



class ColocatedPolicy(StaticPolicy):
    """Every rank generates, then every rank trains: a switch of engine memory every iteration.

    The placement most RL frameworks default to, kept as a baseline in the same runtime.
    """
    name = "colocated"

    def initial_train_ranks(self) -> int:
        return self.world


class ScriptedPolicy(Policy):
    """Splits by iteration from `policy.schedule` (train ranks of iterations 0, 1, ...; the last holds)."""
    name = "scripted"

    def initial_train_ranks(self) -> int:
        return self.cfg.schedule[0]

    def decide(self, stats: IterationStats) -> Decision:
        schedule = self.cfg.schedule
        target = schedule[min(stats.iteration + 1, len(schedule) - 1)]
        return Decision(stats.iteration, stats.train_ranks, target,
                        "scripted" if target != stats.train_ranks else "scripted: keep",
                        stats.rollout_time, stats.train_time)


class DynamicPolicy(Policy):
    """The split of the coming iterations, chosen from predictions (dynaresize.plan.prediction).

    At the end of every iteration it
    1. learns: the lengths of the batch just generated (the forecast's input), the ratio of the
       measured to the predicted rollout and train times at the split that ran (the cost model's
       error on this machine), and after a move the ratio of the measured to the predicted switch
       time, per kind of move (into rollout: engines start or wake; into training: state staging);
    2. forecasts the next `horizon` iterations (prediction.LengthForecast) and finds the best
       split of each (IterationModel.best_split: the rollout ranks' schedules, floors included);
    3. plans the cheapest sequence of splits over the horizon among the current split and those
       best splits, switch costs included (a small dynamic program): a move pays only if the
       iterations it shortens make up for its switch, and a workload that alternates is followed
       only where switching is cheaper than staying;
    4. moves to the plan's first split if the plan saves more than `dead_band` of the horizon's
       predicted time over staying put, else keeps the split (hysteresis: a forecast that wobbles
       around the optimum does not make it move back and forth);
    5. guards against moves that do not pay: for GUARD_WINDOW iterations after a move it sums what
       the move saved, the iteration on the split it left (the cost model on the batches actually
       generated and trained, not their forecast) less the iteration measured, less the switch
       measured; while the last GUARD_WINDOW iterations' sum is negative, a move must promise
       GUARD_FACTOR times that loss beyond the dead band, else the split is held (the decision's
       reason says so), until the losing moves leave the window.
    """
    name = "dynamic"

    def __init__(self, job, cost=None):
        super().__init__(job, cost)
        if cost is None:
            raise ValueError("the dynamic policy prices splits with a cost model: give make_policy one")
        # a run whose cost model cannot price tail migration (the torch engine's) predicts without it
        self.model = IterationModel.for_job(job, cost, priced_migration(job.rollout, cost))
        r = job.rollout
        self.forecast = LengthForecast(job.workload, job.run.seed, r.prompts_per_batch, r.samples_per_prompt,
                                       generation_rounds(job.trainer))
        self.iterations = job.run.iterations
        self.search_members, self.train_members = (min(max(-(-n // r.prompts_per_batch), 1), ENSEMBLE)
                                                   for n in (SEARCH_PROMPTS, TRAIN_PROMPTS))
        # measured / predicted: stage times, and switch times by destination (1 until measured)
        self.scale = {"rollout": 1.0, "train": 1.0, "switch to rollout": 1.0, "switch to train": 1.0}
        self.measured: set[str] = set()                        # which of them have a measurement
        self.engines_from = self.world                         # ranks >= this have had an engine
        self.last_move: tuple[str, float] | None = None        # (destination, predicted switch time)
        self.run_split: int | None = None                      # the split the configured run wants
        self.anchor: int | None = None    # the split the next decision weighs a plan against, if not the current
        self.start_reason = ""
        # the guard: the split the latest move left (for GUARD_WINDOW iterations), and the realised
        # saving of each of the last GUARD_WINDOW iterations (None: no move before it in the window)
        self.moved_from: int | None = None
        self.since_move = 0
        self.realised: deque = deque(maxlen=GUARD_WINDOW)

    # --- start-up ------------------------------------------------------------------------------
    def initial_train_ranks(self) -> int:
        if self.cfg.train_ranks != "auto":
            k = self.run_split = int(self.cfg.train_ranks)
        else:
            k = self.run_split = self._run_split()
            first = self._first_iteration_split(k)
            if first is not None:
                k, self.anchor = first, self.run_split
        self.engines_from = min(self.engines_from, k)
        return k

    def _run_split(self) -> int:
        """policy.train_ranks=auto: the split the configured run wants, and why (start_reason).

        The most rollout ranks the configured run will want: a rank that starts in rollout keeps
        its engine parked while it trains, so a later move back into rollout wakes it, where a
        rank that never generated would start one cold (the costliest switch)."""
        points = sorted({self.iterations * j // START_POINTS for j in range(START_POINTS)})
        bests = []
        for at in points:
            predict, tasks = steady_state(self.model, self.forecast, self.iterations, START_PHASES, at)
            bests.append(self.model.best_split(predict, exhaustive=tasks > 1))
            if at == 0:
                at_start = predict
        k = min(bests)
        p = at_start(k)
        self.start_reason = (f"policy.train_ranks=auto: {k} train ranks, {self.world - k} rollout, the fewest "
                             f"among the best splits {bests} of the configured workload at batches {points}"
                             + (f" (each averaged over {tasks} batches of its tasks)" if tasks > 1 else "")
                             + f", priced by {self.model.cm.describe()}: predicted {p.total:.3g} s an iteration "
                             f"at the start (rollout {p.rollout:.3g} s, train {p.train:.3g} s); ranks that "
                             f"start in rollout keep an engine to return to")
        return k

    def _first_iteration_split(self, run_split: int) -> int | None:
        """The split of the first iteration when it differs from the run's: one step off-policy,
        iteration 0 only generates (nothing is trained yet), so it runs on the split that generates
        its batch fastest, and the ranks the run wants in training move there after it, with their
        engines parked (later moves into rollout wake them instead of starting them cold). Taken
        only if the iteration saves more than that move costs, by more than the dead band."""
        if self.max_lag < 1 or self.iterations + self.max_lag < 2:
            return None
        batches = self.forecast.prior(0)

        def generate_only(k: int) -> Prediction:
            return self.model.expected(batches, None, k)
        k = self.model.best_split(generate_only)
        if k >= run_split:
            return None
        at_run, first = generate_only(run_split).total, generate_only(k).total
        move = self._switch_cost(k, run_split, engines_from=k)
        if at_run - first - move <= self.cfg.dead_band * at_run:
            return None
        self.start_reason += (f"; the first iteration only generates: {k} train ranks there ({first:.3g} s "
                              f"predicted, against {at_run:.3g} s on the run's split), then {run_split} after "
                              f"it ({move:.3g} s to move)")
        return k

    # --- every iteration -----------------------------------------------------------------------
    def decide(self, s: IterationStats) -> Decision:
        if self.cfg.pricing_workers and self.model.pool is None:    # the deciding rank only, from its first decision
            self.model.pool = PricingPool(self.model.cm, self.world, self.model.migration, self.cfg.pricing_workers)
        self._learn(s)
        nxt = s.iteration + 1
        horizon = min(self.cfg.horizon, self.iterations + self.max_lag - nxt)
        # the plan is weighed against staying put, or against the run's split after a first
        # iteration on a split of its own (initial_train_ranks)
        anchor, self.anchor = (s.train_ranks if self.anchor is None else self.anchor), None
        if horizon <= 0:
            return self._keep(s, "last iteration")
        plan, stay, best, first = self._plan(s.train_ranks, anchor, nxt, horizon)
        saving = stay - best
        guard = self.guard()
        band = self.dead_band(nxt)
        k2 = plan[0]
        inside_band = k2 != anchor and saving <= band * stay       # hysteresis: not worth leaving the anchor
        # the guard doubts forecasts: the run's last iterations, which only train, are priced on
        # batches generated already
        forecasting = nxt < self.iterations
        held = (forecasting and k2 not in (anchor, s.train_ranks) and guard is not None
                and saving <= band * stay - GUARD_FACTOR * guard)
        if inside_band:
            k2 = anchor
        p = first[k2]
        attrs = {"predicted_s": round(p.total, 6), "best_next": min(first, key=lambda k: (first[k].total, k)),
                 "plan": plan, "horizon": horizon, "dead_band": round(band, 4),
                 "scale_rollout": round(self.scale["rollout"], 4), "scale_train": round(self.scale["train"], 4)}
        if guard is not None:
            attrs["guard_s"] = round(guard, 6)
        if k2 == s.train_ranks:
            return self._keep(s, "saving inside the dead band" if inside_band else "plan: stay", p, attrs, saving)
        if held:
            return self._keep(s, f"guard: the moves of the last {GUARD_WINDOW} iterations cost {-guard:.3g} s more "
                                 f"than they saved, and this one promises {saving:.3g} s", first[s.train_ranks],
                              attrs, saving)
        reason = (("the run's split" + (" (dead band)" if inside_band else "")) if k2 == anchor
                  else f"plan saves {saving:.3g} s over {horizon} iterations")
        cost = self._switch_cost(s.train_ranks, k2)
        attrs["predicted_s"] = round(p.total + cost, 6)       # the iteration after the move pays the switch
        self.last_move = ("rollout" if k2 < s.train_ranks else "train", cost)
        self.moved_from, self.since_move = s.train_ranks, -1        # counted from the iteration it runs
        self.engines_from = min(self.engines_from, k2)
        why = "to rollout" if k2 < s.train_ranks else "to training"
        return Decision(s.iteration, s.train_ranks, k2, f"move {why}: {reason}", p.rollout, p.train, saving, cost,
                        attrs)

    def decide_time_attrs(self) -> dict[str, float]:
        attrs = super().decide_time_attrs()
        if self.model.pool is not None:          # policy.pricing_workers: what its workers priced
            attrs["decide_pricing_workers"] = self.model.pool.workers
            attrs["decide_priced_by_workers"] = self.model.pool.priced
        return attrs

    def dead_band(self, b: int) -> float:
        """The share of the horizon's time a plan must save to move, before batch b is generated:
        policy.dead_band, widened while the forecast of batch b replays few batches (its noise
        falls as 1/sqrt of them: a task's first batch alone once made a stationary run move 16
        ranks and come back)."""
        n = self.forecast.replayed(b) if b < self.iterations else ENSEMBLE
        return self.cfg.dead_band * math.sqrt(ENSEMBLE / n)

    def _learn(self, s: IterationStats) -> None:
        if self.last_move is not None and s.switch_time > 0:
            where, predicted = self.last_move
            if predicted > 0:
                self._update(f"switch to {where}", s.switch_time / predicted)
        self.last_move = None
        if s.lengths is not None and s.generated_batch >= 0:
            self.forecast.observe(s.generated_batch, s.lengths)
            if s.rollout_time > 0:
                self._update("rollout", s.rollout_time / self.model.rollout(s.lengths, s.train_ranks))
        trained = self.forecast.generated.get(s.trained_batch)
        self._realise(s, trained)
        if trained is not None and s.train_time > 0 and s.switch_time == 0:     # a switch's stage-in distorts it
            # the train stage as predicted for this iteration (with work stealing, helpers free when
            # their rollout of this iteration's batch ends), before the train correction
            generated = s.lengths if s.generated_batch >= 0 else None
            predicted = self.model.iteration(generated, trained, s.train_ranks, self.scale["rollout"]).train
            self._update("train", s.train_time / predicted)

    def _realise(self, s: IterationStats, trained: Lengths | None) -> None:
        """The guard's ledger: what the latest move saved in iteration s (see the class docstring)."""
        self.since_move += 1
        if self.moved_from is not None and self.since_move >= GUARD_WINDOW:
            self.moved_from = None
        generated = s.lengths if s.generated_batch >= 0 else None
        if self.moved_from is None or (generated is None and trained is None):
            self.realised.append(None)
            return
        left = self.model.iteration(generated, trained, self.moved_from, self.scale["rollout"], self.scale["train"])
        ran = self.model.compose(s.rollout_time, s.train_time, generated, trained, s.train_ranks)
        self.realised.append(left.total - ran.total - s.switch_time)

    def guard(self) -> float | None:
        """The realised saving of the moves of the last GUARD_WINDOW iterations, if negative."""
        gains = [g for g in self.realised if g is not None]
        return sum(gains) if gains and sum(gains) < 0 else None

    def _update(self, key: str, ratio: float) -> None:
        """EMA of a measured / predicted ratio; the first measurement replaces the prior (1)."""
        a = self.cfg.smoothing if key in self.measured else 1.0
        self.scale[key] = a * ratio + (1 - a) * self.scale[key]
        self.measured.add(key)

    def _plan(self, cur: int, anchor: int, nxt: int, horizon: int):
        """(splits of the cheapest plan from `cur`, the horizon's time of moving to `anchor` and
        staying there (staying at `cur` where they are the same), the plan's time, the next
        iteration's predictions by split)."""
        lag, memo = self.max_lag, {}
        steps = []
        for j in range(nxt, nxt + horizon):
            gen = self.forecast.forecast(j) if j < self.iterations else (None, None)
            trn = self.forecast.forecast(j - lag) if j >= lag else (None, None)
            steps.append((gen, trn))

        def predict(h: int, k: int, members: int = ENSEMBLE):
            (gen, gkey), (trn, tkey) = steps[h]
            key = (gkey, tkey, k, members)
            if key not in memo:
                memo[key] = self.model.expected(gen and gen[-members:], trn and trn[-min(members, self.train_members):],
                                                k, self.scale["rollout"], self.scale["train"])
            return memo[key]

        # Candidate splits: the current one and the best of the steps that steps_to_search picks
        # (searched on their newest batches, SEARCH_PROMPTS); the best splits of the steps between
        # lie between those (a trend moves them gradually).
        searched = steps_to_search([gkey for (_, gkey), _ in steps])
        cands = sorted({cur, anchor} | {self.model.best_split(lambda k, h=h: predict(h, k, self.search_members),
                                                              near=cur) for h in searched})
        # every rollout the program below prices, at once (on the pricing workers, if any)
        self.model.price_rollouts((g, k) for (gen, _), _ in steps for g in gen or () for k in cands)
        # Dynamic program over the horizon. A state is (split, engines_from): a move into rollout
        # below engines_from starts engines cold, once; later returns wake parked ones.
        start = (cur, self.engines_from)
        value, paths = {start: 0.0}, {start: []}
        for h in range(horizon):
            new_value, new_paths = {}, {}
            for (k, e), v in value.items():
                for k2 in cands:
                    state = (k2, min(e, k2))
                    total = v + self._switch_cost(k, k2, e) + predict(h, k2).total
                    if state not in new_value or total < new_value[state]:
                        new_value[state], new_paths[state] = total, paths[(k, e)] + [k2]
            value, paths = new_value, new_paths
        end = min(value, key=lambda st: (value[st], paths[st][0] != anchor))
        # Staying means staying while batches are generated: the run's last iterations, which only
        # train, are planned alike by every plan (all ranks to training where that pays) until the
        # decision just before them, so that their saving does not count as an earlier move's (it
        # made a run move ranks it lost time on).
        rollouts = sum(gen is not None for (gen, _), _ in steps)
        stay = self._switch_cost(cur, anchor) + sum(predict(h, anchor).total for h in range(rollouts or horizon))
        if 0 < rollouts < horizon:
            stay += min(self._switch_cost(anchor, k2) + sum(predict(h, k2).total for h in range(rollouts, horizon))
                        for k2 in cands)
        return paths[end], stay, value[end], {k: predict(0, k) for k in cands}

    def _switch_cost(self, k: int, k2: int, engines_from: int | None = None) -> float:
        if k2 == k:
            return 0.0
        where = "rollout" if k2 < k else "train"
        e = self.engines_from if engines_from is None else engines_from
        return self.scale[f"switch to {where}"] * self.model.switch(k, k2, e)

    def _keep(self, s, reason, p=None, attrs=None, gain=math.nan) -> Decision:
        return Decision(s.iteration, s.train_ranks, s.train_ranks, reason, p.rollout if p else math.nan,
                        p.train if p else math.nan, gain, 0.0, attrs or {})

    def state(self) -> dict:
        return {"forecast": self.forecast.state(), "scale": dict(self.scale), "measured": sorted(self.measured),
                "engines_from": self.engines_from, "last_move": list(self.last_move) if self.last_move else None,
                "anchor": self.anchor, "moved_from": self.moved_from, "since_move": self.since_move,
                "realised": list(self.realised)}

    def load_state(self, state: dict, new_world_split: int | None = None) -> None:
        self.forecast.load_state(state["forecast"])
        self.scale = dict(state["scale"])
        if new_world_split is not None:   # the lengths seen and the cost model's errors hold; splits and moves do not
            self.engines_from = new_world_split
            return
        self.engines_from = state["engines_from"]
        self.last_move = tuple(state["last_move"]) if state["last_move"] else None
        self.measured = set(state["measured"])
        self.anchor = state.get("anchor")
        self.moved_from, self.since_move = state.get("moved_from"), state.get("since_move", 0)
        self.realised = deque(state.get("realised", ()), maxlen=GUARD_WINDOW)


def steps_to_search(keys: list[tuple | None]) -> set[int]:
    """The steps of a plan's horizon whose best split the plan searches, from their forecasts'
    keys (LengthForecast.forecast): the first and the last step, and every step whose kind of
    batch (task and cap of a forecast; a sample of the configured workload, or no batch) appears
    first there. Between them a forecast changes only by its trend, like a growing length: the
    best splits of the steps between lie between those at their ends."""
    searched, seen = {0, len(keys) - 1}, set()
    for h, key in enumerate(keys):
        kind = key[:3] if key is not None and key[0] == "forecast" else key
        if kind not in seen:
            seen.add(kind)
            searched.add(h)
    return searched


@dataclass(frozen=True)
class PolicyKind:
    """A policy as configuration and launchers see it, before one is built (`make_policy`)."""
    name: str
    factory: str                  # "module:Class", imported when the policy is built
    chooses_start: bool           # picks its starting split (policy.train_ranks=auto allowed)
    needs_cost_model: bool = False    # prices splits with the cost model
    simulator_only: bool = False  # needs what only the simulator knows (future batches)
    free_switch: bool = False     # its moves cost nothing (an upper bound, not a runnable policy)
    colocated: bool = False       # every rank generates, then every rank trains (no split)
    scripted: bool = False        # follows policy.schedule (the only kind that reads it)


# Every policy, the simulator's oracle included.
POLICIES = {k.name: k for k in (
    PolicyKind("static", "dynaresize.plan.policy:StaticPolicy", chooses_start=False),
    PolicyKind("colocated", "dynaresize.plan.policy:ColocatedPolicy", chooses_start=True, colocated=True),
    PolicyKind("scripted", "dynaresize.plan.policy:ScriptedPolicy", chooses_start=False, scripted=True),
    PolicyKind("dynamic", "dynaresize.plan.policy:DynamicPolicy", chooses_start=True, needs_cost_model=True),
    PolicyKind("oracle", "dynaresize.sim.oracle:OraclePolicy", chooses_start=True, simulator_only=True,
               free_switch=True),
    PolicyKind("oracle_expected", "dynaresize.sim.oracle:ExpectedOraclePolicy", chooses_start=True,
               simulator_only=True, free_switch=True),
)}


def steady_state(model: IterationModel, forecast: LengthForecast, iterations: int, most: int | None = None,
                 at: int = 0):
    """(predict(k): the mean predicted iteration of k train ranks in steady state under the
    workload's configured lengths, the number of iterations averaged over). Steady state over one
    period of the workload's tasks (one batch without a mixture) from batch `at` (rounded down to
    a period's start; 0: the run's first batches): each iteration generates samples of its batch
    and trains the one before it in the period; `most`: at most that many iterations of the
    period, evenly spaced (a long period of task blocks repeats itself)."""
    w = forecast.w
    period = min(len(w.mixture) * max(w.mixture_block, 1) if w.mixture else 1, iterations)
    phases = list(range(period))[::max(-(-period // most), 1)] if most else list(range(period))
    start = at // period * period
    # only the batches priced: a phase and the one before it in the period
    needed = {b for p in phases for b in (p, (p - 1) % period)}
    if start == 0:            # the forecast's own samples, which it uses until it has seen a task
        samples = {b: forecast.prior(b) for b in needed}
    else:
        samples = {b: workload_sample(w, forecast.seed, start + b, forecast.ppb, forecast.spp,
                                      max_rounds=forecast.max_rounds) for b in needed}

    def predict(k: int) -> Prediction:
        return Prediction.mean([model.expected(samples[b], samples[(b - 1) % period], k) for b in phases])
    return predict, len(phases)


# rollout.migration_threshold=auto: the (threshold, tail ranks) the cost model chooses among
MIGRATION_CHOICES = tuple((threshold, tails) for threshold in (1, 2, 4) for tails in (1, 2, 4, 8))
MIGRATION_SAMPLES = 4     # iterations of a task period the choice averages over


def choose_migration(job, cost) -> tuple[int, int, str]:
    """rollout.migration_threshold=auto: the tail migration (threshold, tail ranks; 0: none) whose
    predicted steady-state iteration is the shortest, at the split the run starts from (for a
    policy that chooses its split: the best one without migration, or one of its neighbours), and
    why. Migration frees rollout ranks (work stealing puts them to use) at the price of
    re-prefilled contexts and busier tail ranks; it is chosen only if it saves more than
    policy.dead_band of an iteration over none."""
    if cost is None or not cost.continuous:
        return 0, job.rollout.tail_ranks, ("rollout.migration_threshold=auto: none (the cost model batches "
                                           "sequentially, one group at a time: a hand-off would move work "
                                           "without shortening it)")
    r = job.rollout
    forecast = LengthForecast(job.workload, job.run.seed, r.prompts_per_batch, r.samples_per_prompt,
                              generation_rounds(job.trainer))
    fixed = None if POLICIES[job.policy.name].chooses_start else int(job.policy.train_ranks)

    plain = IterationModel.for_job(job, cost)
    predict, tasks = steady_state(plain, forecast, job.run.iterations, MIGRATION_SAMPLES)
    k = fixed if fixed is not None else plain.best_split(predict, exhaustive=tasks > 1)
    none_s = predict(k).total
    # with migration, the splits near the best one without (the policy moves from there if it pays)
    near = [k] if fixed is not None else \
        plain.candidates[max(plain.candidates.index(k) - 2, 0):plain.candidates.index(k) + 3]

    def best(migration) -> tuple[float, int]:
        predict = steady_state(IterationModel.for_job(job, cost, migration), forecast, job.run.iterations,
                               MIGRATION_SAMPLES)[0]
        return min((predict(k2).total, k2) for k2 in near)
    priced = [(*best(m), m) for m in MIGRATION_CHOICES]
    with_s, k_with, (threshold, tails) = min(priced, key=lambda x: x[0])
    if with_s >= none_s * (1 - job.policy.dead_band):
        return 0, r.tail_ranks, (f"rollout.migration_threshold=auto: none: predicted {none_s:.4g} s an iteration "
                                 f"({k} train ranks); the best tail migration (threshold {threshold}, {tails} "
                                 f"tail ranks) {with_s:.4g} s")
    return threshold, tails, (f"rollout.migration_threshold=auto: threshold {threshold}, {tails} tail ranks: "
                              f"predicted {with_s:.4g} s an iteration ({k_with} train ranks), without "
                              f"{none_s:.4g} s ({k})")


def resolve_migration(job, cost):
    """`job` (config.JobConfig) with rollout.migration_threshold=auto replaced by choose_migration's
    choice, and why ('' when it was not auto)."""
    if job.rollout.migration_threshold != "auto":
        return job, ""
    threshold, tails, why = choose_migration(job, cost)
    return dataclasses.replace(job, rollout=dataclasses.replace(job.rollout, migration_threshold=threshold,
                                                                tail_ranks=tails)), why


def make_policy(job, cost=None, sim=None) -> Policy:
    """The policy of job config `job` (dynaresize.config.JobConfig). `cost`: the cost model that
    prices splits (default: the job's hardware profile, for policies that need one); `sim`: the
    simulator, for a simulator-only policy."""
    kind = POLICIES[job.policy.name]
    if cost is None and kind.needs_cost_model:
        from .costmodel import CostModel
        from .hardware import job_profile
        cost = CostModel.for_job(job, job_profile(job))
    module, _, name = kind.factory.partition(":")
    cls = getattr(importlib.import_module(module), name)
    return cls(job, cost, sim) if kind.simulator_only else cls(job, cost)
