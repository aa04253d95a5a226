"""Tail migration (`rollout.migration_threshold`): a rollout rank with that many sequences left or
fewer hands them to a tail rank and is free (to help the train step, with trainer.work_stealing).

The tail ranks of an iteration are the first `rollout.tail_ranks` rollout ranks to get down to
the threshold (their cut): each takes a ticket with an atomic add on a counter in the job's
TCPStore (comm.make_store) when it gets there. Tickets 0..T-1 are the tail ranks, which publish
their rank under their ticket; every later rank hands off to the tail rank of ticket
(ticket - T) mod T, dealt in turn, so a tail rank knows how many hand-offs to wait for
(`expected`). A tail rank goes on with its own last sequences and admits what the others send it
into the same running batch as their messages arrive (it polls between decode steps, so a
hand-off never waits for another to finish: HandoffInbox). Each later rank sends its tail rank
exactly one message (over MPI, without waiting for it to be received), empty if the rank had
nothing left at its cut.

The engine hands a running group off with what it needs to continue it (rollout.base.Handoff):
the torch engine its whole state, so every token and log-probability is the one the source would
have produced; vLLM the tokens so far, re-prefilled by the tail. Which rank finishes a sample
depends on timing; what it generates does not.

The simulator and the dynamic policy price the same hand-offs (`tail_schedule`): the cut of each
rank (CostModel.rollout_cuts) and a tail rank's continuous batch that admits what arrives while it
runs (CostModel.tail_times). No torch here.
"""
from __future__ import annotations

import pickle

import numpy as np

# MPI tag of a rank's message to its tail rank (the other control-plane traffic is collective).
MIGRATE_TAG = 71


class TailRoster:
    """The tail ranks of iteration `iteration` among `rollout_ranks` rollout ranks, taken first
    come first served (`tail_ranks` of them, at most all but one)."""

    def __init__(self, store, iteration: int, rollout_ranks: int, tail_ranks: int):
        if rollout_ranks < 2:
            raise ValueError("tail migration needs two rollout ranks or more")
        # Keys are never deleted (as in stealing.MicroBatchQueue): an iteration leaves T + 1 short keys.
        self.store, self.key = store, f"tails/{iteration}"
        self.ranks, self.tails = rollout_ranks, min(tail_ranks, rollout_ranks - 1)

    def arrive(self, rank: int) -> int:
        """This rank has reached its cut: its ticket (a tail rank's ticket is published with its rank)."""
        ticket = int(self.store.add(f"{self.key}/arrived", 1)) - 1
        if self.is_tail(ticket):
            self.store.set(f"{self.key}/tail/{ticket}", str(rank))
        return ticket

    def is_tail(self, ticket: int) -> bool:
        return ticket < self.tails

    def tail_of(self, ticket: int) -> int:
        """The rank a later arrival hands off to (waits until that tail rank has published it)."""
        return int(self.store.get(f"{self.key}/tail/{dealt_to(ticket, self.tails)}"))

    def expected(self, ticket: int) -> int:
        """How many later arrivals hand off to the tail rank of `ticket`."""
        return len(range(self.tails + ticket, self.ranks, self.tails))


class HandoffInbox:
    """What a tail rank continues (the engine's rollout.base.Arrivals): its own last groups at
    once, then each later rank's message of batch `batch` as it arrives over `ctrl`
    (comm.ControlPlane), `expected` of them."""

    def __init__(self, ctrl, batch: int, own: list, expected: int):
        self.ctrl, self.batch, self.own, self.left = ctrl, batch, own, expected
        self.sources: list[int] = []         # the ranks that handed sequences over, in arrival order
        self.sequences = sum(h.running for h in own)
        self.generated = sum(h.generated for h in own)   # tokens generated before the hand-offs

    def poll(self, wait: bool) -> list | None:
        if self.own is not None:
            own, self.own = self.own, None
            return own
        if not self.left:
            return None
        got = self.ctrl.receive(MIGRATE_TAG) if wait else self.ctrl.poll(MIGRATE_TAG)
        if got is None:
            return []
        message, source = got
        batch, handoffs = pickle.loads(message)
        if batch != self.batch:
            raise RuntimeError(f"rank {source} handed off batch {batch} while this tail rank generates "
                               f"batch {self.batch}")
        self.left -= 1
        if handoffs:
            self.sources.append(source)
        self.sequences += sum(h.running for h in handoffs)
        self.generated += sum(h.generated for h in handoffs)
        return handoffs


def priced_migration(rollout, cm) -> tuple[int, int] | None:
    """(threshold, tail ranks) of `rollout` (config.RolloutConfig) for IterationModel, when the cost
    model `cm` can price tail migration (continuous batching), else None."""
    if rollout.migration_threshold <= 0 or not cm.continuous:
        return None
    return rollout.migration_threshold, rollout.tail_ranks


def dealt_to(ticket: int, tails: int) -> int:
    """The tail ticket a later arrival (ticket >= tails) hands off to: dealt in turn."""
    return (ticket - tails) % tails


def tail_schedule(cm, cut_s, rank, remaining, context,
                  tail_ranks: int) -> tuple[np.ndarray, list[tuple[int, list[int], float, float]]]:
    """When each rollout rank is done with its rollout under tail migration, as the runtime runs it:
    rank r reaches its cut at `cut_s[r]`; the sequences left then are (rank[i], remaining[i] tokens
    to go, context[i] tokens so far) (CostModel.rollout_cuts). Tickets go in the order of the cuts
    (ties: the lower rank); a tail rank re-prefills its own last sequences at its cut and admits each
    later arrival's into its running batch when it arrives (CostModel.tail_times).
    Returns (each rank's end, per tail rank (tail, the ranks it continued, its cut, its end))."""
    cut_s = np.asarray(cut_s, dtype=np.float64)
    rank = np.asarray(rank, dtype=np.int64)
    order = np.argsort(cut_s, kind="stable")
    tails = min(tail_ranks, len(order) - 1)
    dealt = np.empty(len(order), dtype=np.int64)          # the tail rank of each rollout rank
    dealt[order] = [int(order[t if t < tails else dealt_to(t, tails)]) for t in range(len(order))]
    end = cut_s.copy()
    runs = []
    on = dealt[rank]
    for tail in order[:tails].tolist():
        mine = np.flatnonzero(on == tail)
        if not len(mine):
            continue
        finish = cm.tail_times(cut_s[rank[mine]], np.asarray(remaining)[mine], np.asarray(context)[mine])
        end[tail] = max(end[tail], float(finish.max()))
        runs.append((tail, sorted(set(rank[mine].tolist())), float(cut_s[tail]), float(end[tail])))
    return end, runs
