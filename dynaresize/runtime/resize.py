"""The switch, executed: each operation of the plan (dynaresize.plan.switchplan) that involves this
rank, in the plan's order, timed on the timeline as critical or background.

With the fully sharded trainer (`trainer.sharding=full`) stage_out and stage_in save and load the
train groups' shards through torch.distributed.checkpoint (fsdp.py), and a rank leaving training
reads its engine's weights from those files (switchplan.plan says why all of it is critical).

A background operation runs in a thread and is waited for where its result is needed (the staged
optimizer range at the optimizer step); only the part the main thread waited for is recorded as
critical. A rank that fails anywhere in the switch aborts the whole job (see worker.py), so two
table versions are never live.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch
import torch.distributed as dist

from ..plan import switchplan
from ..plan.policy import Decision
from ..plan.roles import RoleTable
from .fsdp import load_full_weights
from .dcp_h5 import METADATA
from .staging import STATE_FIELDS, make_private_dir, read_shard, shard_path, write_shard
from ..plan.switchplan import shard_range
from ..timeline.schema import BACKGROUND, CRITICAL
from .types import ShardState

if TYPE_CHECKING:
    from .rollout.base import RolloutEngine
    from .fsdp import FullyShardedTrainer
    from .trainer import ShardedTrainer

# Fault injection for tests: "RANK:OPERATION" makes that rank die (SIGKILL) when it starts that op.
FAULT_ENV = "DYNARESIZE_INJECT_FAULT"


@dataclass
class RankState:
    """What one rank holds between iterations. Set at start-up; afterwards only a switch changes
    it (`resize.switch` takes the state and the plan and returns the next state)."""
    table: RoleTable                          # the role table this rank runs under
    engine: Optional["RolloutEngine"]         # generating (the table says it generates)
    trainer: Optional["ShardedTrainer | FullyShardedTrainer"]   # training: its shard of the state
    parked_engine: Optional["RolloutEngine"] = None   # released by a switch, kept for a return to rollout
    parked_ranks: frozenset = frozenset()     # every rank holding a parked engine, as the switch plans see them


class SwitchError(RuntimeError):
    pass


class OpTimer:
    """Runs, times and records the operations of one switch on one rank."""

    def __init__(self, job, it: int, old: RoleTable, new: RoleTable):
        self.job, self.it, self.old, self.new = job, it, old, new
        self.label = f"iteration {it}, table v{old.version} {old.describe()} -> v{new.version} {new.describe()}"

    @contextlib.contextmanager
    def op(self, name: str, critical: bool = True, price: dict | None = None, **attrs):
        """Run and record operation `name`. `price`: its CostModel.switch_op_time arguments, so that
        in run.mode=emulate it lasts what the profile's hardware would take (Job.emulate)."""
        job = self.job
        job.set_status(f"switch operation {name!r} ({self.label})")
        inject_fault(job.rank, name)
        role = self.new.role_of(job.rank).value
        try:
            with job.rec.span(self.it, name, role, CRITICAL if critical else BACKGROUND, **attrs) as ev:
                yield ev
                if job.cost is not None:
                    job.emulate(ev, job.cost.switch_op_time(name, **(price or {})))
        except Exception as e:
            raise SwitchError(f"rank {job.rank}: switch operation {name!r} failed ({self.label}): "
                              f"{type(e).__name__}: {e}") from e

    def background(self, name: str, fn, critical: bool = False, price: dict | None = None) -> "BackgroundOp | Done":
        """Run `fn() -> (result, bytes moved)` in the background; `.wait()` gives the result."""
        if critical:                      # baseline: run it now, on the critical path
            with self.op(name, price=price) as ev:
                result, ev["bytes"] = fn()
            return Done(result)
        cost = self.job.cost
        if cost is not None:              # emulate: the thread lasts the priced time
            priced, run = cost.switch_op_time(name, **(price or {})), fn

            def fn(run=run, priced=priced, clock=self.job.ctrl.now):
                start = clock()
                out = run()
                time.sleep(max(priced - (clock() - start), 0.0))
                return out
        self.job.set_status(f"switch operation {name!r} ({self.label}, background)")
        inject_fault(self.job.rank, name)
        op = BackgroundOp(self, name, fn)
        self.job.background_ops.append(op)
        return op


class Done:
    def __init__(self, result):
        self.result = result

    def wait(self):
        return self.result


