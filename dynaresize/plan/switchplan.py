"""The switch plan: the operations that move a job from one role table to the next.

Pure (no torch, no MPI): the runtime executes the plan (resize.py), the simulator prices it with
the cost model (sim/core.py) and the dynamic policy its critical path (walk, critical_time), and
`dynaresize-analyze plan RUN ITERATION` prints it, so none of them can disagree on what a resize
does.

Moving from k to k' train ranks (train ranks are the block [0, k), so old and new train sets are
both prefixes of the ranks), in this order:

  every rank              commit (all acknowledge v'), group_switch (registry lookup)
  rank joining training   release engine (parked for its return) ----> weight_load (broadcast)
  old owners staying      stage_out ......... (background: overlaps the next stage)
  rank leaving training   stage_out (its memory goes to the engine) -> engine_start -> weight_load
  new owners              stage_in of their new range .... (background until the optimizer step)

The fully sharded trainer (`trainer.sharding=full`, FSDP2) binds its model to the train group,
so its switch is: the old train group saves its shards together (DCP), a rank leaving training
wakes its engine and reads the full weights from those files, and the new train group loads its
shards, resharded, before its first forward; all on the critical path. Across nodes the saved
files first go to the nodes that read them (a reshard of files, `file_routes`): each node of the
train block gets every file written on another node, from its writer, received by one of its
ranks in turn.

Across nodes (`staging.transport`: network, or auto when the train block [0, max(k, k')) spans
nodes) the ZeRO-1 trainer's reshard over the data plane replaces stage_out and stage_in: every
part of a new owner's range that another rank holds comes in one point-to-point message from it
(reshard_transfers), so a rank moves at most its old or its new range, never the whole state.
Only what the next stage needs in order to start is critical; optimizer state is needed at the
optimizer step, after the forward and backward passes, so staging overlaps them
(staging.critical=true, a benchmark baseline, puts it on the critical path). The commit comes
first: every rank acknowledges the new table version before any rank acts on it; the groups come
next because a reshard uses them.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import numpy as np

from .roles import RoleTable

STATE_BYTES_PER_PARAM = 3 * 4       # float32 master weights, exp_avg, exp_avg_sq
WEIGHT_BYTES_PER_PARAM = 4          # the float32 flat vector a weight load moves


@dataclass(frozen=True)
class Op:
    """One operation of a switch, run by `ranks` (in this order within the plan)."""
    name: str                        # one of timeline.schema.SWITCH_OPS
    ranks: tuple[int, ...]
    critical: bool                   # False: in the background, waited for where its result is needed
    nbytes: tuple[int, ...] = ()     # bytes each rank moves (priced sizes), one per rank; () none
    collective: bool = False         # the ranks run it together: it ends when the last one can
    price: dict = field(default_factory=dict)   # CostModel.switch_op_time arguments
    restored: tuple[bool, ...] = ()  # engine_start: per rank, whether its parked engine comes back

    def price_for(self, rank: int) -> dict:
        """The switch_op_time arguments of this op on `rank` (engine_start: restore or cold)."""
        if self.restored:
            return {**self.price, "restore": self.restored[self.ranks.index(rank)]}
        return self.price


@dataclass(frozen=True)
class SwitchPlan:
    old: RoleTable
    new: RoleTable
    transport: str                   # file (node-local staging) or network (reshard)
    ops: tuple[Op, ...]
    parked_after: frozenset[int]     # ranks holding a released engine after the switch

    def for_rank(self, rank: int) -> list[Op]:
        return [op for op in self.ops if rank in op.ranks]


def transport(setting: str, hosts: Sequence[str], block: int) -> str:
    """file when the ranks that exchange training state ([0, block)) share a node (and its
    scratch), network otherwise; `setting` (staging.transport) other than auto wins."""
    if setting != "auto":
        return setting
    return "file" if len(set(hosts[:block])) == 1 else "network"


def shard_bytes(numel: int, shards: int) -> int:
    """Bytes of one rank's staged optimizer range when `numel` parameters are cut in `shards`."""
    return STATE_BYTES_PER_PARAM * math.ceil(numel / max(shards, 1))


