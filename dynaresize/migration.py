"""Tail migration (`rollout.migration_threshold`): a rollout rank with that many sequences left or
fewer hands them to a tail rank and is free (to help the train step, with trainer.work_stealing).

The tail ranks of an iteration are the first `rollout.tail_ranks` rollout ranks to get down to
the threshold (their cut): each takes a ticket with an atomic add on a counter in the job's
TCPStore (comm.make_store) when it gets there. Tickets 0..T-1 are the tail ranks, which publish
their rank under their ticket; every later rank hands off to the tail rank of ticket
(ticket - T) mod T, dealt in turn, so a tail rank knows how many hand-offs to wait for
(`expected`). A tail rank continues its own last sequences first, then what the others send it,
as their messages arrive. Each later rank sends its tail rank exactly one message (over MPI,
without waiting for it to be received), empty if the rank had nothing left at its cut.

The engine hands a running group off with what it needs to continue it (rollout.base.Handoff):
the torch engine its whole state, so every token and log-probability is the one the source would
have produced; vLLM the tokens so far, re-prefilled by the tail. Which rank finishes a sample
depends on timing; what it generates does not.

The simulator and the dynamic policy price the same hand-offs (`tail_schedule`), with the cut of
each rank and the re-prefill of its last sequences priced by the cost model (CostModel.rollout_cuts).
No torch here.
"""
from __future__ import annotations

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


def priced_migration(rollout, cm) -> tuple[int, int] | None:
    """(threshold, tail ranks) of `rollout` (config.RolloutConfig) for IterationModel, when the cost
    model `cm` can price tail migration (continuous batching), else None."""
    if rollout.migration_threshold <= 0 or not cm.continuous:
        return None
    return rollout.migration_threshold, rollout.tail_ranks


def dealt_to(ticket: int, tails: int) -> int:
    """The tail ticket a later arrival (ticket >= tails) hands off to: dealt in turn."""
    return (ticket - tails) % tails


def tail_schedule(cut_s, finish_s, tail_ranks: int) -> tuple[np.ndarray, list[tuple[int, int, float, float]]]:
    """When each rollout rank is done with its rollout under tail migration, as the runtime runs it:
    rank r reaches its cut at `cut_s[r]` and its last sequences take `finish_s[r]` on a tail rank
    (0: none left). Tickets go in the order of the cuts (ties: the lower rank); a tail rank finishes
    its own last sequences, then each later arrival's in ticket order, each from when it arrives.
    Returns (each rank's end, the continuations as (tail rank, rank handing off, start, end))."""
    cut_s = np.asarray(cut_s, dtype=np.float64)
    finish_s = np.asarray(finish_s, dtype=np.float64)
    order = np.argsort(cut_s, kind="stable")
    tails = min(tail_ranks, len(order) - 1)
    end = cut_s.copy()
    continuations = []
    for ticket, rank in enumerate(order.tolist()):
        tail = rank if ticket < tails else int(order[dealt_to(ticket, tails)])
        if finish_s[rank] > 0:
            start = max(cut_s[rank], end[tail])
            end[tail] = start + finish_s[rank]
            continuations.append((tail, rank, float(start), float(end[tail])))
    return end, continuations
