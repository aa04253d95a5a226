"""The oracle: the per-iteration best split with free switching (simulator only).

Before every iteration it knows what the iteration will do (the batch to generate, hidden lengths
included, and the batch to train) and picks the split with the shortest predicted iteration,
priced by the same cost model as the simulation (no noise). Its switches cost nothing (the simulator records
none). No policy can beat it under the same cost model: it is the upper bound of throughput a
split policy can reach, the denominator of "dynamic / oracle".
"""
from __future__ import annotations

import math

from ..policy import Decision, IterationStats, Policy

EXHAUSTIVE = 12       # candidate splits up to which every one is evaluated
NEIGHBOURS = 3        # beyond that: splits evaluated on each side of the stages' crossing


class OraclePolicy(Policy):
    name = "oracle"

    def __init__(self, cfg, world: int, max_lag: int, sim):
        super().__init__(cfg, world, max_lag)
        self.sim = sim
        unit = max(cfg.resize_unit, 1)
        self.candidates = list(range(unit, world - unit + 1, unit)) or [cfg.train_ranks]
        self.total = sim.iterations + max_lag

    def best(self, iteration: int) -> tuple[int, float]:
        """The split with the shortest predicted iteration `iteration` (ties: fewer train ranks)."""
        cands = self.candidates
        f = lambda i: self.sim.predict(iteration, cands[i])[0]   # noqa: E731
        window = range(len(cands))
        if len(cands) > EXHAUSTIVE and self.max_lag >= 1:
            # The stages overlap, so the iteration lasts about max(rollout, train): rollout time
            # grows with the train ranks and train time shrinks, so the best split sits where they
            # cross. Bisect for the crossing (a few evaluations, never a sweep of the splits whose
            # few rollout ranks queue thousands of sequences), then search around it.
            lo, hi = 0, len(cands) - 1
            while lo < hi:
                mid = (lo + hi) // 2
                _, rollout, train = self.sim.predict(iteration, cands[mid])
                lo, hi = (lo, mid) if rollout >= train else (mid + 1, hi)
            window = range(max(lo - NEIGHBOURS, 0), min(lo + NEIGHBOURS, len(cands) - 1) + 1)
        i = min(window, key=lambda j: (f(j), j))
        return cands[i], f(i)

    def initial_train_ranks(self) -> int:
        return self.best(0)[0]

    def decide(self, s: IterationStats) -> Decision:
        nxt = s.iteration + 1
        if nxt >= self.total:
            return Decision(s.iteration, s.train_ranks, s.train_ranks, "oracle: last iteration",
                            s.rollout_time, s.train_time)
        k, t = self.best(nxt)
        now = self.sim.predict(nxt, s.train_ranks)[0] if s.train_ranks in self.candidates else math.nan
        _, r, tr = self.sim.predict(nxt, k)
        reason = "oracle: best split of the next iteration" if k != s.train_ranks else "oracle: keep (best)"
        return Decision(s.iteration, s.train_ranks, k, reason, r, tr, now - t, 0.0,
                        {"predicted_s": round(t, 4)})
