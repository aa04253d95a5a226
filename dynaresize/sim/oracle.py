"""The oracles: the per-iteration best split with free switching (simulator only).

`oracle`: before every iteration it knows what the iteration will do (the batch to generate,
hidden lengths included, and the batch to train) and picks the split with the shortest predicted
iteration, priced by the same cost model as the simulation (prediction.IterationModel, no noise).
Its switches cost nothing (the simulator records none). No policy can beat it under the same cost
model: it is the upper bound of throughput a split policy can reach, the denominator of
"dynamic / oracle".

`oracle_expected`: the same, except that it does not know the sampled lengths of the batch it is
about to generate, only their distribution (the configured workload at that batch: its task, cap
and growth, prediction.workload_sample). It picks the split with the shortest expected iteration.
The batch it trains was generated already (max_lag 1), so it knows that one. The gap between the
two oracles is what foresight of the lengths is worth: no online policy can close it. The gap from
it down to the dynamic policy is what the policy loses by forecasting the distribution from past
batches and by paying for its switches.
"""
from __future__ import annotations

import math

from ..plan.policy import Decision, IterationStats, Policy
from ..data.shapes import generation_rounds
from ..plan.prediction import Lengths, Prediction, workload_sample

# Batches of the workload an expected iteration time averages over. A split's time is floored by
# the longest sequences of its ranks, so a few samples estimate it with noise of the size of the
# difference between neighbouring splits. With 16 (the dynamic policy's ensemble) this oracle
# switched between neighbours on their noise: 0.998 x the best static split on the suite's H100
# `stationary` at 64 ranks, against 1.003 with 64.
EXPECTED_SAMPLES = 64


class OraclePolicy(Policy):
    name = "oracle"
    knows = "its true batches"

    def __init__(self, job, cost, sim):
        super().__init__(job, cost)
        self.sim = sim
        self.total = sim.iterations + self.max_lag

    def predict(self, iteration: int, k: int) -> Prediction:
        return self.sim.predict(iteration, k)

    def best(self, iteration: int) -> tuple[int, float]:
        """The split with the shortest predicted iteration `iteration` and its time."""
        k = self.sim.model.best_split(lambda k: self.predict(iteration, k))
        return k, self.predict(iteration, k).total

    def initial_train_ranks(self) -> int:
        return self.best(0)[0]

    def decide(self, s: IterationStats) -> Decision:
        nxt = s.iteration + 1
        if nxt >= self.total:
            return Decision(s.iteration, s.train_ranks, s.train_ranks, f"{self.name}: last iteration",
                            s.rollout_time, s.train_time)
        k, t = self.best(nxt)
        now = self.predict(nxt, s.train_ranks).total if s.train_ranks in self.sim.model.candidates else math.nan
        p = self.predict(nxt, k)
        reason = (f"{self.name}: best split of the next iteration for {self.knows}" if k != s.train_ranks
                  else f"{self.name}: keep (best)")
        return Decision(s.iteration, s.train_ranks, k, reason, p.rollout, p.train, now - t, 0.0,
                        {"predicted_s": round(t, 6)})


class ExpectedOraclePolicy(OraclePolicy):
    name = "oracle_expected"
    knows = "the distribution of its lengths"

    def __init__(self, job, cost, sim):
        super().__init__(job, cost, sim)
        self._iteration, self._predictions = None, {}

    def predict(self, iteration: int, k: int) -> Prediction:
        if iteration != self._iteration:           # one iteration at a time: its samples, its prices
            sim = self.sim
            gen = (workload_sample(sim.cfg.workload, sim.seed, iteration, sim.prompts, sim.spp, EXPECTED_SAMPLES,
                                   generation_rounds(sim.cfg.trainer)) if iteration < sim.iterations else None)
            b = iteration - self.max_lag
            trn = None if b < 0 else (gen if b == iteration else [Lengths.of(sim.batch(b))])
            self._iteration, self._samples, self._predictions = iteration, (gen, trn), {}
        if k not in self._predictions:
            self._predictions[k] = self.sim.model.expected(*self._samples, k)
        return self._predictions[k]