def plan(old: RoleTable, new: RoleTable, *, parked: frozenset[int], transport: str, numel: int,
         release_mode: str, staging_critical: bool = False, sharding: str = "optimizer",
         hosts: Sequence[str] = ()) -> SwitchPlan:
    """The operations that move `old` to `new` (see the module docstring). `parked`: ranks that
    hold a released engine (they left rollout earlier); `numel`: parameters of the priced model;
    `sharding`: trainer.sharding (full: FSDP2's reshard through files); `hosts`: each rank's node
    (where full sharding's files cross nodes)."""
    world, k, k2 = old.world, old.num_train, new.num_train
    K = max(k, k2)
    everyone = tuple(range(world))
    joining, leaving = tuple(range(k, k2)), tuple(range(k2, k))
    staying = tuple(range(min(k, k2)))
    weights = WEIGHT_BYTES_PER_PARAM * numel
    ops = [Op("commit", everyone, True, collective=True, price={"ranks": world}),
           Op("group_switch", everyone, True)]
    if joining:
        ops.append(Op("release", joining, True, price={"release_mode": release_mode}))
    # the fully sharded trainer (FSDP2) binds its model to its group: the old group saves its shards
    # together (across nodes the files then go where they are read) and the new one loads them
    # before its first forward, all critical
    fsdp_files = sharding == "full"
    if fsdp_files:
        out = shard_bytes(numel, k)
        ops.append(Op("stage_out", tuple(range(k)), True, (out,) * k, collective=True, price={"nbytes": out}))
        if transport == "network":
            moved, messages = file_routes_load(k, K, tuple(hosts), out)
            ops.append(Op("reshard", tuple(range(K)), True, moved, collective=True,
                          price={"nbytes": max(moved), "ranks": K, "messages": messages}))
    elif transport == "network":
        moved, messages = reshard_load(numel, k, k2)
        ops.append(Op("reshard", tuple(range(K)), True, moved, collective=True,
                      price={"nbytes": max(moved), "ranks": K, "messages": messages}))
    else:
        out = shard_bytes(numel, k)
        if staying:
            ops.append(Op("stage_out", staying, staging_critical, (out,) * len(staying), price={"nbytes": out}))
        if leaving:                      # leaving: spill now, its memory is the engine's
            ops.append(Op("stage_out", leaving, True, (out,) * len(leaving), price={"nbytes": out}))
    if leaving:                          # joining rollout: its parked engine or a new one, then its weights
        ops.append(Op("engine_start", leaving, True, price={"release_mode": release_mode},
                      restored=tuple(r in parked for r in leaving)))
        ops.append(Op("weight_load", leaving, True, (weights,) * len(leaving), price={"nbytes": weights}))
    if joining and not fsdp_files:       # the new train set gets train rank 0's weights
        new_train = tuple(range(k2))
        ops.append(Op("weight_load", new_train, True, (weights,) * k2, collective=True,
                      price={"nbytes": weights, "ranks": k2}))
    if transport != "network" or fsdp_files:    # new owners read their ranges (background; FSDP2: all, now)
        into = shard_bytes(numel, k2)
        ops.append(Op("stage_in", tuple(range(k2)), staging_critical or fsdp_files, (into,) * k2,
                      collective=fsdp_files, price={"nbytes": into}))
    return SwitchPlan(old, new, transport, tuple(ops), frozenset((set(parked) | set(joining)) - set(leaving)))


def walk(p: SwitchPlan, clock: np.ndarray, duration: Callable[[Op], float | np.ndarray]
         ) -> Iterator[tuple[Op, np.ndarray, np.ndarray, float | np.ndarray]]:
    """The plan's operations on the ranks' clocks (`clock`, seconds per rank, advanced in place),
    in order: (op, when each of its ranks starts it, when each ends it, its duration). A critical
    op starts at its ranks' clocks (a collective once the last of them is ready, and ends
    together) and lasts `duration(op)` (one figure, or one per rank of op.ranks); a background op
    starts at its ranks' clocks and leaves them alone. The simulator prices a switch this way and
    the policy its critical path (critical_time), so both time the operations the runtime runs."""
    for op in p.ops:
        ranks = np.array(op.ranks)
        start = clock[ranks].copy()
        dur = duration(op)
        end = np.full(len(ranks), start.max() + dur) if op.collective and op.critical else start + dur
        if op.critical:
            clock[ranks] = end
        yield op, start, end, dur


def op_time(op: Op, time_of: Callable[..., float]) -> float | np.ndarray:
    """What `op` lasts, priced by `time_of(name, **price)` (CostModel.switch_op_time): one figure,
    or for an engine_start one per rank (a parked engine's wake-up or a cold start)."""
    if not op.restored:
        return time_of(op.name, **op.price)
    return np.array([time_of(op.name, **op.price_for(r)) for r in op.ranks])


def critical_time(p: SwitchPlan, time_of: Callable[..., float]) -> float:
    """How long the plan holds up its slowest rank, each operation priced by `time_of` (op_time);
    background operations taken as hidden."""
    clock = np.zeros(p.old.world)
    for _ in walk(p, clock, lambda op: op_time(op, time_of)):
        pass
    return float(clock.max())


