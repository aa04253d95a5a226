"""The recipe: one RL iteration loop over a role table that may change between iterations.

Pipeline with `run.max_lag` = L: in iteration i, rollout ranks generate batch i with the weights
they hold, and train ranks train on batch i - L. With L = 0 training waits for this iteration's
batch (synchronous); with L = 1 it trains on the batch generated in the previous iteration while
the next one is generated (one step off-policy). L is fixed for a run: the split never changes
what is computed, only where. With L = 1 the last iteration's batch trains in one more step, the
pipeline's drain (iteration `iterations`), which generates nothing.

A held-out evaluation (`eval.every`) runs after the weight sync of every `every`-th iteration from
0 (so the first measures the initial weights) and of the last step, on the generating ranks.

The loop is written once, over the stages of `Stages`. The runtime's `Job` (job.py) does each
stage's real work on this rank; the simulator (sim/core.py) prices it for every rank at once with
the cost model. What a stage hands to the next (the generated samples, the batch to train) is
opaque to the loop: samples in the runtime, a batch number in the simulator.
"""
from __future__ import annotations

from typing import Any, Protocol

from .plan.policy import Decision


class Stages(Protocol):
    first_iteration: int            # 0, or the iteration after a resumed checkpoint
    pending_batch: Any              # generated, not yet trained (max_lag 1; a resumed run's)
    pending_decision: Decision | None
    end_warned: bool                # Slurm warned of the job's end (agreed at end_iteration)

    def begin_iteration(self, it: int) -> None: ...
    def switch(self, it: int, decision: Decision) -> None: ...
    def rollout(self, it: int, batch: int) -> Any: ...
    def exchange(self, it: int, generated: Any) -> Any: ...
    def train(self, it: int, batch: Any) -> None: ...
    def sync_weights(self, it: int) -> None: ...
    def evaluate(self, it: int) -> None: ...
    def end_iteration(self, it: int, generated: int | None, trained: int | None) -> Decision: ...
    def checkpoint_if_due(self, it: int, ready: Any, decision: Decision) -> None: ...
    def requeue(self) -> None: ...
    def finish(self) -> None: ...


def run_iterations(job: Stages, iterations: int, lag: int, eval_every: int = 0) -> None:
    ready = job.pending_batch                 # generated, not yet trained (resumed runs start with it)
    decision = job.pending_decision

    for it in range(job.first_iteration, iterations + lag):
        job.begin_iteration(it)
        if decision is not None and decision.moves:
            job.switch(it, decision)          # resize: critical operations block, the rest overlap
        generate = it if it < iterations else None
        train = it - lag if it >= lag else None

        samples = job.rollout(it, generate) if generate is not None else None
        if lag == 0:
            ready = job.exchange(it, samples)     # trainers wait for this iteration's batch
        if train is not None:
            job.train(it, ready)
        if lag == 1:
            ready = job.exchange(it, samples)     # handed over for the next iteration
        if train is not None:
            job.sync_weights(it)
        if evaluation_due(it, iterations + lag - 1, eval_every):
            job.evaluate(it)                      # held-out prompts, with the weights just synced

        decision = job.end_iteration(it, generated=generate, trained=train)
        job.checkpoint_if_due(it, ready, decision)
        if job.end_warned:                        # Slurm ends the job soon: checkpointed just above
            job.requeue()                         # back in the queue; it resumes from the checkpoint
            return

    job.finish()


def evaluation_due(it: int, last: int, every: int) -> bool:
    """Whether the held-out evaluation runs after iteration `it` (`last`: the last step)."""
    return every > 0 and (it % every == 0 or it == last)

