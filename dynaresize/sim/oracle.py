"""The oracle: the per-iteration best split with free switching (simulator only).

Before every iteration it knows what the iteration will do (the caps of the batch to generate and
of the batch to train) and picks the split with the shortest predicted iteration, priced by the
same cost model as the simulation (no noise). Its switches cost nothing (the simulator records
none). No policy can beat it under the same cost model: it is the upper bound of throughput a
split policy can reach, the denominator of "dynamic / oracle".
"""
from __future__ import annotations

import math

from ..policy import Decision, IterationStats, Policy

EXHAUSTIVE = 48       # candidate splits up to which every one is evaluated


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
        lo, hi = 0, len(cands) - 1
        while hi - lo + 1 > EXHAUSTIVE:
            # Stage times are monotone in the split (rollout up, training down with more train
            # ranks), so the best point of a coarse grid brackets the optimum.
            grid = sorted({lo + round(j * (hi - lo) / 16) for j in range(17)})
            values = [f(i) for i in grid]
            b = min(range(len(grid)), key=lambda j: (values[j], grid[j]))
            lo, hi = grid[max(b - 1, 0)], grid[min(b + 1, len(grid) - 1)]
        i = min(range(lo, hi + 1), key=lambda j: (f(j), j))
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