def shard_range(numel: int, shards: int, index: int) -> tuple[int, int]:
    """The contiguous [lo, hi) range of shard `index` out of `shards` (equal sizes, last shorter)."""
    size = -(-numel // shards)
    lo = min(index * size, numel)
    return lo, min(lo + size, numel)


def sources(numel: int, k: int, k2: int, rank: int) -> range:
    """The old owners (of k shards) whose ranges overlap `rank`'s new range (of k2): the stage_outs
    its stage_in waits for."""
    size_old = -(-numel // k)
    lo, hi = shard_range(numel, k2, rank)
    if hi <= lo:
        return range(0)
    return range(lo // size_old, min((hi - 1) // size_old, k - 1) + 1)


def reshard_transfers(numel: int, k: int, k2: int) -> list[tuple[int, int, int, int]]:
    """The network reshard's messages from k to k2 owners: (old owner, new owner, lo, hi) for every
    part [lo, hi) of a new owner's range that another rank holds, by new owner, then old owner.
    What a rank holds of its own new range stays where it is."""
    moves = []
    for r in range(k2):
        lo, hi = shard_range(numel, k2, r)
        for q in sources(numel, k, k2, r):
            q_lo, q_hi = shard_range(numel, k, q)
            a, b = max(lo, q_lo), min(hi, q_hi)
            if a < b and q != r:
                moves.append((q, r, a, b))
    return moves


def file_routes(k: int, block: int, hosts: Sequence[str]) -> list[tuple[int, int]]:
    """Full sharding across nodes: the files of the old train group's save (one per writer, old
    train rank 0..k-1, written on its node; DCP's metadata with writer 0's) that go to another
    node, as (writer, receiving rank): every node of the train block [0, block) gets each file
    written elsewhere, received by its ranks in turn (the node's ranks share its staging folder,
    and each new owner and each rank leaving training reads there)."""
    if len(hosts) < block:
        raise ValueError(f"the nodes of ranks 0..{block - 1} are needed to route files across nodes")
    nodes: dict[str, list[int]] = {}
    for r in range(block):
        nodes.setdefault(hosts[r], []).append(r)
    routes = []
    for node, ranks in nodes.items():
        elsewhere = [w for w in range(k) if hosts[w] != node]
        routes += [(w, ranks[i % len(ranks)]) for i, w in enumerate(elsewhere)]
    return routes


@functools.lru_cache(maxsize=4096)
def file_routes_load(k: int, block: int, hosts: tuple[str, ...], file_bytes: int) -> tuple[tuple[int, ...], int]:
    """As reshard_load, for file_routes: the bytes each rank of the block sends or receives (each
    file `file_bytes`), whichever is more, and the most routes one rank takes part in."""
    sent, received, messages = [0] * block, [0] * block, [0] * block
    for w, r in file_routes(k, block, hosts):
        sent[w] += file_bytes
        received[r] += file_bytes
        messages[w] += 1
        messages[r] += 1
    return tuple(max(s, v) for s, v in zip(sent, received)), max(messages, default=0)


@functools.lru_cache(maxsize=4096)          # the dynamic policy prices the same switches again and again
def reshard_load(numel: int, k: int, k2: int) -> tuple[tuple[int, ...], int]:
    """(the bytes each rank of [0, max(k, k2)) sends or receives in the network reshard, whichever
    is more (a rank's link carries both ways at once), the most messages one rank takes part in)."""
    K = max(k, k2)
    sent, received, messages = [0] * K, [0] * K, [0] * K
    for q, r, lo, hi in reshard_transfers(numel, k, k2):
        sent[q] += STATE_BYTES_PER_PARAM * (hi - lo)
        received[r] += STATE_BYTES_PER_PARAM * (hi - lo)
        messages[q] += 1
        messages[r] += 1
    return tuple(max(s, v) for s, v in zip(sent, received)), max(messages, default=0)


def format_plan(p: SwitchPlan) -> str:
    """The plan as a table, one line per operation."""
    lines = [f"switch v{p.old.version} {p.old.describe()} -> v{p.new.version} {p.new.describe()} "
             f"({p.transport} transport)",
             f"{'#':>2}  {'operation':<13}{'ranks':<16}{'path':<11}{'bytes per rank':>15}  notes"]
    for i, op in enumerate(p.ops):
        ranks = f"{op.ranks[0]}" if len(op.ranks) == 1 else f"{op.ranks[0]}-{op.ranks[-1]} ({len(op.ranks)})"
        size = f"{max(op.nbytes):,}" if op.nbytes else "-"
        notes = []
        if op.collective:
            notes.append("collective")
        if op.restored:
            notes.append(f"{sum(op.restored)} restored, {len(op.restored) - sum(op.restored)} cold")
        lines.append(f"{i:>2}  {op.name:<13}{ranks:<16}{'critical' if op.critical else 'background':<11}"
                     f"{size:>15}  {', '.join(notes)}")
    return "\n".join(lines)
