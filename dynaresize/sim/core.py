"""A discrete-event simulation of a whole job: the recipe of loop.py, priced by the cost model.

Every iteration is bulk-synchronous in the runtime (it ends with a gather on rank 0), so the
simulation advances one iteration at a time with one clock per rank, as numpy arrays:

    switch    the plan the runtime executes (switchplan.plan), priced op by op: critical ops
              advance their ranks' clocks, background ones run beside them and whatever a rank
              has to wait for at the end is critical
    rollout   rollout ranks, prompt groups placed by placement.place_prompts (as the runtime)
    exchange  every rank, after rollout (max_lag 0) or after training (max_lag 1)
    train     train ranks: forward/backward on their micro-batches, then gradient all-reduce,
              optimizer step (waits for a pending stage_in) and parameter all-gather
    weight_sync  train rank 0 and the rollout ranks
    end       background ops settled, gather, decide (the same policy objects as the runtime)

Collectives end at the same time on every member (the last arrival plus the operation's cost).
Batches are dynaresize.data.shapes' (the runtime's prompts and hidden response lengths; responses end
at their hidden length, as the runtime's engines with rollout.ignore_eos). Placement is the
runtime's (dynaresize.plan.placement): it never reads a response's length. The output is a timeline in
the runtime's schema, written with TimelineWriter, so `python -m dynaresize.analysis.cli` reads it unchanged. Deterministic: a function of the
config (noise included, seeded by run.seed).

Over 400 lines on purpose: it is the simulator's half of loop.Stages, one method per stage of the
recipe, and reads best beside the runtime's (job.py) stage by stage.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import os
import time

import numpy as np

from .. import __version__
from ..plan.costmodel import CostModel
from ..plan import switchplan
from ..loop import run_iterations
from ..plan.migration import priced_migration, tail_schedule
from ..plan.placement import place_prompts
from ..plan.policy import POLICIES, Decision, IterationStats, make_policy, resolve_migration
from ..plan.prediction import IterationModel, Lengths, Prediction
from ..plan.roles import RoleTable
from ..data.shapes import BatchShape, batch_shape, filtered_shape, generation_rounds
from ..data.workload import HELD_OUT
from ..timeline import schema
from ..timeline.reader import TIMELINE_FILE
from ..timeline.writer import TimelineWriter
from .config import SimSetup
from .events import NONE, ROLE_CODES, EventBuffer

SAMPLE_ROWS_LIMIT = 5_000_000     # sim.samples=auto writes per-sample rows up to this many (220 MB)


class Simulator:
    def __init__(self, setup: SimSetup, out_dir: str | os.PathLike | None = None):
        cfg = copy.deepcopy(setup.cfg)           # never change the caller's config
        cfg.run.mode = "simulate"
        self.setup = setup = SimSetup(cfg, setup.profile)
        self.cfg = cfg
        self.options = setup.options
        self.cm = CostModel.for_job(cfg, setup.profile)
        self.W = cfg.cluster.ranks
        self.lag = cfg.run.max_lag
        self.iterations = cfg.run.iterations
        self.spp = cfg.rollout.samples_per_prompt
        self.mbs = cfg.trainer.micro_batch_size
        self.prompts = cfg.rollout.prompts_per_batch
        self.seed = cfg.run.seed
        self.out_dir = os.fspath(out_dir or cfg.run.output_dir or os.getcwd())
        self.noise = setup.options.noise
        self.rng = np.random.default_rng([abs(int(self.seed)), 0x6E6F6973])
        self._batches: dict[int, BatchShape] = {}
        total_samples = self.prompts * self.spp * self.iterations
        self.record_samples = setup.options.samples == "yes" or (setup.options.samples == "auto"
                                                                  and total_samples <= SAMPLE_ROWS_LIMIT)
        self._predictions: dict[tuple[int, int], Prediction] = {}
        self.work_stealing = cfg.trainer.work_stealing
        cfg, why = resolve_migration(cfg, self.cm)       # rollout.migration_threshold=auto: chosen here
        self.setup = setup = SimSetup(cfg, setup.profile)
        self.cfg = cfg
        if why and setup.options.progress:
            print(f"[dynaresize-sim] {why}", flush=True)
        self.migration = priced_migration(cfg.rollout, self.cm)
        if cfg.rollout.migration_threshold > 0 and self.migration is None:
            raise ValueError("rollout.migration_threshold: the simulator prices tail migration for continuous "
                             "batching only; use a GPU profile (hardware=h100, h200) or migration_threshold=0")
        self.model = IterationModel.for_job(cfg, self.cm, self.migration)

        kind = POLICIES[cfg.policy.name]
        self.colocated = kind.colocated
        self.free_switch = kind.free_switch
        self.policy = make_policy(cfg, self.cm, sim=self)
        self.k = self.W if self.colocated else self.policy.initial_train_ranks()
        if kind.chooses_start and not self.colocated:   # the config records the split the run started with
            cfg.policy.train_ranks = self.k
        if getattr(self.policy, "start_reason", "") and setup.options.progress:
            print(f"[dynaresize-sim] {self.policy.start_reason}", flush=True)
        self.version = 0
        self._roles_of = None                 # the (split, version) self._roles describes
        # a rank that left rollout keeps its released engine (resize.switch: parked) for its return
        self.parked = np.zeros(self.W, dtype=bool)
        self.release_mode = cfg.rollout.release
        self.hosts = self.cm.hostnames(self.W)     # the node of each rank, as the runtime sees hostnames
        self.events = EventBuffer()
        self.rows: dict[str, list] = {"iterations": [], "decisions": [], "samples": []}

    # --- workload ----------------------------------------------------------------------------
    def batch(self, b: int) -> BatchShape:
        """The shape of batch b (prompt lengths, hidden response lengths), as the runtime's."""
        if b not in self._batches:
            self._batches[b] = filtered_shape(self.cfg.workload, self.seed, b, self.prompts, self.spp,
                                              generation_rounds(self.cfg.trainer))
            for old in [x for x in self._batches if x < b - 2]:
                del self._batches[old]
        return self._batches[b]

    def _noise(self, n: int | None = None):
        if self.noise <= 0:
            return 1.0 if n is None else np.ones(n)
        z = self.rng.standard_normal(1 if n is None else n)
        f = np.maximum(1.0 + self.noise * z, 0.05)
        return float(f[0]) if n is None else f

    def table(self) -> RoleTable:
        """The role table now (the runtime's, roles.py): the split and its version."""
        return (RoleTable.colocated(self.W, self.version) if self.colocated
                else RoleTable.split(self.W, self.k, self.version))

    def roles(self) -> np.ndarray:
        """Each rank's role (timeline code) in the role table, as arrays; cached per table."""
        if self._roles_of != (self.k, self.version):
            table = self.table()
            self._roles = np.array([ROLE_CODES[table.role_of(r).value] for r in range(self.W)], dtype=np.int64)
            self._ranks = np.array(table.train_ranks()), np.array(table.rollout_ranks())
            self._roles_of = (self.k, self.version)
        return self._roles

    def train_ranks(self) -> np.ndarray:
        self.roles()
        return self._ranks[0]

    def rollout_ranks(self) -> np.ndarray:
        self.roles()
        return self._ranks[1]

    def exchanged_tokens(self, b: int | None) -> float:
        if b is None:
            return 0.0
        shape = self.batch(b)
        return float(shape.prompt_lens.sum() * self.spp + shape.response_lens.sum())

    # --- the oracle's prediction ---------------------------------------------------------------
    def predict(self, it: int, k: int) -> Prediction:
        """Iteration `it` with k train ranks, priced with its true batches, no noise and no switch
        (the oracle's view)."""
        key = (it, k)
        if key not in self._predictions:
            gen = Lengths.of(self.batch(it)) if it < self.iterations else None
            trn = Lengths.of(self.batch(it - self.lag)) if it >= self.lag else None
            if len(self._predictions) > 20000:
                self._predictions.clear()
            self._predictions[key] = self.model.iteration(gen, trn, k)
        return self._predictions[key]

    # --- one iteration -----------------------------------------------------------------------
    def run(self) -> str:
        os.makedirs(self.out_dir, exist_ok=True)
        path = os.path.join(self.out_dir, TIMELINE_FILE)
        if os.path.exists(path):
            refuse_to_overwrite(path)
            os.remove(path)
        cm = self.cm
        meta = {"mode": "simulate", "world_size": self.W, "mpi_world_size": 0, "backend": "none",
                "device": "simulated", "config": self.setup.config_yaml(), "policy": self.cfg.policy.name,
                "max_lag": self.lag, "parameters": cm.numel, "priced_parameters": cm.numel,
                "hardware": cm.profile.name, "model": cm.model.name, "hostnames": json.dumps(self.hosts), "dynaresize_version": __version__,
                "samples_recorded": self.record_samples}
        wall0 = time.perf_counter()
        writer = TimelineWriter(path, meta)
        try:
            startup = cm.startup_time() * self._noise(self.W)
            self.events.add(-1, np.arange(self.W), np.full(self.W, NONE), "startup", 0.0, startup)
            self.clock = float(np.max(startup))
            self.writer = writer
            run_iterations(self, self.iterations, self.lag, self.cfg.eval.every)   # the runtime's recipe, priced
            wall = time.perf_counter() - wall0
            writer.close(complete=True, end_time=self.clock, sim_wall_s=wall,
                         groups_created_at_startup=0, groups_created_after_startup=0,
                         **self.policy.decide_time_attrs())
        except BaseException:
            writer.close(complete=False)
            raise
        return path

    def flush(self, writer: TimelineWriter) -> None:
        writer.append("events", self.events.take())
        writer.append("iterations", self.rows["iterations"])
        writer.append("decisions", self.rows["decisions"])
        if self.rows["samples"]:
            writer.append("samples", np.concatenate(self.rows["samples"]))
        writer.flush()
        self.rows = {"iterations": [], "decisions": [], "samples": []}

    # --- the stages of the recipe (loop.run_iterations), priced for every rank at once ----------
    # Within an iteration: self.t (each rank's clock), self.critical (its critical switch time),
    # self.background (switch ops beside the iteration, settled at its end) and self.pending
    # (stage_in of new train ranks, waited for at the optimizer step).
    first_iteration, pending_batch, pending_decision, end_warned = 0, None, None, False

    def begin_iteration(self, it: int) -> None:
        self.t = np.full(self.W, self.clock)
        self.critical = np.zeros(self.W)
        self.background: list[tuple] = []           # (ranks, name, start, end, bytes)
        self.pending: dict = {}                     # rank -> (start, end, bytes)
        self.rollout_time, self.train_time, self.lengths = 0.0, 0.0, None

    def switch(self, it: int, decision: Decision) -> None:
        if self.free_switch:
            self.k, self.version = decision.to_train, self.version + 1
        else:
            self.price_switch(it, self.t, decision.to_train, self.critical, self.background, self.pending)

    def rollout(self, it: int, b: int) -> int:
        """Each round of the batch (one without dynamic sampling) on the rollout ranks, placed on its
        own; a later round starts when every rollout rank has ended the one before (Job.rollout:
        they count the groups whose rewards differ together)."""
        cm, t, roles = self.cm, self.t, self.roles()
        shape = self.batch(b)
        lengths = Lengths.of(shape)
        rr = self.rollout_ranks()
        R = len(rr)
        start, owner = t[rr].copy(), np.zeros(shape.prompts, dtype=np.int64)
        for r, part in enumerate(lengths.round_slices()):
            prompts, responses = shape.prompt_lens[part], shape.response_lens[part]
            assign = place_prompts(prompts, R)
            owner[part] = rr[assign]
            tokens = np.bincount(assign, weights=responses.sum(axis=1), minlength=R)
            if self.migration is not None and R >= 2:
                dur = self.price_migration(it, t, roles, rr, lengths, tokens)
            else:
                dur = cm.rollout_times(assign, prompts, responses, R) * self._noise(R)
                self.events.add(it, rr, roles[rr], "rollout", t[rr], t[rr] + dur, tokens=tokens,
                                attrs={"round": r} if shape.rounds else None)
            t[rr] += dur
            if r + 1 < len(shape.rounds):
                t[rr] = t[rr].max()
        self.rollout_time = float((t[rr] - start).max())
        self.lengths = lengths
        if self.record_samples:
            self.rows["samples"].append(self.sample_rows(it, b, shape, owner))
        return b

    def price_migration(self, it, t, roles, rr, batch: Lengths, tokens) -> np.ndarray:
        """Tail migration (Job._migrate): every rollout rank generates to its cut, the first at
        theirs go on with their own last sequences and admit the later ranks' as they arrive
        (migration.tail_schedule, the policy's prediction); a `migrate` event where a rank hands
        off, a `rollout` event per tail rank from its cut. Returns each rollout rank's time until
        it is done."""
        cut, rank, remaining, context = self.model.rollout_cuts(batch, self.k)
        cut_at = t[rr] + cut * self._noise(len(rr))
        end, runs = tail_schedule(self.cm, cut_at, rank, remaining, context, self.migration[1])
        left = np.bincount(rank, weights=remaining, minlength=len(rr))
        self.events.add(it, rr, roles[rr], "rollout", t[rr], cut_at, tokens=tokens - left)
        for tail, sources, start, stop in runs:
            on = rr[[tail]]
            moved = [s for s in sources if s != tail]
            self.events.add(it, rr[moved], roles[rr[moved]], "migrate", cut_at[moved], cut_at[moved],
                            attrs={"to": int(on[0])})
            self.events.add(it, on, roles[on], "rollout", start, stop, tokens=left[sources].sum(),
                            attrs={"tail": True, "ranks": len(sources)})
        return end - t[rr]

    def exchange(self, it: int, b: int | None) -> int | None:
        dur = self.cm.exchange_time(self.exchanged_tokens(b), self.W) * self._noise()
        end = self.t.max() + dur
        self.events.add(it, np.arange(self.W), self.roles(), "exchange", self.t.copy(), end)
        self.t[:] = end
        return b

    def train(self, it: int, b: int) -> None:
        self.train_time = self.price_train(it, self.t, self.roles(), b, self.critical, self.pending)

    def sync_weights(self, it: int) -> None:
        if self.colocated:
            return
        cm, t = self.cm, self.t
        part = np.concatenate(([0], np.arange(self.k, self.W)))
        dur = cm.weight_sync_time(cm.weight_bytes, len(part), multi_node=cm.multi_node(self.W)) * self._noise()
        end = t[part].max() + dur
        self.events.add(it, part, self.roles()[part], "weight_sync", t[part], end, nbytes=cm.weight_bytes)
        t[part] = end

    def evaluate(self, it: int) -> None:
        """Held-out evaluation (Job.evaluate): the generating ranks generate eval.prompts x
        eval.samples_per_prompt responses, priced as a rollout of that shape with the workload's
        lengths at iteration `it` (the policy's lengths then), on their own seed stream."""
        e, roles, t = self.cfg.eval, self.roles(), self.t
        shape = batch_shape(self.cfg.workload, self.seed ^ HELD_OUT, min(it, self.iterations - 1),
                            e.prompts or self.prompts, e.samples_per_prompt)
        rr = self.rollout_ranks()
        assign = place_prompts(shape.prompt_lens, len(rr))
        dur = self.cm.rollout_times(assign, shape.prompt_lens, shape.response_lens, len(rr)) * self._noise(len(rr))
        tokens = np.bincount(assign, weights=shape.response_lens.sum(axis=1), minlength=len(rr))
        self.events.add(it, rr, roles[rr], "eval", t[rr], t[rr] + dur, tokens=tokens)
        t[rr] += dur

    def end_iteration(self, it: int, generated: int | None, trained: int | None) -> Decision:
        """Settle background ops, record the iteration, decide the next split (the runtime's
        policy objects), write the timeline every sim.flush_every iterations."""
        t, roles, T = self.t, self.roles(), self.clock
        for r, (start, end, nbytes) in self.pending.items():   # stage_in never waited for (no training)
            self.background.append((np.array([r]), "stage_in", np.array([start]), np.array([end]), nbytes))
        for ranks, name, start, end, nbytes in self.background:
            self.settle(it, t, roles, ranks, name, start, end, nbytes, self.critical)
        end_it = float(t.max()) + self.cm.iteration_overhead()
        self.rows["iterations"].append({
            "iteration": it, "table_version": self.version, "train_ranks": self.k,
            "rollout_ranks": self.W if self.colocated else self.W - self.k, "start": T, "end": end_it,
            "trained_batch": -1 if trained is None else trained,
            "generated_batch": -1 if generated is None else generated})
        stats = IterationStats(it, self.k, self.W, self.rollout_time, self.train_time,
                               switch_time=float(self.critical.max()),
                               generated_batch=-1 if generated is None else generated,
                               trained_batch=-1 if trained is None else trained, lengths=self.lengths)
        decision = self.policy.decide_timed(stats)
        self.rows["decisions"].append(decision.row(self.version + int(decision.moves)))
        if self.options.progress:
            print(f"[dynaresize-sim] iter {it + 1:>5}/{self.iterations + self.lag}  split "
                  f"{self.describe():>9}  rollout {self.rollout_time:8.2f}s  train {self.train_time:8.2f}s  "
                  f"span {end_it - T:8.2f}s  {decision.reason}", flush=True)
        # sim.charge_decisions: the next iteration starts after the decision, as in a real run
        self.clock = end_it + (self.policy.decide_seconds[-1] if self.options.charge_decisions else 0.0)
        buffered = self.events.rows + sum(len(x) for x in self.rows["samples"])
        last = it == self.iterations + self.lag - 1
        if (it + 1) % self.options.flush_every == 0 or last or buffered > 2_000_000:
            self.flush(self.writer)
        return decision

    def checkpoint_if_due(self, it: int, ready, decision: Decision) -> None:
        """A simulation keeps no checkpoints (they change nothing it prices)."""

    def requeue(self) -> None:
        raise AssertionError("a simulation is never warned of its end")

    def finish(self) -> None:
        """The timeline is closed by run()."""

    def describe(self) -> str:
        return f"{self.W}C" if self.colocated else f"{self.k}T/{self.W - self.k}R"

    def sample_rows(self, it, b, shape: BatchShape, prompt_ranks) -> np.ndarray:
        n, spp = shape.prompts, self.spp
        out = np.zeros(n * spp, dtype=schema.SAMPLE_DTYPE)
        out["iteration"] = it
        out["batch"] = b
        out["index"] = np.arange(n * spp)
        out["prompt"] = np.repeat(np.arange(n), spp)
        out["rank"] = np.repeat(prompt_ranks, spp)
        out["prompt_len"] = np.repeat(shape.prompt_lens, spp)
        out["response_len"] = shape.response_lens.ravel()
        out["length_cap"] = out["response_len"]         # the hidden length: every response reaches it
        return out

    def op(self, it, t, roles, ranks, name, dur, critical, nbytes=0) -> None:
        """A critical switch op of colocated ranks outside a switch plan: each starts at its clock."""
        start = t[ranks].copy()
        end = start + dur
        self.events.add(it, ranks, roles[ranks], name, start, end, schema.CRITICAL, nbytes=nbytes)
        critical[ranks] += end - start
        t[ranks] = end

    def settle(self, it, t, roles, ranks, name, start, end, nbytes, critical) -> None:
        """A background op waited for at `t`: hidden until then, critical after (resize.BackgroundOp)."""
        split = np.minimum(np.maximum(t[ranks], start), end)
        self.events.add(it, ranks, roles[ranks], name, start, split, schema.BACKGROUND, nbytes=nbytes)
        late = end > split
        if late.any():
            r = ranks[late]
            self.events.add(it, r, roles[r], name, split[late], end[late], schema.CRITICAL)
            critical[r] += end[late] - split[late]
            t[r] = np.maximum(t[r], end[late])

    # --- the switch: the runtime's plan (switchplan.plan), priced ---------------------------------
    def price_switch(self, it, t, k2, critical, background, pending) -> None:
        cm = self.cm
        old = self.table()
        sp = switchplan.plan(old, old.with_split(k2), parked=frozenset(np.flatnonzero(self.parked).tolist()),
                             transport=switchplan.transport(self.cfg.staging.transport, self.hosts, max(self.k, k2)),
                             numel=cm.numel, release_mode=self.release_mode,
                             staging_critical=self.cfg.staging.critical, sharding=self.cfg.trainer.sharding,
                             hosts=self.hosts)
        k = self.k
        self.k, self.version = k2, sp.new.version
        roles = self.roles()                          # ops are recorded with the new table's roles
        stage_out_end = np.zeros(k)

        def duration(op):
            base = switchplan.op_time(op, cm.switch_op_time)
            return base * (self._noise() if op.collective else self._noise(len(op.ranks)))

        for op, start, end, dur in switchplan.walk(sp, t, duration):
            ranks = np.array(op.ranks)
            if op.name == "stage_in" and not op.critical:     # waited for at the optimizer step,
                for i, r in enumerate(op.ranks):              # read once its old owners have written
                    src = switchplan.sources(cm.numel, k, k2, r)
                    ready = stage_out_end[src.start:src.stop].max() if len(src) else start[i]
                    pending[r] = (float(start[i]), float(max(start[i], ready) + dur[i]), op.nbytes[i])
            elif not op.critical:                     # stage_out of ranks staying in training
                stage_out_end[ranks] = end
                background.append((ranks, op.name, start, end, op.nbytes[0]))
            else:
                attrs = ({"mode": self.release_mode} if op.name == "release" else
                         [{"restored": bool(x)} for x in op.restored] if op.restored else None)
                self.events.add(it, ranks, roles[ranks], op.name, start, end, schema.CRITICAL,
                                nbytes=np.array(op.nbytes) if op.nbytes else 0, attrs=attrs)
                critical[ranks] += end - start
                if op.name == "stage_out":
                    stage_out_end[ranks] = end
        self.parked[:] = False
        self.parked[list(sp.parked_after)] = True

    # --- training (Job.train: trainer.train_step, colocated release/restore) -------------------
    def price_train(self, it, t, roles, b, critical, pending) -> float:
        cm, ev = self.cm, self.events
        tr = self.train_ranks()
        K = len(tr)
        if self.colocated:
            self.op(it, t, roles, tr, "release",
                    cm.switch_op_time("release", release_mode=self.release_mode) * self._noise(K), critical)
        common = self._noise()
        before, opt, after = (x * common for x in cm.train_sync_parts(K))
        start = t[tr].copy()
        if self.work_stealing:
            tok, mb, computed = self.price_stealing(it, t, roles, b, common)
            reduced = computed + before
        else:
            tok, mb = self.model.train_work(Lengths.of(self.batch(b)), K)
            compute = cm.train_compute_time(tok, mb) * common
            reduced = float((start + compute).max() + before)      # gradients all-reduced
        opt_start = np.full(K, reduced)
        if pending:
            for r, (s, e, nbytes) in pending.items():
                split = min(max(reduced, s), e)
                ev.add(it, np.array([r]), roles[[r]], "stage_in", s, split, schema.BACKGROUND, nbytes=nbytes)
                if e > split:
                    ev.add(it, np.array([r]), roles[[r]], "stage_in", split, e, schema.CRITICAL)
                    critical[r] += e - split
                opt_start[r] = max(reduced, e)
            pending.clear()
        end = float((opt_start + opt).max() + after)               # parameters all-gathered
        ev.add(it, tr, roles[tr], "train", start, end, tokens=tok,
               attrs=[{"micro_batches": int(m)} for m in mb])
        t[tr] = end
        if self.colocated:
            self.op(it, t, roles, tr, "engine_start",
                    cm.switch_op_time("engine_start", restore=True, release_mode=self.release_mode) * self._noise(K),
                    critical)
            self.op(it, t, roles, tr, "weight_load",
                    cm.switch_op_time("weight_load", nbytes=cm.weight_bytes) * self._noise(K),
                    critical, nbytes=cm.weight_bytes)
        return float(end - start.min())

    def price_stealing(self, it, t, roles, b, scale) -> tuple[np.ndarray, float]:
        """Work stealing (Job.steal): the train ranks from their clocks and the rollout ranks from
        the end of their rollout claim the micro-batches in order (IterationModel.claims, the
        policy's prediction); one `steal` event per micro-batch a helper computes. Returns (each
        train rank's tokens and micro-batches, when the helpers' sums have reached the train ranks)."""
        tr, rr = self.train_ranks(), self.rollout_ranks()
        K = len(tr)
        workers = np.concatenate((tr, rr))
        owner, start, dur, mb_tok, joined = self.model.claims(Lengths.of(self.batch(b)), K, t[workers], scale)
        stolen = owner >= K
        if stolen.any():
            ranks = workers[owner[stolen]]
            self.events.add(it, ranks, roles[ranks], "steal", start[stolen], start[stolen] + dur[stolen],
                            tokens=mb_tok[stolen])
        end = t[workers].copy()
        np.maximum.at(end, owner, start + dur)
        helpers = np.unique(owner[stolen])
        sums = self.model.helper_sums(owner, K) * scale
        computed = float(end[np.concatenate((np.arange(K), helpers))].max())
        if len(joined):                  # the helpers' engines sleep before and wake after (background)
            sleep, wake = (x * scale for x in self.model.engine_times)
            ranks, free = workers[joined], t[workers[joined]].copy()
            done = np.maximum(end[joined], free + sleep) + np.where(np.isin(joined, helpers), sums, 0.0)
            if sleep > 0:
                self.events.add(it, ranks, roles[ranks], "release", free, free + sleep, schema.BACKGROUND)
            if wake > 0:
                self.events.add(it, ranks, roles[ranks], "engine_start", done, done + wake, schema.BACKGROUND,
                                attrs={"restored": True})
            t[ranks] = done + wake
        return (np.bincount(owner[~stolen], weights=mb_tok[~stolen], minlength=K),
                np.bincount(owner[~stolen], minlength=K), computed + sums)