class BackgroundOp:
    """An operation in a thread. Its time is background, except the part the main thread waits for,
    which is recorded as critical: the hidden share counts only what was really hidden."""

    def __init__(self, timer: OpTimer, name: str, fn):
        self.timer, self.name, self.fn = timer, name, fn
        self.clock = timer.job.ctrl.now
        self.start = self.clock()
        self.end = None
        self._result, self._nbytes, self._error, self._recorded = None, 0, None, False
        self.thread = threading.Thread(target=self._run, name=f"dynaresize-{name}", daemon=True)
        self.thread.start()

    def _run(self):
        try:
            self._result, self._nbytes = self.fn()
        except BaseException as e:  # noqa: BLE001 - re-raised in the main thread by wait()
            self._error = e
        finally:
            self.end = self.clock()

    def wait(self):
        waited_from = self.clock()
        self.thread.join()
        if not self._recorded:
            self._recorded = True
            self._record(waited_from)
        if self._error is not None:
            raise SwitchError(f"rank {self.timer.job.rank}: switch operation {self.name!r} failed "
                              f"({self.timer.label}): {type(self._error).__name__}: {self._error}") from self._error
        return self._result

    def _record(self, waited_from: float) -> None:
        job, timer = self.timer.job, self.timer
        role = timer.new.role_of(job.rank).value
        nbytes = self._nbytes
        split = min(max(waited_from, self.start), self.end)
        base = {"iteration": timer.it, "rank": job.rank, "role": role, "name": self.name, "tokens": 0}
        job.rec.add({**base, "start": self.start, "end": split, "critical": BACKGROUND, "bytes": nbytes,
                     "attrs": {}})
        if self.end > split:               # the main thread had to wait: that part was not hidden
            job.rec.add({**base, "start": split, "end": self.end, "critical": CRITICAL, "bytes": 0,
                         "attrs": {"waited": True}})


def inject_fault(rank: int, op: str) -> None:
    spec = os.environ.get(FAULT_ENV, "")
    if spec and spec == f"{rank}:{op}":
        os.kill(os.getpid(), signal.SIGKILL)


def switch(job, it: int, decision: Decision, registry=None, staging=None) -> RankState:
    """Move from the current table to one with `decision.to_train` train ranks: run this rank's
    operations of the switch plan; the rank's new state. `registry` (groups.GroupRegistry) and
    `staging` (config.StagingConfig) default to the job's; the switch benchmark passes its variants."""
    registry = registry or job.registry
    staging = staging or job.cfg.staging
    old = job.state.table
    new = old.with_split(decision.to_train)
    sp = switchplan.plan(old, new, parked=job.state.parked_ranks,
                         transport=switchplan.transport(staging.transport, job.ctrl.hostnames,
                                                        max(old.num_train, new.num_train)),
                         numel=job.priced_numel,
                         release_mode=job.cfg.rollout.release, staging_critical=staging.critical,
                         sharding=job.cfg.trainer.sharding, hosts=job.ctrl.hostnames)
    run = SwitchRun(job, OpTimer(job, it, old, new), sp, registry, staging)
    for op in sp.for_rank(job.rank):
        getattr(run, op.name)(op)
    return run.finish()


