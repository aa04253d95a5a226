"""The oracle: the per-iteration best split with free switching (simulator only).

Before every iteration it knows what the iteration will do (the batch to generate, hidden lengths
included, and the batch to train) and picks the split with the shortest predicted iteration,
priced by the same cost model as the simulation (prediction.IterationModel, no noise). Its switches
cost nothing (the simulator records none). No policy can beat it under the same cost model: it is
the upper bound of throughput a split policy can reach, the denominator of "dynamic / oracle".
"""
from __future__ import annotations

import math

from ..policy import Decision, IterationStats, Policy


class OraclePolicy(Policy):
    name = "oracle"

    def __init__(self, job, cost, sim):
        super().__init__(job, cost)
        self.sim = sim
        self.total = sim.iterations + self.max_lag

    def best(self, iteration: int) -> tuple[int, float]:
        """The split with the shortest predicted iteration `iteration` and its time."""
        k = self.sim.model.best_split(lambda k: self.sim.predict(iteration, k))
        return k, self.sim.predict(iteration, k).total

    def initial_train_ranks(self) -> int:
        return self.best(0)[0]

    def decide(self, s: IterationStats) -> Decision:
        nxt = s.iteration + 1
        if nxt >= self.total:
            return Decision(s.iteration, s.train_ranks, s.train_ranks, "oracle: last iteration",
                            s.rollout_time, s.train_time)
        k, t = self.best(nxt)
        now = self.sim.predict(nxt, s.train_ranks).total if s.train_ranks in self.sim.model.candidates else math.nan
        p = self.sim.predict(nxt, k)
        reason = "oracle: best split of the next iteration" if k != s.train_ranks else "oracle: keep (best)"
        return Decision(s.iteration, s.train_ranks, k, reason, p.rollout, p.train, now - t, 0.0,
                        {"predicted_s": round(t, 6)})
