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
depends on timing; what it generates does not. No torch here.
"""
from __future__ import annotations

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
        return int(self.store.get(f"{self.key}/tail/{(ticket - self.tails) % self.tails}"))

    def expected(self, ticket: int) -> int:
        """How many later arrivals hand off to the tail rank of `ticket`."""
        return len(range(self.tails + ticket, self.ranks, self.tails))
