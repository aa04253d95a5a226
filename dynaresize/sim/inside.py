"""What moving work inside an iteration could gain at best, priced by the cost model.

    dynaresize-sim inside --ranks 64 --hardware h100 h200 [--workloads stationary,dapo] [overrides]

A split policy chooses one split per iteration; inside the iteration, long-tailed generation
leaves most rollout ranks idle while a few finish their longest sequences. Two online mechanisms
go after that idle time (they never read a response's length before it is generated):

  tail migration  when a rollout rank's running sequences fall to `threshold`, they move to one of
                  the tail ranks (a share of the rollout ranks, those free first), which
                  re-prefills prompt + generated prefix (or receives the KV cache) and continues;
  work stealing   a rollout rank with nothing left to generate computes gradients of micro-batches
                  the train ranks have not taken yet.

This module prices both with the cost model (dynaresize.plan.costmodel: continuous batching, the list
schedule of each rank's slots) and gives an UPPER estimate of what they can gain, by being
generous everywhere it has to choose:
- a migration costs only its re-prefill (none with `kv_transfer`); a helper joins the train step
  the moment it is free, and its gradients join the reduction for free, with perfect balance;
- a tail rank admits all its sequences at once (there are as many tail ranks as max_num_seqs
  needs), and its per-token work is added to its step clock rather than slowing every step;
- every iteration runs the split that is best for its true batches with the mechanism (the
  oracle's hindsight), and the mechanism's parameters are the best of a grid per workload.
Where even this estimate closes less than half of the gap between the per-iteration oracle and the
bound (sim.suite.bound), no mechanism of this kind can. Beside it: placement with foresight (prompt
groups spread by their hidden longest response instead of their prompt length), what an online
scheduler cannot do.

Continuous-batching profiles only (the GPU profiles): the torch engine's sequential batching has no
slots to hand a tail to.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import dataclass

import numpy as np

from ..plan.costmodel import CostModel
from ..plan.placement import place_prompts, serpentine
from ..plan.prediction import IterationModel, Lengths, Prediction


@dataclass(frozen=True)
class Mechanism:
    threshold: int          # a rollout rank hands on its sequences when this many or fewer still run
    tail_share: float       # tail ranks as a share of the rollout ranks (at least as many as slots need)
    kv_transfer: bool       # the KV cache moves for free (True) or the tail rank re-prefills (False)

    def describe(self) -> str:
        return (f"threshold {self.threshold}, tail {self.tail_share:.0%} of rollout ranks, "
                f"{'KV moved free' if self.kv_transfer else 're-prefill'}")


# Moving the KV cache for free is never slower than re-prefilling, so the upper estimate searches
# with it; the best mechanism is then priced with re-prefill too, what a runtime would do first.
GRID = tuple(Mechanism(t, s, True) for t in (1, 2, 4, 8) for s in (1 / 32, 1 / 16, 1 / 8, 1 / 4, 1 / 2))


def rollout_with_migration(cm: CostModel, batch: Lengths, ranks: int, mech: Mechanism | None,
                           assign: np.ndarray | None = None) -> tuple[float, np.ndarray]:
    """The rollout stage on `ranks` rollout ranks with tail migration: (its end, the time at which
    each rank that is not a tail rank is free). Without `mech` every rank runs its own sequences
    to the end (the cost model's rollout_times). `assign`: the rank of each prompt group (default:
    placement.place_prompts, as the runtime)."""
    if not cm.continuous:
        raise ValueError("the inside-iteration estimate needs a continuous-batching profile (e.g. h100)")
    c, scale = cm.coef.rollout, cm.scale
    assign = place_prompts(batch.prompt_lens, ranks) if assign is None else assign
    free, rank, rem, ctx = cm.rollout_cuts(assign, batch.prompt_lens, batch.response_lens, ranks,
                                           0 if mech is None else mech.threshold)
    if mech is None or not len(rem):
        return float(free.max()), free
    # the tail: sequences in order of arrival, dealt round robin over the ranks free first
    arrive = free[rank]
    tail = max(int(round(ranks * mech.tail_share)), math.ceil(len(rem) / cm.max_num_seqs), 1)
    tail = min(tail, ranks)
    tail_ranks = np.argsort(free, kind="stable")[:tail]
    by_arrival = np.argsort(arrive, kind="stable")
    on = np.empty(len(rem), dtype=np.int64)
    on[by_arrival] = np.arange(len(rem)) % tail
    begin = np.maximum(arrive, free[tail_ranks][on])
    work = c.per_token_s * rem + c.per_kv_token_s * (ctx * rem + rem * (rem - 1) / 2)
    if not mech.kv_transfer:
        work = work + c.per_prompt_token_s * ctx
    steps_end = np.full(tail, -np.inf)
    np.maximum.at(steps_end, on, begin + scale * c.per_step_s * rem)
    tail_end = steps_end + scale * np.bincount(on, weights=work, minlength=tail)
    helpers = np.ones(ranks, dtype=bool)
    helpers[tail_ranks] = False
    return float(max(tail_end.max(), free[helpers].max(initial=0.0))), free[helpers]


def train_with_helpers(model: IterationModel, batch: Lengths, k: int, helpers_free: np.ndarray) -> float:
    """The train stage of k train ranks when rollout ranks join it as they become free (times in
    `helpers_free`, from the iteration's start): the train work spread perfectly over every rank
    working, never longer than the train ranks alone; synchronisation as without helpers."""
    cm = model.cm
    tok, mb = model.train_work(batch, k)
    alone = float(np.max(cm.train_compute_time(tok, mb)))
    work = float(np.sum(cm.train_compute_time(tok, mb)))
    f = np.sort(np.asarray(helpers_free, dtype=np.float64))
    if not (f < alone).any():                  # nobody is free before the train ranks are done
        return alone + cm.train_sync_time(k)
    # k T + sum over helpers of max(0, T - f) = work: piecewise linear in T, solved segment by segment
    t, done, working = 0.0, 0.0, k
    for fi in f:
        if fi >= alone or done + working * (fi - t) >= work:
            break
        done += working * (fi - t)
        t, working = fi, working + 1
    t = min(t + (work - done) / working, alone)
    return t + cm.train_sync_time(k)


def inside_iteration(model: IterationModel, generate: Lengths | None, train: Lengths | None, k: int,
                     mech: Mechanism | None) -> Prediction:
    """One iteration of k train ranks with tail migration and work stealing (mech None: neither,
    the rollout priced by this module's schedule, which equals the cost model's)."""
    R = model.world - k
    roll, free = rollout_with_migration(model.cm, generate, R, mech) if generate is not None else (0.0, np.zeros(R))
    if train is None:
        trn = 0.0
    elif mech is None:
        trn = model.train(train, k)
    else:
        trn = train_with_helpers(model, train, k, free)
    return model.compose(roll, trn, generate, train, k)


def foresight_iteration(model: IterationModel, generate: Lengths | None, train: Lengths | None, k: int) -> Prediction:
    """One iteration of k train ranks whose prompt groups are spread by their hidden longest
    response (serpentine), which no online scheduler knows."""
    R = model.world - k
    roll = 0.0
    if generate is not None:
        assign = serpentine(np.asarray(generate.response_lens).max(axis=1), R)
        roll = float(model.cm.rollout_times(assign, generate.prompt_lens, generate.response_lens, R).max())
    trn = model.train(train, k) if train is not None else 0.0
    return model.compose(roll, trn, generate, train, k)


def fastest_split(model: IterationModel, price, around: int | None = None, reach: int = 3) -> tuple[int, float]:
    """(split, time) of the shortest iteration, price(k) -> Prediction: over every candidate, or,
    from candidate split `around`, over `reach` candidates on each side, widened while the best
    lies at the window's edge (the iteration time of a split is unimodal in practice)."""
    cands = model.candidates
    if around is None:
        return min(((k, price(k).total) for k in cands), key=lambda x: (x[1], x[0]))
    times: dict[int, float] = {}
    lo = hi = cands.index(around)
    lo, hi = max(lo - reach, 0), min(hi + reach, len(cands) - 1)
    while True:
        for i in range(lo, hi + 1):
            if i not in times:
                times[i] = price(cands[i]).total
        i = min(times, key=lambda j: (times[j], j))
        if i == lo and lo > 0:
            lo = max(lo - reach, 0)
        elif i == hi and hi < len(cands) - 1:
            hi = min(hi + reach, len(cands) - 1)
        else:
            return cands[i], times[i]


def estimate(spec: dict, grid=GRID, log=None) -> dict:
    """The rows of one workload (a plain config dict, sim.suite.compose_base): per-iteration
    best splits with free switching (the oracle, priced analytically), the same with foresight
    placement, with each mechanism of `grid`, and the bound; total times in seconds."""
    from ..data.shapes import filtered_shape, generation_rounds
    from .config import prepare
    from .suite import bound
    setup = prepare(spec)
    cfg = setup.cfg
    cm = CostModel.for_job(cfg, setup.profile)
    if not cm.continuous:
        raise ValueError(f"hardware {setup.profile.name!r} batches sequentially; the inside-iteration estimate needs "
                         f"a continuous-batching profile (e.g. --hardware h100)")
    lag = cfg.run.max_lag
    model = IterationModel(cm, cfg.cluster.ranks, lag, cfg.trainer.micro_batch_size, cfg.policy.resize_unit)
    spp, prompts = cfg.rollout.samples_per_prompt, cfg.rollout.prompts_per_batch

    def lengths(b):
        return Lengths.of(filtered_shape(cfg.workload, cfg.run.seed, b, prompts, spp, generation_rounds(cfg.trainer)))

    n = cfg.run.iterations
    batches = [(lengths(it) if it < n else None, lengths(it - lag) if it >= lag else None) for it in range(n + lag)]
    oracle = [fastest_split(model, lambda k: model.iteration(gen, trn, k)) for gen, trn in batches]
    totals = {"oracle": sum(t for _, t in oracle),
              "foresight": sum(fastest_split(model, lambda k: foresight_iteration(model, gen, trn, k), around=k0)[1]
                               for (gen, trn), (k0, _) in zip(batches, oracle))}

    def with_mechanism(m: Mechanism) -> float:
        return sum(fastest_split(model, lambda k: inside_iteration(model, gen, trn, k, m), around=k0)[1]
                   for (gen, trn), (k0, _) in zip(batches, oracle))
    for i, m in enumerate(grid):
        totals[m] = with_mechanism(m)
        if log:
            log(f"  {m.describe()}: {totals['oracle'] / totals[m]:.3f} x oracle ({i + 1}/{len(grid)})")
    best = min(grid, key=lambda m: totals[m])
    prefill = Mechanism(best.threshold, best.tail_share, False)
    return {"oracle_s": totals["oracle"], "foresight_s": totals["foresight"], "inside_s": totals[best],
            "inside_prefill_s": with_mechanism(prefill), "mechanism": best.describe(),
            "bound_s": bound(spec)["total_time_s"]}


def gap_closed(row: dict, key: str) -> float:
    """The share of the oracle -> bound gap in throughput that row[key] closes."""
    gap = row["oracle_s"] / row["bound_s"] - 1
    return (row["oracle_s"] / row[key] - 1) / gap if gap > 1e-9 else math.nan


def main(argv: list[str] | None = None) -> int:
    from .suite import cell_arguments, compose_base, unknown_cells
    p = argparse.ArgumentParser(prog="dynaresize-sim inside", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    cell_arguments(p)
    p.add_argument("--out", default="inside.md", help="the table, as Markdown (default ./inside.md)")
    p.add_argument("--page", default=None, help="also write the table as a results page (Markdown)")
    p.add_argument("overrides", nargs="*", help="Hydra overrides for every workload, e.g. run.iterations=50")
    args = p.parse_intermixed_args(argv)
    from ..config import ConfigError
    from ..plan.hardware import ProfileError
    problem = unknown_cells(args)
    if problem:
        print(f"dynaresize-sim inside: {problem}", file=sys.stderr)
        return 2
    lines = ["| hardware | ranks | workload | foresight placement | inside-iteration, upper estimate "
             "| the same, re-prefill | bound | gap closed: foresight | gap closed: inside | its mechanism |",
             "|" + "---|" * 10]
    started = time.perf_counter()
    try:
        for hw in args.hardware:
            for ranks in args.ranks:
                for w in [w for w in args.workloads.split(",") if w]:
                    t0 = time.perf_counter()
                    row = estimate(compose_base(w, hw, ranks, args.overrides),
                                   log=lambda line, w=w: print(f"[inside]   {hw} {ranks} {w}: {line}", flush=True))
                    x = {k: row["oracle_s"] / row[k] for k in ("foresight_s", "inside_s", "inside_prefill_s", "bound_s")}
                    lines.append(f"| {hw} | {ranks} | `{w}` | {x['foresight_s']:.3f} | {x['inside_s']:.3f} "
                                 f"| {x['inside_prefill_s']:.3f} | {x['bound_s']:.3f} | {gap_closed(row, 'foresight_s'):.0%} "
                                 f"| {gap_closed(row, 'inside_s'):.0%} | {row['mechanism']} |")
                    print(f"[inside] {hw} {ranks:>5} ranks  {w:<20} foresight {x['foresight_s']:.3f}  inside "
                          f"{x['inside_s']:.3f}  bound {x['bound_s']:.3f}  x oracle  ({row['mechanism']}; "
                          f"{time.perf_counter() - t0:.0f} s, {time.perf_counter() - started:.0f} s in all)", flush=True)
    except (ConfigError, ProfileError, ValueError) as e:
        print(f"dynaresize-sim inside: {e}", file=sys.stderr)
        return 2
    text = ("Throughput relative to the per-iteration oracle (best split of each iteration for its true "
            "batches, free switching; priced analytically), same seed and cost model per row.\n\n"
            + "\n".join(lines) + "\n")
    with open(args.out, "w") as f:
        f.write(text)
    print(text + f"[inside] written to {os.path.abspath(args.out)}", flush=True)
    if args.page:
        from ..analysis.pages import write_page
        write_page(args.page, "Inside the iteration: what moving work could gain",
                   ["dynaresize-sim", "inside", *(argv if argv is not None else sys.argv[2:])], text)
        print(f"[inside] results page: {args.page}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