class SwitchRun:
    """One rank's part of a switch: a method per operation name, called in the plan's order. It
    changes a copy of the rank's state (`self.state`), returned by finish(); `job` gives the
    job's services (control plane, model, staging directory, the timeline); `registry` the groups
    and `staging` the staging settings this switch uses."""

    def __init__(self, job, timer: OpTimer, sp: switchplan.SwitchPlan, registry, staging):
        self.job, self.timer, self.sp = job, timer, sp
        self.registry, self.staging = registry, staging
        self.state = dataclasses.replace(job.state)
        self.k, self.k2, self.r = sp.old.num_train, sp.new.num_train, job.rank
        self.was_train, self.will_train = sp.old.trains(self.r), sp.new.trains(self.r)
        # trainer.sharding=full: the trainers of both groups exchange their state through this folder
        self.sharded = job.cfg.trainer.sharding == "full"
        self.folder = os.path.join(job.staging_dir, f"train-v{sp.new.version}")
        self.shard = self.state.trainer.export_shard() if self.was_train and not self.sharded else None
        self.new_shard = None            # this rank's new range, when resharded over the network
        self.save_seen = False           # sharded: this rank joining training passed the savers' barrier
        self.pending = None              # ... or being staged in

    def commit(self, op) -> None:        # every rank acknowledges v' before anyone acts
        job = self.job
        with self.timer.op(op.name, price=op.price):
            versions = job.ctrl.allgather(self.sp.new.version)
            if len(set(versions)) != 1:
                raise SwitchError(f"ranks disagree on the new table version: {versions}")

    def group_switch(self, op) -> None:  # every rank, before any group of the new split is used
        with self.timer.op(op.name, reuse=self.registry.reuse):
            self.registry.ensure(self.k2)  # a lookup; a collective creation only without reuse

    def release(self, op) -> None:       # joining training: the engine's memory goes first
        state = self.state
        with self.timer.op(op.name, price=op.price, mode=self.job.cfg.rollout.release):
            state.engine.release()       # parked: sleep mode keeps it for a cheap return
            state.parked_engine, state.engine = state.engine, None

    def reshard(self, op) -> None:       # across nodes: ranges (FSDP2: saved files) move over the data plane
        job = self.job
        block = train_block(self.registry, max(self.k, self.k2), job.world)
        with self.timer.op(op.name, price=op.price) as ev:
            if self.sharded:
                if not self.was_train:   # the save is complete once the block agrees (the savers' barrier)
                    dist.barrier(group=block)
                    self.save_seen = True
                routes = switchplan.file_routes(self.k, max(self.k, self.k2), job.ctrl.hostnames)
                ev["bytes"] = ship_files(job, block, self.folder, routes, self.staging.buffer_mb)
                return
            self.new_shard = reshard_over_network(job, self.registry, self.shard, self.k, self.k2,
                                                  job.layout.numel)
            ev["bytes"] = switchplan.reshard_load(job.layout.numel, self.k, self.k2)[0][self.r]

    def stage_out(self, op) -> None:
        if self.sharded:
            return self._save_sharded(op)
        job, staging = self.job, self.staging
        path = shard_path(job.staging_dir, self.sp.new.version, self.r)
        price = op.price_for(self.r)

        def write(shard=self.shard, path=path):
            hold = job.emulated_until(job.ctrl.now(), op.name, price) if job.cost else None
            return None, write_shard(path, shard, self.sp.new.version, staging.buffer_mb, job.run_id, staging.fsync, hold)

        if self.will_train:
            self.timer.background(op.name, write, critical=op.critical, price=price)
        else:                            # leaving: spill now, its memory is the engine's
            with self.timer.op(op.name, price=price) as ev:
                ev["bytes"] = write()[1]
        job.staged_files.append(path)

    def engine_start(self, op) -> None:  # joining rollout: its parked engine or a new one
        state = self.state
        restored = state.parked_engine is not None
        with self.timer.op(op.name, price=op.price_for(self.r), restored=restored):
            if restored:
                state.engine, state.parked_engine = state.parked_engine, None
                state.engine.restore()
            else:
                state.engine = self.job.new_engine()

    def weight_load(self, op) -> None:
        job, state = self.job, self.state
        with self.timer.op(op.name, price=op.price) as ev:
            if self.sharded:             # leaving training: the full weights, from the saved shards
                flat, ev["bytes"] = load_full_weights(self.folder, job.run_id, job.layout, job.device)
                state.engine.load_weights(job.layout.views(flat))
                return
            if not op.collective:        # leaving training: its own weights into its engine
                state.engine.load_weights(job.layout.views(state.trainer.flat))
            else:                        # the new train set gets train rank 0's weights
                if state.trainer is None:
                    state.trainer = job.new_trainer()
                dist.broadcast(state.trainer.flat, src=0, group=self.registry.get("train", self.k2))
            ev["bytes"] = job.layout.numel * 4

    def stage_in(self, op) -> None:      # this rank's new range, from the files of its old owners
        if self.sharded:
            return self._load_sharded(op)
        job = self.job
        numel, version, k = job.layout.numel, self.sp.new.version, self.k
        lo, hi = shard_range(numel, self.k2, self.sp.new.train_ranks().index(self.r))
        price = op.price_for(self.r)

        def read(lo=lo, hi=hi):
            holds = []                   # emulation: the read lasts its price from when its files exist
            ready = (lambda: holds.append(job.emulated_until(job.ctrl.now(), op.name, price))) if job.cost else None
            shard = read_shard(job.staging_dir, version, k, numel, lo, hi, shard_range, job.run_id, ready)
            for hold in holds:
                hold()
            return shard, 3 * (hi - lo) * 4

        self.pending = self.timer.background(op.name, read, critical=op.critical)

    def _save_sharded(self, op) -> None:
        """sharding=full: the old train group saves its shards (DCP, collective); then every rank
        of the train block [0, max(k, k')) agrees that the save is complete before reading it."""
        job = self.job
        with self.timer.op(op.name, price=op.price) as ev:
            ev["bytes"] = self.state.trainer.save(self.folder, job.run_id, self.staging.buffer_mb)
            dist.barrier(group=train_block(self.registry, max(self.k, self.k2), job.world))
        self.state.trainer = None        # its state is in the files; the new group's trainers load it
        job.staged_files.append(self.folder)

    def _load_sharded(self, op) -> None:
        """sharding=full: a trainer of the new group, its shards loaded from the old group's files
        (DCP computes which saved rows fill them)."""
        job = self.job
        with self.timer.op(op.name, price=op.price) as ev:
            if not self.was_train and not self.save_seen:    # joining: the save is complete once the block agrees
                dist.barrier(group=train_block(self.registry, max(self.k, self.k2), job.world))
            trainer = job.new_sharded_trainer(self.registry.get("train", self.k2), self.sp.new.train_ranks(),
                                              empty=True)
            ev["bytes"] = trainer.load(self.folder, job.run_id)
        self.state.trainer = trainer

    def finish(self) -> RankState:
        """The rank's new state: its trainer joins the new train group (its range still arriving,
        maybe), or it is gone; the groups of the old split go (without reuse); the new table."""
        job, state = self.job, self.state
        if self.was_train and not self.will_train:
            state.trainer = None
        if self.will_train and not self.sharded:
            pending = self.pending if self.pending is not None else Done(self.new_shard)
            state.trainer.join(self.registry.get("train", self.k2), self.sp.new.train_ranks(), self.r, pending=pending)
        self.registry.release_unreused(self.k)
        state.table, state.parked_ranks = self.sp.new, self.sp.parked_after
        job.set_status(f"running ({self.sp.new.describe()})")
        return state