def refuse_to_overwrite(path: str) -> None:
    """A simulation replaces only a simulated timeline, never a real or emulated run's."""
    from ..timeline.reader import open_read, plain
    try:
        with open_read(path, swmr=True) as f:
            mode = str(plain(f.attrs.get("mode", "")))
    except OSError:
        return                                   # not a readable HDF5 file: nothing to protect
    if mode and mode != "simulate":
        raise FileExistsError(f"{path} is the timeline of a {mode} run; the simulator will not overwrite "
                              f"it. Give another output folder (out_dir / hydra.run.dir).")


def simulate(cfg, out_dir: str | os.PathLike | None = None, hardware=None, options=None) -> str:
    """Simulate the job `cfg` and write its timeline; returns the timeline's path.

    cfg: a SimSetup, a validated dynaresize.config.JobConfig, or a composed config (DictConfig or
    dict, possibly with `hardware` and `sim` sections). hardware: a profile name, path, mapping or
    HardwareProfile (default: the config's `hardware` section, else cpu_tiny). options: SimOptions.
    out_dir: the run folder (default: cfg.run.output_dir, else the current directory).
    """
    from ..config import JobConfig
    from ..plan.hardware import job_profile
    from .config import prepare

    if isinstance(cfg, SimSetup):
        setup = cfg
        if hardware is not None:
            setup = SimSetup(setup.cfg, job_profile(setup.cfg, hardware))
        if options is not None:
            setup = SimSetup(dataclasses.replace(setup.cfg, sim=options), setup.profile)
    elif isinstance(cfg, JobConfig):
        setup = SimSetup(cfg if options is None else dataclasses.replace(cfg, sim=options), job_profile(cfg, hardware))
    else:
        setup = prepare(cfg, hardware=hardware, options=options)
    sim = Simulator(setup, out_dir)
    return sim.run()
