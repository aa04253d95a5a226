"""Work stealing (`trainer.work_stealing`): a rank with nothing left to generate computes the
gradients of micro-batches that the train ranks have not taken yet.

The micro-batches of one train step form a queue in a fixed order, the longest first
(`queue_order`: each worker takes the next when it is free, so the last to be taken are the
shortest and the workers end close together). Every worker, the train ranks from the start of
the step and a rollout rank once it has generated its share, takes the next one with an atomic
add on a counter in a TCPStore (comm.make_store) and writes itself down as its owner: a claim
never waits for another rank. A helper joins only if the micro-batches not yet claimed are worth
what it costs (`worth_joining`, priced by the cost model). Once the queue is empty, a helper that
took any sends each train rank its range (the optimizer shard's) of its gradient sum; each train
rank reads the owners, adds the helpers' slices to its own sum and joins the train group's
all-reduce. A train rank receives 1/k of each helper's vector, not the whole of it.

What is computed does not change: the set of micro-batches and each one's gradient are those of a
run without stealing, and with float64 gradient sums (trainer.grad_reduce_dtype, the default) the
sum does not depend on who added what (the final weights are bit-identical in the tests). Helpers
compute with a float32 copy of the weights the step starts from; optimizer state stays with the
train ranks. An engine that holds the GPU's memory (vLLM) sleeps while its rank helps and wakes
after, both priced (CostModel.helper_engine_times) and part of the cost of joining.

The simulator and the dynamic policy price the same claims and the same decision to join with
`claim_schedule`. No torch here: the simulator imports this module.
"""
from __future__ import annotations

import heapq

import numpy as np

from .sorting import stable_argsort_descending


def queue_order(tokens) -> np.ndarray:
    """The micro-batches (indices into `tokens`, their token counts) in the queue's order: most
    tokens first, ties by index."""
    return stable_argsort_descending(np.asarray(tokens, dtype=np.float64))


class MicroBatchQueue:
    """The claims on the micro-batches of train step `step` (`tokens`: each one's, in index
    order), as rank `rank` makes them; the queue runs in `queue_order`."""

    def __init__(self, store, step: int, tokens, rank: int):
        # Keys are never deleted: a late claimant still adds to `next` after the queue is empty, and
        # a deleted counter would start again at 0. A step leaves size + 2 short keys in the store.
        self.store, self.key, self.rank = store, f"steal/{step}", rank
        self.tokens = np.asarray(tokens, dtype=np.float64)
        self.order = queue_order(self.tokens)
        self.size = len(self.order)

    def claim(self) -> int | None:
        """The next micro-batch (its index) for this rank, or None when every one is taken."""
        i = self.store.add(f"{self.key}/next", 1) - 1
        if i >= self.size:
            return None
        self.store.set(f"{self.key}/owner/{i}", str(self.rank))
        return int(self.order[i])

    def join(self, prices, train_ranks: int, join_s: float) -> bool:
        """A helper's decision to take part (`worth_joining`, on the micro-batches not claimed yet,
        each priced `prices[index]`, and the train ranks plus the helpers already in); counted if
        it does."""
        taken = int(self.store.add(f"{self.key}/next", 0))
        joined = int(self.store.add(f"{self.key}/joined", 0))
        left = float(np.asarray(prices, dtype=np.float64)[self.order[taken:]].sum())
        if taken >= self.size or not worth_joining(left, train_ranks + joined, join_s):
            return False
        self.store.add(f"{self.key}/joined", 1)
        return True

    def __iter__(self):
        """This rank's claims, one at a time, until the queue is empty."""
        return iter(self.claim, None)

    def owners(self) -> list[int]:
        """The rank that took each micro-batch (waits until every claim is written down: a claim is
        written right after it is made, so this waits for no computation)."""
        keys = [f"{self.key}/owner/{i}" for i in range(self.size)]
        self.store.wait(keys)
        return [int(v) for v in self.store.multi_get(keys)]

    def helpers(self, train_ranks) -> list[int]:
        """The ranks outside `train_ranks` that took micro-batches, in rank order."""
        return sorted(set(self.owners()) - set(train_ranks))


def worth_joining(left_s: float, workers: int, join_s: float) -> bool:
    """Whether a helper joins a train step whose unclaimed micro-batches take `left_s` seconds of
    compute, with `workers` already taking them: one more worker shortens the step by about
    left_s / (workers (workers + 1)), and its gradient sum costs `join_s` to send before the
    all-reduce (CostModel.helper_sums_time of one helper)."""
    return left_s / (workers * (workers + 1)) > join_s


