"""The switch: one resize as a small plan of timed operations, critical or background.

Moving from k to k' train ranks (train ranks are the block [0, k), so old and new train sets are
both prefixes of the ranks):

  rank joining training   release engine --------------------> weight_load (from train rank 0)
  rank leaving training   stage_out (spill shard) -> engine_start -> weight_load (own weights)
  old owners staying      stage_out .................(background, overlaps the next stage)
  every rank              commit (all ranks acknowledge v'), then group_switch (registry lookup)
  new owners              stage_in of their new range .......(background until the optimizer step)

Only what the next stage needs in order to start is critical. Optimizer state is needed at the
optimizer step, after the forward and backward passes of the next training step, so staging it in
overlaps that work; if it is not done by then, the wait is recorded as critical time. The commit
comes first: every rank acknowledges the new table version before any rank acts on it, and a rank
that fails anywhere in the switch aborts the whole job (see worker.py), so two versions are never
live.
"""
from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

import torch
import torch.distributed as dist

from .flat import shard_range
from .model import load_model
from .policy import Decision
from .roles import RoleTable
from .staging import STATE_FIELDS, read_shard, shard_path, write_shard
from .timeline.schema import BACKGROUND, CRITICAL
from .trainer import ShardedTrainer
from .types import ShardState

# Fault injection for tests: "RANK:OPERATION" makes that rank die (SIGKILL) when it starts that op.
FAULT_ENV = "DYNARESIZE_INJECT_FAULT"


class SwitchError(RuntimeError):
    pass


class Plan:
    """Runs and records the operations of one switch on one rank."""

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

    def __init__(self, plan: Plan, name: str, fn):
        self.plan, self.name, self.fn = plan, name, fn
        self.clock = plan.job.ctrl.now
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
            raise SwitchError(f"rank {self.plan.job.rank}: switch operation {self.name!r} failed "
                              f"({self.plan.label}): {type(self._error).__name__}: {self._error}") from self._error
        return self._result

    def _record(self, waited_from: float) -> None:
        job, plan = self.plan.job, self.plan
        role = plan.new.role_of(job.rank).value
        nbytes = self._nbytes
        split = min(max(waited_from, self.start), self.end)
        base = {"iteration": plan.it, "rank": job.rank, "role": role, "name": self.name, "tokens": 0}
        job.rec.add({**base, "start": self.start, "end": split, "critical": BACKGROUND, "bytes": nbytes,
                     "attrs": {}})
        if self.end > split:               # the main thread had to wait: that part was not hidden
            job.rec.add({**base, "start": split, "end": self.end, "critical": CRITICAL, "bytes": 0,
                         "attrs": {"waited": True}})


def inject_fault(rank: int, op: str) -> None:
    spec = os.environ.get(FAULT_ENV, "")
    if spec and spec == f"{rank}:{op}":
        os.kill(os.getpid(), signal.SIGKILL)


