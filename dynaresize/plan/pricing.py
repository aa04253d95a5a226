"""Candidate rollouts priced on worker processes (`policy.pricing_workers`).

A decision of the dynamic policy prices a few hundred rollout schedules at large scale (the
forecast's batches at the splits its plan weighs: at 1,024 ranks each a continuous-batching
schedule of tens of thousands of sequences: about 0.5 ms apiece where no rank queues, up to 50 ms
on the few rollout ranks of a large split), while every rank of the job waits for it. The
schedules are independent of each other, so the deciding rank hands those it needs next (a
forecast's batches at one split, or every rollout of the plan's dynamic program) to a pool of
worker processes on its node (the cores its task holds besides its own) and waits for them
together. A worker computes exactly what the policy's process would
(IterationModel.price_rollout, the same cost model), so a decision does not depend on the
number of workers; only its time does.

Workers are spawned (not forked: the deciding rank may hold MPI and CUDA state) on the first
decision and stop with the policy.
"""
from __future__ import annotations

import multiprocessing
import weakref
from concurrent.futures import ProcessPoolExecutor

import numpy as np

_model = None        # in a worker: the IterationModel it prices with


def _start(cm, world: int, migration) -> None:
    global _model
    from .prediction import IterationModel
    _model = IterationModel(cm, world, max_lag=1, micro_batch_size=1, migration=migration)


def _price(prompt_lens: np.ndarray, response_lens: np.ndarray, k: int) -> np.ndarray:
    from .prediction import Lengths
    return _model.price_rollout(Lengths(prompt_lens, response_lens, 0), k)


class PricingPool:
    """`workers` processes that price rollouts for an IterationModel of cost model `cm`, `world`
    ranks and tail migration `migration` (see the module docstring)."""

    def __init__(self, cm, world: int, migration, workers: int):
        self.workers = workers
        self.priced = 0                  # rollouts priced by the workers so far
        self._pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                                         initializer=_start, initargs=(cm, world, migration))
        weakref.finalize(self, self._pool.shutdown, wait=False, cancel_futures=True)

    def rollout_times(self, jobs: list) -> list[np.ndarray]:
        """The rollout ranks' times of each (batch, train ranks) of `jobs`, priced in parallel."""
        self.priced += len(jobs)
        chunk = max(len(jobs) // (4 * self.workers), 1)      # fewer messages, the load still spread
        return list(self._pool.map(_price, *zip(*((b.prompt_lens, b.response_lens, k) for b, k in jobs)),
                                   chunksize=chunk))


__all__ = ["PricingPool"]