def reshard_over_network(job, registry, shard: ShardState | None, k: int, k2: int, numel: int) -> ShardState | None:
    """Move ranges between old and new owners over the data plane (ranks on different nodes).

    Point to point (switchplan.reshard_transfers): each part of a new owner's range that another
    rank holds comes in one message from that rank, all messages at once; what a rank holds of its
    own new range stays. So a rank sends at most its old range and receives at most its new one.
    Each message carries the AdamW step after the three fields (a joining rank has none of its
    own). Critical: it runs on the main thread, in the train group [0, max(k, k')); every rank of
    it sends or receives (old and new ranges differ), as NCCL asks of a group's first batched call.
    """
    r = job.rank
    group = train_block(registry, max(k, k2), job.world)
    lo, hi = shard_range(numel, k2, r) if r < k2 else (0, 0)
    parts = {name: torch.zeros(hi - lo, device=job.device) for name in STATE_FIELDS}
    step = shard.step if shard is not None else None
    if shard is not None and r < k2:                 # its own part of the new range stays
        a, b = max(lo, shard.lo), min(hi, shard.hi)
        for name in STATE_FIELDS:
            parts[name][a - lo:b - lo] = getattr(shard, name).detach().reshape(-1)[a - shard.lo:b - shard.lo]
    ops, received = [], []
    for q, dst, a, b in switchplan.reshard_transfers(numel, k, k2):
        if q == r:
            fields = [getattr(shard, name).detach().reshape(-1)[a - shard.lo:b - shard.lo] for name in STATE_FIELDS]
            buf = torch.cat(fields + [torch.tensor([float(shard.step)], device=job.device)])
            ops.append(dist.P2POp(dist.isend, buf, dst, group))
        elif dst == r:
            buf = torch.empty(3 * (b - a) + 1, device=job.device)
            ops.append(dist.P2POp(dist.irecv, buf, q, group))
            received.append((buf, a, b))
    if ops:
        for request in dist.batch_isend_irecv(ops):
            request.wait()
    for buf, a, b in received:
        n = b - a
        for i, name in enumerate(STATE_FIELDS):
            parts[name][a - lo:b - lo] = buf[i * n:(i + 1) * n]
        step = int(buf[-1].item())
    if r >= k2:
        return None
    return ShardState(lo, hi, parts["params"], parts["exp_avg"], parts["exp_avg_sq"], step)