def switch(job, it: int, decision: Decision) -> None:
    """Move from the current table to one with `decision.to_train` train ranks."""
    old = job.table
    new = old.with_split(decision.to_train)
    plan = Plan(job, it, old, new)
    k, k2, r = old.num_train, new.num_train, job.rank
    was_train, will_train = old.trains(r), new.trains(r)
    numel = job.layout.numel
    staging = job.cfg.staging
    network = job.staging_transport(max(k, k2)) == "network"
    weight_bytes = job.cost.weight_bytes if job.cost else 0      # sizes emulation prices (the profile's model)

    with plan.op("commit", price={"ranks": job.world}):   # every rank acknowledges v' before anyone acts
        versions = job.ctrl.allgather(new.version)
        if len(set(versions)) != 1:
            raise SwitchError(f"ranks disagree on the new table version: {versions}")

    with plan.op("group_switch", reuse=job.registry.reuse):  # every rank, before any group is used
        job.registry.ensure(k2)                      # a lookup; a collective creation only without reuse

    if not was_train and will_train:                 # joining training: the engine's memory goes first
        with plan.op("release", price={"release_mode": job.cfg.rollout.release}, mode=job.cfg.rollout.release):
            job.engine.release()                     # parked: sleep mode keeps it for a cheap return
            job.parked_engine, job.engine = job.engine, None

    new_shard = None
    if was_train:
        shard = job.trainer.export_shard()
        if network:                                  # across nodes: ranges move over the data plane
            with plan.op("reshard", price={"nbytes": 3 * weight_bytes, "ranks": max(k, k2), "broadcasts": k}) as ev:
                new_shard = reshard_over_network(job, shard, k, k2, numel)
                ev["bytes"] = 3 * (shard.hi - shard.lo) * 4
        else:
            path = shard_path(job.staging_dir, new.version, r)

            out_price = {"nbytes": shard_bytes(job, k)}

            def stage_out(shard=shard, path=path):
                hold = job.emulated_until(job.ctrl.now(), "stage_out", out_price) if job.cost else None
                return None, write_shard(path, shard, new.version, staging.buffer_mb, job.run_id, staging.fsync, hold)

            if will_train:
                plan.background("stage_out", stage_out, critical=staging.critical, price=out_price)
            else:                                    # leaving: spill now, its memory is the engine's
                with plan.op("stage_out", price=out_price) as ev:
                    ev["bytes"] = stage_out()[1]
            job.staged_files.append(path)
    elif network and r < max(k, k2):
        with plan.op("reshard", price={"nbytes": 3 * weight_bytes, "ranks": max(k, k2), "broadcasts": k}):
            new_shard = reshard_over_network(job, None, k, k2, numel)

    if was_train and not will_train:                 # joining rollout: engine, then its own weights
        restored = job.parked_engine is not None
        with plan.op("engine_start", price={"restore": restored, "release_mode": job.cfg.rollout.release},
                     restored=restored):
            if job.parked_engine is not None:
                job.engine, job.parked_engine = job.parked_engine, None
                job.engine.restore()
            else:
                job.engine = job._start_engine()
        with plan.op("weight_load", price={"nbytes": weight_bytes}) as ev:
            job.engine.load_weights(job.layout.views(job.trainer.flat))
            ev["bytes"] = numel * 4
        job.trainer = None

    if k2 > k and will_train:                        # the new train set gets train rank 0's weights
        with plan.op("weight_load", price={"nbytes": weight_bytes, "ranks": k2}) as ev:
            if job.trainer is None:
                job.trainer = ShardedTrainer(load_model(job.model_dir, "float32", job.device), job.cfg.trainer,
                                             job.cfg.rollout.temperature, job.device)
            dist.broadcast(job.trainer.flat, src=0, group=job.registry.get("train", k2))
            ev["bytes"] = numel * 4

    if will_train:
        lo, hi = shard_range(numel, k2, new.train_ranks().index(r))
        if network:
            pending = Done(new_shard)
        else:
            in_price = {"nbytes": shard_bytes(job, k2)}

            def stage_in(lo=lo, hi=hi):
                holds = []          # emulation: the read lasts its price from when its files exist
                ready = (lambda: holds.append(job.emulated_until(job.ctrl.now(), "stage_in", in_price))) \
                    if job.cost else None
                shard = read_shard(job.staging_dir, new.version, k, numel, lo, hi, shard_range, job.run_id, ready)
                for hold in holds:
                    hold()
                return shard, 3 * (hi - lo) * 4

            pending = plan.background("stage_in", stage_in, critical=staging.critical)
        job.trainer.join(job.registry.get("train", k2), new.train_ranks(), r, pending=pending)

    job.registry.release_unreused(k)                 # without reuse, the old split's groups go
    job.table = new
    job.set_status(f"running ({new.describe()})")


def shard_bytes(job, shards: int) -> int:
    """The priced size of one staged shard (run.mode=emulate prices the profile's model)."""
    return job.cost.shard_bytes(shards) if job.cost else 0


def reshard_over_network(job, shard: ShardState | None, k: int, k2: int, numel: int) -> ShardState | None:
    """Move ranges between old and new owners over the data plane (ranks on different nodes).

    Every rank of the train group [0, max(k, k')) takes part: each old owner broadcasts its shard
    and each new owner keeps the overlap with its new range. Critical: collectives run on the main
    thread.
    """
    K, r = max(k, k2), job.rank
    group = job.registry.get("train", K) if K < job.world else dist.group.WORLD
    lo, hi = shard_range(numel, k2, r) if r < k2 else (0, 0)
    parts = {name: torch.zeros(hi - lo, device=job.device) for name in STATE_FIELDS}
    step = 0
    for q in range(k):
        q_lo, q_hi = shard_range(numel, k, q)
        n = q_hi - q_lo
        buf = torch.empty(3 * n + 1, device=job.device)     # the three fields, then the step count
        if r == q:
            buf.copy_(torch.cat([getattr(shard, f).detach().reshape(-1) for f in STATE_FIELDS] +
                                [torch.tensor([float(shard.step)], device=job.device)]))
        dist.broadcast(buf, src=q, group=group)
        step = int(buf[-1].item())
        a, b = max(lo, q_lo), min(hi, q_hi)
        if a < b:
            for i, name in enumerate(STATE_FIELDS):
                parts[name][a - lo:b - lo] = buf[i * n + a - q_lo:i * n + b - q_lo]
    if r >= k2:
        return None
    return ShardState(lo, hi, parts["params"], parts["exp_avg"], parts["exp_avg_sq"], step)


def colocated_release(job, it: int) -> None:
    """Colocated: every rank frees its engine before training (a switch every iteration)."""
    plan = Plan(job, it, job.table, job.table)
    with plan.op("release", price={"release_mode": job.cfg.rollout.release}):
        job.engine.release()


def colocated_restore(job, it: int) -> None:
    """Colocated: restore the engine after training and load the new weights (held locally)."""
    plan = Plan(job, it, job.table, job.table)
    with plan.op("engine_start", price={"restore": True, "release_mode": job.cfg.rollout.release}):
        job.engine.restore()
    with plan.op("weight_load", price={"nbytes": job.cost.weight_bytes if job.cost else 0}) as ev:
        job.engine.load_weights(job.layout.views(job.trainer.flat))
        ev["bytes"] = job.layout.numel * 4