def claim_schedule(durations, ready, helpers_from: int | None = None, join_s: float = 0.0,
                   delay_s: float = 0.0) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The claims of a queue of micro-batches lasting `durations` (in queue order) by workers free
    from `ready[w]`, when the worker free first takes the next one (ties: the lower worker).
    Workers from `helpers_from` on are helpers: each decides once, when it is first free, whether
    to join (`worth_joining` with its cost `join_s`, as MicroBatchQueue.join), and one that joins
    takes its first micro-batch `delay_s` later (its engine releases the GPU's memory). Returns
    (the worker of each micro-batch, its start, each worker's end: the end of its last
    micro-batch, or its ready time if none; the helpers that joined)."""
    dur = np.asarray(durations, dtype=np.float64)
    ready = np.asarray(ready, dtype=np.float64)
    k = len(ready) if helpers_from is None else helpers_from
    # the train ranks alone: every claim until a helper is free is theirs
    owner, start, end = _claims_without_helpers(dur, ready[:k])
    if k >= len(ready):
        return owner, start, end, np.array([], dtype=np.int64)
    # the first claim a helper can take: one starting after it is free (a tie goes to the lower
    # worker, a train rank); claims start in time order
    cut = int(np.searchsorted(start, ready[k:].min(), side="right"))
    if cut == len(dur):
        return owner, start, np.concatenate((end, ready[k:])), np.array([], dtype=np.int64)
    free = ready.copy()
    np.maximum.at(free, owner[:cut], start[:cut] + dur[:cut])
    left = np.concatenate((np.cumsum(dur[::-1])[::-1], [0.0])).tolist()   # unclaimed compute from i on
    heap = [(t, w) for w, t in enumerate(free.tolist())]
    heapq.heapify(heap)
    owner, start, end = owner[:cut].tolist(), start[:cut].tolist(), free.tolist()
    joined, decided = [], set()
    pop, push = heapq.heappop, heapq.heappush       # plain lists and floats: this runs per prediction
    helpers = len(ready) - k
    for i, d in enumerate(dur[cut:].tolist(), start=cut):
        if len(decided) == helpers:                 # every helper in or out: the rest without helpers
            workers, free = zip(*sorted((w, t) for t, w in heap))
            free = np.array(free)
            rest_owner, rest_start, rest_end = _claims_without_helpers(dur[i:], free)
            owner += [workers[w] for w in rest_owner.tolist()]
            start += rest_start.tolist()
            for w in set(rest_owner.tolist()):       # (a helper that never claims ends when it was free)
                end[workers[w]] = float(rest_end[w])
            break
        while True:
            t, w = pop(heap)
            if w < k or w in decided:
                break
            decided.add(w)
            if worth_joining(left[i], k + len(joined), join_s):
                joined.append(w)
                if delay_s <= 0:
                    break
                push(heap, (t + delay_s, w))        # free to compute once its engine has slept
            # a helper that does not join stays out of this step
        owner.append(w)
        start.append(t)
        end[w] = t + d
        push(heap, (t + d, w))
    return (np.array(owner, dtype=np.int64), np.array(start, dtype=np.float64), np.array(end),
            np.array(sorted(joined), dtype=np.int64))


# Workers from which claims without helpers are taken in rounds (a numpy sort a round) rather than
# one at a time from a heap: measured on 3,395 long-tailed micro-batches, 1.2 ms (heap) against
# 1.9 ms (rounds) at 16 workers, about even at 32, 1.6 ms against 0.4 ms at 128.
ROUNDS_FROM = 32


def _claims_without_helpers(dur: np.ndarray, ready: np.ndarray):
    """(owner, start, end) of claim_schedule without helpers: in rounds where that is faster and
    the durations are in the queue's order, else one claim at a time."""
    if len(ready) >= ROUNDS_FROM and bool(np.all(dur[1:] <= dur[:-1])):
        return _claims_in_rounds(dur, ready)
    return _claims(dur, ready)


def _claims(dur: np.ndarray, ready: np.ndarray):
    """claim_schedule without helpers, one claim at a time: the heap of (free time, worker)."""
    heap = [(t, w) for w, t in enumerate(ready.tolist())]
    heapq.heapify(heap)
    owner, start, end = [], [], ready.tolist()
    replace = heapq.heapreplace
    for d in dur.tolist():
        t, w = heap[0]
        owner.append(w)
        start.append(t)
        end[w] = t + d
        replace(heap, (t + d, w))
    return np.array(owner, dtype=np.int64), np.array(start, dtype=np.float64), np.array(end)


def _claims_in_rounds(dur: np.ndarray, ready: np.ndarray):
    """The same claims as `_claims` for durations that never grow along the queue (its order:
    longest first), in rounds: with the workers sorted by free time (ties: the lower worker), the
    first m take the next m micro-batches, one each, as long as the m-th free time is below the
    first plus the m-th duration. Then no worker freed in the round is free before the next one
    in the order: durations fall along the queue, so every new free time is at least the first
    plus the m-th duration."""
    free = ready.copy()
    n, k = len(dur), len(free)
    owner, start = np.empty(n, dtype=np.int64), np.empty(n)
    i = 0
    while i < n:
        order = np.argsort(free, kind="stable")
        t, d = free[order[:n - i]], dur[i:i + k]
        # t rises and t[0] + d falls along the order: the workers before are a prefix
        m = max(int(np.count_nonzero(t < t[0] + d)), 1)
        owner[i:i + m], start[i:i + m] = order[:m], t[:m]
        free[order[:m]] = t[:m] + d[:m]
        i += m
    return owner, start, free