def ship_files(job, group, folder: str, routes: list[tuple[int, int]], chunk_mb: int) -> int:
    """Full sharding across nodes: each route's files (switchplan.file_routes: its writer's
    `shard-W.h5`, with writer 0's DCP's metadata) from the writer to the receiving rank over the
    data plane, all routes at once, in rounds of one chunk of `chunk_mb` per route; the receiver
    writes them into its node's `folder` (private) under temporary names, renamed when complete,
    the metadata last. Ends with a barrier of `group`; returns the bytes this rank sent and
    received. A writer's file and DCP's checksums travel as they are: the load checks them."""
    r, device, chunk = job.rank, job.device, max(chunk_mb, 1) << 20

    def names(w: int) -> list[str]:
        return [f"shard-{w:05d}.h5"] + ([METADATA] if w == 0 else [])

    def exchange(ops) -> None:
        if ops:
            for request in [op(tensor, peer, group) for op, tensor, peer in ops]:
                request.wait()

    sends = [d for w, d in routes if w == r]
    recvs = [w for w, d in routes if d == r]
    if recvs:
        make_private_dir(folder)
    sizes = {w: torch.zeros(len(names(w)), dtype=torch.int64, device=device) for w in recvs}
    mine = torch.tensor([os.path.getsize(os.path.join(folder, n)) for n in names(r)] if sends else [],
                        dtype=torch.int64, device=device)
    exchange([(dist.isend, mine, d) for d in sends] + [(dist.irecv, sizes[w], w) for w in recvs])
    total_out = int(mine.sum()) if sends else 0
    outgoing = _read_chunks([os.path.join(folder, n) for n in names(r)] if sends else [], chunk)
    incoming = {w: _Files(folder, names(w), sizes[w].tolist()) for w in recvs}
    rounds = max([-(-total_out // chunk)] + [-(-incoming[w].total // chunk) for w in recvs])
    for c in range(rounds):
        ops, buffers = [], {}
        if c * chunk < total_out:
            piece = torch.frombuffer(bytearray(next(outgoing)), dtype=torch.uint8).to(device)
            ops += [(dist.isend, piece, d) for d in sends]
        for w in recvs:
            left = incoming[w].total - c * chunk
            if left > 0:
                buffers[w] = torch.empty(min(left, chunk), dtype=torch.uint8, device=device)
                ops.append((dist.irecv, buffers[w], w))
        exchange(ops)
        for w, buf in buffers.items():
            incoming[w].write(buf.cpu().numpy().tobytes())
    for w in sorted(recvs, reverse=True):        # writer 0's last: its metadata makes the folder loadable
        incoming[w].publish()
    dist.barrier(group=group)
    return total_out * len(sends) + sum(files.total for files in incoming.values())


def _read_chunks(paths: list[str], chunk: int):
    """The bytes of the files `paths`, one after the other, in pieces of `chunk` (the last shorter)."""
    piece = b""
    for path in paths:
        with open(path, "rb") as f:
            while data := f.read(chunk - len(piece)):
                piece += data
                if len(piece) == chunk:
                    yield piece
                    piece = b""
    if piece:
        yield piece


class _Files:
    """Files `names` of `sizes` bytes in `folder`, received as one stream: written under temporary
    names (mode 0600) as the bytes come, renamed into place by publish()."""

    def __init__(self, folder: str, names: list[str], sizes: list[int]):
        self.paths, self.sizes, self.total = [os.path.join(folder, n) for n in names], sizes, sum(sizes)
        self.tmps = [f"{p}.tmp-{os.getpid()}" for p in self.paths]
        self.index, self.written = 0, 0
        for tmp in self.tmps:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600))

    def write(self, data: bytes) -> None:
        while data:
            room = self.sizes[self.index] - self.written
            with open(self.tmps[self.index], "ab") as f:
                f.write(data[:room])
            data, self.written = data[room:], self.written + min(room, len(data))
            if self.written == self.sizes[self.index] and self.index + 1 < len(self.sizes):
                self.index, self.written = self.index + 1, 0

    def publish(self) -> None:
        for tmp, path in zip(self.tmps, self.paths):     # the metadata, listed last, last
            os.replace(tmp, path)


def train_block(registry, ranks: int, world: int):
    """The group of ranks [0, ranks): the train group of that split, or every rank."""
    return registry.get("train", ranks) if ranks < world else dist.group.WORLD


def colocated_release(job, it: int) -> None:
    """Colocated: every rank frees its engine before training (a switch every iteration)."""
    timer = OpTimer(job, it, job.table, job.table)
    with timer.op("release", price={"release_mode": job.cfg.rollout.release}):
        job.engine.release()


def colocated_restore(job, it: int) -> None:
    """Colocated: restore the engine after training and load the new weights (held locally)."""
    timer = OpTimer(job, it, job.table, job.table)
    with timer.op("engine_start", price={"restore": True, "release_mode": job.cfg.rollout.release}):
        job.engine.restore()
    with timer.op("weight_load", price={"nbytes": job.cost.weight_bytes if job.cost else 0}) as ev:
        job.engine.load_weights(job.layout.views(job.trainer.flat))
        ev["bytes"] = job.layout.numel * 4
