"""One rank of a running job: the stages the recipe (loop.py) calls in order, with real work.

What the rank holds is typed (resize.RankState): the role table, a rollout engine while it
generates, a sharded trainer while it trains, a parked engine; start-up sets it and only a switch
(resize.switch: the state and the plan in, the next state out) changes it. Stages record timed
events; at the end of each iteration rank 0 gathers them, appends them to the timeline, asks the
policy for the next split and broadcasts the decision.

About 500 lines: the runtime's half of loop.Stages, one method per stage, so that it reads beside
the simulator's (sim/core.py) stage by stage; the mechanisms themselves live in their modules.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import os
import pickle
import shutil
import socket
import time

import numpy as np
import torch
import torch.distributed as dist

from .. import __version__
from . import checkpoint, preemption
from .comm import ControlPlane
from ..config import JobConfig, to_yaml
from .flat import FlatLayout
from .fsdp import FullyShardedTrainer
from .groups import GroupRegistry
from ..data.model import (empty_model, eos_token_ids, import_model_code, load_model, model_skeleton,
                          prepare_checkpoint, save_model)
from ..plan.costmodel import CostModel
from ..plan.hardware import job_profile
from ..plan.policy import POLICIES, Decision, IterationStats, make_policy, resolve_migration
from ..plan.prediction import Lengths
from .resize import RankState, colocated_release, colocated_restore, inject_fault, switch
from ..data.rewards import Scorer
from ..plan.roles import RoleTable
from ..plan.migration import MIGRATE_TAG, HandoffInbox, TailRoster
from ..plan.placement import place_prompts, placement_lists
from .rollout.base import ENGINES, GroupRequest, Handoff, make_engine
from ..plan.stealing import MicroBatchQueue
from .staging import (RUN_ID_ENV, earlier_attempts, job_staging_dir, make_private_dir, new_run_id, remove_dir,
                      remove_earlier_staging, remove_mark, staged_mark)
from .status import status_path, write_status
from ..timeline.reader import TIMELINE_FILE
from ..timeline.recorder import Recorder
from ..timeline.schema import BACKGROUND
from ..timeline.writer import TimelineWriter, clock_origin
from .trainer import (ShardedTrainer, add_step_sums, batch_figures, cut_micro_batches, differing_groups,
                      micro_batch_tokens)
from .types import Sample
from ..data.datasets import make_task
from ..data.shapes import generation_rounds, max_response_cap
from ..data.workload import HELD_OUT, digest, sample_seed


ROUND_WAIT = datetime.timedelta(hours=24)   # dynamic sampling: a round waits for the slowest rollout rank


class Job:
    def __init__(self, cfg: JobConfig, ctrl: ControlPlane):
        self.cfg, self.ctrl = cfg, ctrl
        self.rank, self.world = ctrl.rank, ctrl.size
        if self.world != cfg.cluster.ranks:
            raise RuntimeError(f"the job has {self.world} MPI ranks but cluster.ranks={cfg.cluster.ranks}; "
                               f"launch as many ranks as configured")
        torch.set_num_threads(threads_per_rank(ctrl))
        self.run_dir = cfg.run.output_dir or os.getcwd()
        resume = ctrl.bcast(checkpoint.find_resume(self.run_dir) if self.rank == 0 else None)
        # A resumed run's clock goes on from its first attempt's start: the timeline's times keep
        # rising across attempts, and the gap between two is the time the interruption cost.
        ctrl.align_clocks(origin=clock_origin(os.path.join(self.run_dir, TIMELINE_FILE))
                          if resume is not None and self.rank == 0 else None)
        self.attempt_start = ctrl.now()
        self.backend = ctrl.init_data_plane(cfg.cluster.device)
        self.device = "cuda" if cfg.cluster.device == "cuda" else "cpu"
        self.rec = Recorder(self.rank, ctrl.now)
        emulate = cfg.run.mode == "emulate"
        # the cost model: emulation's prices, the dynamic policy's predictions, work stealing's decision to join.
        # A run prices the nodes it runs on (moves, collectives); emulation prices the profile's machine.
        model = CostModel.for_job(cfg, job_profile(cfg), hosts=None if emulate else ctrl.hostnames) \
            if emulate or POLICIES[cfg.policy.name].needs_cost_model or cfg.trainer.work_stealing \
            or cfg.rollout.migration_threshold == "auto" else None
        self.cost = model if emulate else None     # emulation: stages last what the profile's device would take
        if cfg.rollout.migration_threshold == "auto":     # chosen on rank 0 from the cost model
            cfg, why = ctrl.bcast(resolve_migration(cfg, model) if self.rank == 0 else None)
            self.cfg = cfg
            if self.rank == 0:
                print(f"[dynaresize] {why}", flush=True)
        self.policy = make_policy(cfg, model)      # the dynamic policy prices splits with the same model
        self.prices = model
        self.status_path = status_path(self.run_dir, self.rank)
        # The run id binds staged files to this job (a leftover of another run is never read as ours).
        self.run_id = ctrl.bcast((os.environ.get(RUN_ID_ENV) or new_run_id()) if self.rank == 0 else None)
        self.staging_dir = job_staging_dir(cfg.cluster.local_scratch, self.run_id)
        if ctrl.local_rank == 0:          # what killed attempts of this run left on this node
            for path in remove_earlier_staging(self.run_dir, cfg.cluster.local_scratch, self.run_id):
                print(f"[dynaresize] removed {path}, left on {socket.gethostname()} by an earlier attempt "
                      f"of this run", flush=True)
        if self.rank == 0:
            write_status(staged_mark(self.run_dir, self.run_id), "")
        make_private_dir(self.staging_dir)
        self.staged_files: list[str] = []
        self.background_ops: list = []
        self.pending_sends: list = []     # tail migration: this iteration's messages to tail ranks
        # work stealing's claims and tail migration's tickets: a store; a rollout rank's copy of the
        # weights to help with
        self.store = ctrl.make_store() if (cfg.trainer.work_stealing or cfg.rollout.migration_threshold > 0
                                           or cfg.trainer.filter_groups) else None
        self.helper: ShardedTrainer | None = None

        self.end_warned = False          # Slurm warned of the job's end, agreed by all ranks
        self.last_checkpoint: str | None = None

        self.set_status("startup")
        with self.rec.span(-1, "startup", "none") as ev:
            self.registry = GroupRegistry(self.world, cfg.policy.resize_unit, cfg.staging.reuse_groups)
            self.model_dir = self._shared_model_dir()
            self.task = make_task(cfg, self.model_dir)          # where prompts come from
            self.score = Scorer(cfg.reward, self.task.decode, eos_token_ids(self.model_dir))
            # sharding=full: a run may resume on another allocation, or with other policy settings
            # (the policy then starts anew); the sharded state loads on any split
            same_policy = resume is not None and checkpoint.same_policy(resume, cfg)
            if same_policy and resume.table.world != self.world:
                table = resumed_split(resume.table, self.world, cfg.policy.resize_unit)
                self.policy.load_state(resume.policy_state, new_world_split=table.num_train)
            elif same_policy:
                table = resume.table
                self.policy.load_state(resume.policy_state)
            else:
                table = (RoleTable.colocated(self.world) if POLICIES[cfg.policy.name].colocated
                         else RoleTable.split(self.world, self.policy.initial_train_ranks()))
                if resume is not None:
                    table = dataclasses.replace(table, version=resume.table.version + 1)
            self.registry.ensure(table.num_train)
            self.layout = FlatLayout.of(model_skeleton(self.model_dir))
            # the model a switch plan prices: the profile's when emulating, else this one
            self.priced_numel = self.cost.numel if self.cost else self.layout.numel
            # the full weights of a resumed run, for an engine (and every ZeRO-1 trainer)
            needs_weights = table.generates(self.rank) or not self.sharded
            weights = checkpoint.load_flat_params(resume, self.layout) if resume and needs_weights else None
            engine = trainer = None
            if table.generates(self.rank):
                self.set_status("engine_start (startup)")
                engine = self.new_engine(weights)
            if table.trains(self.rank):
                self.set_status("trainer_start (startup)")
                trainer = self._start_trainer(table, resume, weights)
            self.state = RankState(table, engine, trainer)
            if cfg.trainer.work_stealing and trainer is None:
                self.helper = self.new_trainer(weights)
            ev["attrs"]["groups"] = self.registry.creations

        self.first_iteration = resume.iteration + 1 if resume else 0
        self.pending_batch: list[Sample] = resume.pending_batch if resume else []
        # a decision for the checkpoint's rank count or policy does not apply here: the policy decides anew
        self.pending_decision: Decision | None = resume.pending_decision \
            if same_policy and resume.table.world == self.world else None
        self._new_samples: list[Sample] = []
        self._step_sums: dict[str, float] = {}   # this iteration's train step, this rank's micro-batches
        self._step: dict[str, float] = {}        # rank 0: the step's batch-wide figures
        self._eval: dict[str, float] = {}        # rank 0: this iteration's eval/* metrics
        self._held_out = None                    # the evaluation's prompts, made on first use
        self._t_begin = 0.0
        self.writer = self._open_timeline(resume) if self.rank == 0 else None
        self.metrics = None
        if self.rank == 0:     # imported (pandas) now, not inside a timed iteration
            import dynaresize.analysis.metrics  # noqa: F401
            from .metrics_logger import MetricsLogger, iteration_metrics
            self.iteration_metrics = iteration_metrics
            self.metrics = MetricsLogger(cfg.logger, self.run_dir, config=json.loads(json.dumps(
                dataclasses.asdict(cfg), default=str)), run_name=os.path.basename(self.run_dir))
        ctrl.barrier()                    # iteration 0 starts together, after everyone's start-up
        if self.rank == 0:                # every node has removed the earlier attempts' staging
            for old in earlier_attempts(self.run_dir, self.run_id):
                remove_mark(self.run_dir, old)
        if getattr(self.policy, "start_reason", "") and resume is None and self.rank == 0:
            print(f"[dynaresize] {self.policy.start_reason}", flush=True)
        if resume is not None and self.rank == 0:
            other = (f" on {self.world} ranks, the checkpoint's run had {resume.table.world}"
                     if resume.table.world != self.world else "")
            other += "" if same_policy else "; other policy settings than the checkpoint's: the policy starts anew"
            print(f"[dynaresize] resumed from {resume.path} (iterations 0-{resume.iteration} done, "
                  f"split {self.table.describe()}{other})", flush=True)

    # --- start-up ----------------------------------------------------------------------------
    def _shared_model_dir(self) -> str:
        """Rank 0 writes the initial model (or names the configured one); all ranks load it."""
        import_model_code()       # on every rank now, beside rank 0 writing the model, not after it
        path = None
        if self.rank == 0:
            path = prepare_checkpoint(self.cfg.model, os.path.join(self.run_dir, "initial_model"))
        return self.ctrl.bcast(path)

    # --- what the rank holds (RankState: only start-up and a switch change it) ----------------
    @property
    def table(self) -> RoleTable:
        return self.state.table

    @property
    def engine(self):
        return self.state.engine

    @property
    def sharded(self) -> bool:
        """trainer.sharding=full: FSDP2's trainer (fsdp.py), else ZeRO-1's (trainer.py)."""
        return self.cfg.trainer.sharding == "full"

    @property
    def trainer(self) -> ShardedTrainer | FullyShardedTrainer | None:
        return self.state.trainer

    def new_engine(self, weights: torch.Tensor | None = None):
        """A rollout engine of this job's model (with `weights` loaded, if given)."""
        engine = make_engine(self.cfg.rollout, self.model_dir, self.cfg.model.dtype, self.device,
                             self.cfg.run.seed)
        if weights is not None:
            engine.load_weights(self.layout.views(weights))
        return engine

    def _start_trainer(self, table: RoleTable, resume, weights: torch.Tensor | None):
        """This rank's trainer at start-up: in the train group of `table`, with the model's
        initial weights or the checkpoint's state."""
        group, ranks = self.registry.get("train", table.num_train), table.train_ranks()
        if self.sharded:
            trainer = self.new_sharded_trainer(group, ranks, empty=resume is not None)
            if resume is not None:
                trainer.load(checkpoint.train_state_dir(resume.path), resume.run_id)
            return trainer
        trainer = self.new_trainer(weights)
        shard = checkpoint.load_shard(resume, self.layout.numel, ranks.index(self.rank)) if resume else None
        trainer.join(group, ranks, self.rank, shard)
        return trainer

    def new_sharded_trainer(self, group, ranks: list[int], empty: bool = False) -> FullyShardedTrainer:
        """trainer.sharding=full: a trainer of this job's model sharded over `group` (global ranks
        `ranks`): the initial weights, which the group's first rank reads and scatters (the others
        never hold the whole model), or `empty` (its load() fills them)."""
        trainer = FullyShardedTrainer(empty_model(self.model_dir), self.cfg.trainer, self.cfg.rollout.temperature,
                                      self.device, group, ranks, self.rank, compute_dtype=self.cfg.model.dtype)
        if not empty:
            first = ranks.index(self.rank) == 0
            trainer.scatter_weights(load_model(self.model_dir, "float32", "cpu").state_dict() if first else None)
        return trainer

    def new_trainer(self, weights: torch.Tensor | None = None) -> ShardedTrainer:
        """A ZeRO-1 trainer of this job's model (float32 master weights), not yet in a train group."""
        model = load_model(self.model_dir, "float32", self.device)
        trainer = ShardedTrainer(model, self.cfg.trainer, self.cfg.rollout.temperature, self.device)
        if weights is not None:
            trainer.flat.copy_(weights)
        return trainer

    def _open_timeline(self, resume) -> TimelineWriter:
        meta = {"mode": self.cfg.run.mode, "world_size": self.world, "mpi_world_size": self.ctrl.size,
                "backend": self.backend, "device": self.device, "config": to_yaml(self.cfg),
                "policy": self.cfg.policy.name, "max_lag": self.cfg.run.max_lag,
                "hostnames": json.dumps(self.ctrl.hostnames), "parameters": self.layout.numel,
                "priced_parameters": self.priced_numel,
                "dynaresize_version": __version__, "clock_origin": self.ctrl.t0}
        path = os.path.join(self.run_dir, TIMELINE_FILE)
        if resume is not None and os.path.exists(path):
            return TimelineWriter(path, meta, resume_after=resume.iteration, attempt_start_s=self.attempt_start,
                                  world_size=self.world)
        return TimelineWriter(path, meta)

    @property
    def role(self) -> str:
        return self.table.role_of(self.rank).value

    def set_status(self, text: str) -> None:
        """What this rank is doing, for the launcher's report if the job dies (one small file,
        replaced atomically: a reader never finds it empty)."""
        write_status(self.status_path, text, self.rank)

    def settle_background(self) -> None:
        """Wait for this rank's background switch operations (any wait is recorded as critical)."""
        if self.trainer is not None:
            self.trainer.resolve_pending()
        for op in self.background_ops:
            op.wait()
        self.background_ops = []
        for request in self.pending_sends:
            request.wait()
        self.pending_sends = []

    # --- the stages, in the order the recipe calls them ---------------------------------------
    def begin_iteration(self, it: int) -> None:
        self._t_begin = self.ctrl.now()
        self.set_status(f"iteration {it} ({self.table.describe()}, {self.role})")

    def switch(self, it: int, decision: Decision, **options) -> None:
        """Run the switch plan to `decision`'s split (options: resize.switch's registry, staging)."""
        trainer = self.state.trainer
        self.state = switch(self, it, decision, **options)
        if self.cfg.trainer.work_stealing:    # a rank leaving training keeps its weights to help with
            if self.table.trains(self.rank):
                self.helper = None
            elif self.helper is None:
                trainer.leave()
                self.helper = trainer

    def rollout(self, it: int, batch: int) -> list[Sample]:
        """Generate this rank's share of batch `batch`: whole prompt groups, placed by prompt length
        (a response's length is unknown until it is generated). With dynamic sampling
        (trainer.filter_groups) in rounds of new prompt groups, until enough of them have
        rewards that differ (the rollout ranks count them together)."""
        if not self.table.generates(self.rank):
            return []
        r, rounds = self.cfg.rollout, generation_rounds(self.cfg.trainer)
        samples: list[Sample] = []
        signal = 0
        for round_ in range(rounds):
            prompts = self.task.batch(self.cfg.run.seed, batch, r.prompts_per_batch, r.samples_per_prompt, round_)
            first = round_ * r.prompts_per_batch          # prompt indices go on across rounds
            prompts = [dataclasses.replace(p, index=first + p.index) for p in prompts]
            mine = self._generate(it, batch, prompts, round_ if rounds > 1 else None)
            samples += mine
            if rounds > 1:
                signal += self._count_together(f"signal/{batch}/{round_}", len(differing_groups(mine)))
                if signal >= r.prompts_per_batch:
                    break
        return samples

    def _count_together(self, key: str, mine: int) -> int:
        """The sum of every rollout rank's `mine` under `key` (through the job's store: the train
        ranks, busy with their own stage, take no part)."""
        self.store.add(key, mine)
        if self.store.add(f"{key}/arrived", 1) == self.table.num_rollout:
            self.store.set(f"{key}/done", b"1")
        self.store.wait([f"{key}/done"], ROUND_WAIT)     # the slowest rank's round: the tail may be long
        return self.store.add(key, 0)

    def _generate(self, it: int, batch: int, prompts, round_: int | None) -> list[Sample]:
        """This rank's share of `prompts` (one round of the batch), generated and scored."""
        r, seed = self.cfg.rollout, self.cfg.run.seed
        assign = place_prompts([len(p.tokens) for p in prompts], self.table.num_rollout)
        mine = placement_lists(assign, self.table.num_rollout)[self.table.rollout_ranks().index(self.rank)]
        requests = [GroupRequest(prompts[i], tuple(sample_seed(seed, batch, prompts[i].index, j)
                                                   for j in range(r.samples_per_prompt)),
                                 first_index=prompts[i].index * r.samples_per_prompt) for i in mine]
        self.set_status(f"rollout (iteration {it}, batch {batch}{'' if round_ is None else f', round {round_}'}, "
                        f"{self.table.describe()})")
        tails = self._tail_roster(it)
        handoffs = []
        where = {} if round_ is None else {"round": round_}
        with self.rec.span(it, "rollout", self.role, batch=batch, groups=len(mine), **where) as ev:
            if tails is not None:
                finished, handoffs = self.engine.generate_until(requests, r.temperature, r.migration_threshold)
            else:
                finished = list(zip(requests, self.engine.generate(requests, r.temperature)))
            samples = self._samples(batch, finished, ev)
            ev["tokens"] = sum(len(s.response) for s in samples) + sum(h.generated for h in handoffs)
            self._engine_stats(ev)
            if self.cost:
                self.emulate(ev, self.cost.rollout_time([[len(g.tokens) for g in group] for _, group in finished],
                                                         [len(req.prompt.tokens) for req, _ in finished]))
        if tails is not None:
            samples += self._migrate(it, batch, tails, handoffs)
        return samples

    def _samples(self, batch: int, finished, event: dict) -> list[Sample]:
        """The scored samples of finished (request, generations) pairs (reward errors: on `event`)."""
        samples = [Sample(batch, req.first_index + j, req.prompt.index, self.rank, list(req.prompt.tokens),
                          g.tokens, g.logprobs, req.prompt.response_lens[j],
                          self.score(req.prompt, g.tokens, batch, req.first_index + j))
                   for req, group in finished for j, g in enumerate(group)]
        if self.score.failures:
            event["attrs"]["reward_errors"] = self.score.take_failures()
        return samples

    def _engine_stats(self, event: dict) -> None:
        """The engine's own counts (speculation's) on the event of the work that made them."""
        event["attrs"].update({k: v for k, v in self.engine.take_stats().items() if v})

    def _tail_roster(self, it: int) -> TailRoster | None:
        """This iteration's tail ranks, taken as rollout ranks reach their cut (None: no migration)."""
        if self.cfg.rollout.migration_threshold <= 0 or self.table.num_rollout < 2:
            return None
        return TailRoster(self.store, it, self.table.num_rollout, self.cfg.rollout.tail_ranks)

    def _migrate(self, it: int, batch: int, tails: TailRoster, handoffs: list[Handoff]) -> list[Sample]:
        """At this rank's cut: as one of the first to get there, a tail rank, it goes on with its
        own last sequences and admits what the later ranks hand it as it arrives; otherwise it
        hands its last sequences to a tail rank (one message, maybe empty) and is done."""
        ticket = tails.arrive(self.rank)
        if not tails.is_tail(ticket):
            self._hand_off(it, batch, tails.tail_of(ticket), handoffs)
            return []
        inbox = HandoffInbox(self.ctrl, batch, handoffs, tails.expected(ticket))
        if not handoffs and not inbox.left:
            return []
        self.set_status(f"migrate (iteration {it}, batch {batch}: tail rank for {inbox.left} ranks)")
        with self.rec.span(it, "rollout", self.role, batch=batch, tail=True) as ev:
            inject_fault(self.rank, "migrate")        # tests: a tail rank dies holding migrated sequences
            finished = [(h.request, gens) for h, gens in self.engine.continue_tail(inbox, self.cfg.rollout.temperature)]
            samples = self._samples(batch, finished, ev)
            ev["tokens"] = sum(len(s.response) for s in samples) - inbox.generated
            ev["attrs"].update(ranks=len(inbox.sources) + bool(handoffs),
                               groups=len(finished), sequences=inbox.sequences)
            self._engine_stats(ev)
        return samples

    def _hand_off(self, it: int, batch: int, tail: int, handoffs: list[Handoff]) -> None:
        """This rank's one message of the iteration to its tail rank: the groups it hands off."""
        sequences = sum(h.running for h in handoffs)
        self.set_status(f"migrate (iteration {it}, batch {batch}: {sequences} sequences to rank {tail})")
        with self.rec.span(it, "migrate", self.role, batch=batch, to=tail, groups=len(handoffs),
                           sequences=sequences) as ev:
            if handoffs:
                inject_fault(self.rank, "migrate")    # tests: a rank dies handing off its tail
            message = pickle.dumps((batch, handoffs))
            self.pending_sends.append(self.ctrl.post(message, tail, MIGRATE_TAG))
            ev["bytes"] = len(message)

    def exchange(self, it: int, samples: list[Sample] | None) -> list[Sample]:
        """Hand the generated samples to every rank (control plane); returns the whole batch."""
        self.set_status(f"exchange (iteration {it}, {self.table.describe()}, {self.role})")
        with self.rec.span(it, "exchange", self.role):
            parts = self.ctrl.allgather(samples or [])
        batch = sorted((s for part in parts for s in part), key=lambda s: s.index)
        self._new_samples.extend(batch)
        return batch

    def train(self, it: int, batch: list[Sample]) -> None:
        if not batch:
            return
        if self.cfg.trainer.filter_groups:       # DAPO's dynamic sampling: groups whose rewards differ
            kept = differing_groups(batch)[:self.cfg.rollout.prompts_per_batch]
            if len(kept) < self.cfg.rollout.prompts_per_batch and self.rank == 0:
                print(f"[dynaresize] warning: batch {batch[0].batch}: only {len(kept)} of "
                      f"{self.cfg.rollout.prompts_per_batch} prompt groups have rewards that differ after "
                      f"{self.cfg.trainer.filter_max_rounds} rounds (trainer.filter_max_rounds); training on "
                      f"them", flush=True)
            kept = set(kept)
            batch = [s for s in batch if s.prompt in kept]
            if not batch:
                return
        if not self.table.trains(self.rank):
            if self.helper is not None:
                self.steal(it, batch)
            return
        if self.table.colocated_mode:
            colocated_release(self, it)
        self.set_status(f"train (iteration {it}, batch {batch[0].batch}, {self.table.describe()})")
        with self.rec.span(it, "train", self.role, batch=batch[0].batch) as ev:
            device_s = MicroBatchClock(ev["start"], self.cost, self.ctrl.now)
            grad, info = self.trainer.compute_gradient(batch, self._queue(batch), each=device_s)  # + all-reduce
            if self.cost:
                before, step, after = self.cost.train_sync_parts(self.table.num_train)
                sums = self.cost.helper_sums_time(len(info["helpers"]), self.table.num_train,
                                                  self.cost.multi_node(self.world))
                self.emulate(ev, device_s.total + sums + before)
            self.trainer.resolve_pending()     # a resize's stage-in of this rank's new range, if still reading
            ready = self.ctrl.now()
            self.trainer.apply_gradient(grad)                        # optimizer step, all-gather
            add_step_sums(self._step_sums, info["sums"])
            if self.rank == 0:
                self._step = {"grad_norm": info["grad_norm"], "grad_norm_clipped": info["grad_norm_clipped"],
                              "lr": self.cfg.trainer.lr, **batch_figures(batch)}
            ev["tokens"] = info["tokens"]
            ev["attrs"].update(loss=round(info["loss"], 6), grad_norm=round(info["grad_norm"], 6),
                               micro_batches=info["micro_batches"])
            if info["helpers"]:
                ev["attrs"]["helpers"] = info["helpers"]
            if self.cost:                      # the step and the gather last their price after the wait
                self.emulate(ev, ready - ev["start"] + step + after)
        if self.table.colocated_mode:
            colocated_restore(self, it)

    def steal(self, it: int, batch: list[Sample]) -> None:
        """Work stealing on a rollout rank done generating: if what is left of the train step in
        progress is worth it (stealing.worth_joining), compute micro-batches no train rank has
        taken yet (one `steal` event each) and send their gradient sum to the train ranks (each
        its range)."""
        b, queue, k = batch[0].batch, self._queue(batch), self.table.num_train
        prices = self.prices.train_compute_time(queue.tokens, 1)
        send_s = self.prices.helper_sums_time(1, k, self.prices.multi_node(self.world))
        sleep_s, wake_s = self.prices.helper_engine_times(self.cfg.rollout.release)
        if not queue.join(prices, k, send_s + sleep_s + wake_s):
            return                                    # too little left to pay for joining
        self.set_status(f"steal (iteration {it}, batch {b}, {self.table.describe()})")
        self._helper_engine(it, "release", sleep_s)
        device_s = MicroBatchClock(self.ctrl.now(), self.cost, self.ctrl.now)
        last = [device_s.start]

        def each(i: int, tokens: int) -> None:
            inject_fault(self.rank, "steal")          # tests: a helper dies holding a claimed micro-batch
            device_s(i, tokens)
            end = self.ctrl.now()
            self.rec.record(it, "steal", self.role, last[0], end, tokens, batch=b, micro_batch=i)
            last[0] = end

        info = self.helper.help_step(batch, queue, self.table.train_ranks(), each)
        add_step_sums(self._step_sums, info["sums"])
        if self.cost and last[0] > device_s.start:     # emulation: the send of the sum lasts its price
            time.sleep(max(last[0] + send_s - self.ctrl.now(), 0.0))
        self._helper_engine(it, "engine_start", wake_s)

    def _helper_engine(self, it: int, op: str, price_s: float) -> None:
        """A helper's engine around its stolen micro-batches: vLLM sleeps (`release`) and wakes
        (`engine_start`; the weight sync loads the new weights after) so that the train step has
        the GPU's memory; emulated, each lasts its price. Beside the train ranks' step: background."""
        frees_memory = ENGINES[self.cfg.rollout.engine].manages_gpu_memory
        if not frees_memory and not (self.cost and price_s > 0):
            return
        attrs = {"restored": True} if op == "engine_start" else {"mode": self.cfg.rollout.release}
        with self.rec.span(it, op, self.role, critical=BACKGROUND, **attrs) as ev:
            if frees_memory:
                self.engine.release() if op == "release" else self.engine.restore()
            if self.cost:
                self.emulate(ev, price_s)

    def _queue(self, batch: list[Sample]) -> MicroBatchQueue | None:
        """The shared queue of this train step's micro-batches (None without work stealing)."""
        if not self.cfg.trainer.work_stealing:
            return None
        tokens = [micro_batch_tokens(mb) for mb in cut_micro_batches(batch, self.cfg.trainer.micro_batch_size)]
        return MicroBatchQueue(self.store, batch[0].batch, tokens, self.rank)

    def sync_weights(self, it: int) -> None:
        """Broadcast the updated weights from train rank 0 to every rollout rank."""
        # the status first: a rank that dies from here on is reported in the weight sync
        self.set_status(f"weight_sync (iteration {it}, {self.table.describe()}, "
                        f"{'sending' if self.rank == 0 else 'receiving' if self.table.generates(self.rank) else 'idle'})")
        inject_fault(self.rank, "weight_sync")      # tests: a rank dies at the stage's first line
        if self.table.colocated_mode:
            return                                   # every rank holds the trainer's weights already
        group = self.registry.get("sync", self.table.num_train)
        if self.sharded:                             # every train rank gathers, bucket by bucket
            with self.rec.span(it, "weight_sync", self.role) as ev:
                ev["bytes"] = self._sync_buckets(group)
                if self.cost:
                    self.emulate(ev, self.cost.weight_sync_time(ranks=1 + self.table.num_rollout))
            return
        if self.rank != 0 and not self.table.generates(self.rank):
            return
        with self.rec.span(it, "weight_sync", self.role) as ev:
            flat = (self.trainer.flat if self.rank == 0 else self.helper.flat if self.helper is not None
                    else torch.empty(self.layout.numel, device=self.device))
            dist.broadcast(flat, src=0, group=group)
            if self.engine is not None:
                self.engine.load_weights(self.layout.views(flat))
            ev["bytes"] = flat.numel() * flat.element_size()
            if self.cost:
                self.emulate(ev, self.cost.weight_sync_time(ranks=1 + self.table.num_rollout))

    def _sync_buckets(self, group) -> int:
        """sharding=full: the weights in buckets of trainer.weight_sync_bucket_mb, each gathered
        from the shards by the train group and broadcast by train rank 0 to the rollout ranks (the
        `sync` group), which load it into their engines; the bytes this rank sent or received."""
        layout, moved = self.layout, 0
        buckets = layout.buckets(self.cfg.trainer.weight_sync_bucket_mb << 20)
        gathered = self.trainer.gathered_buckets(layout, buckets) if self.trainer is not None else None
        for lo, hi in buckets:
            flat = next(gathered) if gathered is not None else torch.empty(layout.span(lo, hi), device=self.device)
            if self.rank == 0 or self.engine is not None:
                dist.broadcast(flat, src=0, group=group)
                moved += flat.numel() * flat.element_size()
            if self.engine is not None:
                self.engine.load_weights(layout.views(flat, lo, hi))
        return moved

    def evaluate(self, it: int) -> None:
        """Held-out evaluation (eval.*) with the weights of this iteration's sync: the generating
        ranks generate for the held-out prompts (placed as a batch is, by prompt length) and score
        them; rank 0 gathers the rewards into this iteration's eval/* metrics."""
        e, seed = self.cfg.eval, self.cfg.run.seed ^ HELD_OUT
        results = []
        if self.table.generates(self.rank):
            if self._held_out is None:
                self._held_out = self.task.held_out(self.cfg.run.seed, e.prompts, e.samples_per_prompt,
                                                    max_response_cap(self.cfg.workload))
            prompts, ranks = self._held_out, self.table.rollout_ranks()
            assign = place_prompts([len(p.tokens) for p in prompts], len(ranks))
            mine = placement_lists(assign, len(ranks))[ranks.index(self.rank)]
            requests = [GroupRequest(prompts[i], tuple(sample_seed(seed, 0, i, j) for j in range(e.samples_per_prompt)),
                                     first_index=i * e.samples_per_prompt) for i in mine]
            self.set_status(f"eval (iteration {it}, {len(mine)} held-out prompts)")
            with self.rec.span(it, "eval", self.role, groups=len(mine)) as ev:
                generated = self.engine.generate(requests, e.temperature)
                self._engine_stats(ev)
                for req, group in zip(requests, generated):
                    results += [(req.prompt.index, j, self.score(req.prompt, g.tokens, -1, req.first_index + j),
                                 len(g.tokens)) for j, g in enumerate(group)]
                ev["tokens"] = sum(r[3] for r in results)
                if self.cost:
                    self.emulate(ev, self.cost.rollout_time([list(req.prompt.response_lens) for req in requests],
                                                            [len(req.prompt.tokens) for req in requests]))
        parts = self.ctrl.gather(results)
        if self.rank == 0:
            from ..analysis.metrics import eval_metrics        # pandas: rank 0 only
            rows = sorted(r for part in parts for r in part)
            prompts = len(rows) // e.samples_per_prompt
            shape = (prompts, e.samples_per_prompt)
            self._eval = eval_metrics(np.array([r[2] for r in rows]).reshape(shape),
                                      np.array([r[3] for r in rows]).reshape(shape), e.pass_reward)

    def emulate(self, event: dict, device_s: float) -> None:
        """run.mode=emulate: stretch a stage or switch operation to `device_s`, the time the
        profile's device would take for this work (one that took longer stays longer); both times
        are recorded."""
        real = self.ctrl.now() - event["start"]
        if device_s > real:
            time.sleep(device_s - real)
        event["attrs"].update(real_s=round(real, 6), device_s=round(device_s, 6))

    def emulated_until(self, start: float, op: str, price: dict):
        """run.mode=emulate: a function that sleeps until switch operation `op`, begun at `start`,
        has lasted its price (for work that must not be seen done sooner, e.g. a staged file)."""
        end = start + self.cost.switch_op_time(op, **price)
        return lambda: time.sleep(max(end - self.ctrl.now(), 0.0))

    def end_iteration(self, it: int, generated: int | None, trained: int | None) -> Decision:
        """Gather events to rank 0, write the timeline, decide the next split, broadcast it."""
        self.settle_background()
        self.set_status(f"end_iteration (iteration {it}: gathering events, deciding the next split)")
        report = (self._t_begin, self.ctrl.now(), self.rec.take(), preemption.warned(), self._step_sums)
        reports = self.ctrl.gather(report)
        self._step_sums = {}
        decision, warned = None, False
        if self.rank == 0:
            warned = any(r[3] for r in reports)
            events = [e for r in reports for e in r[2]]
            start, end = min(r[0] for r in reports), max(r[1] for r in reports)
            # One set of numbers for the policy, the progress line and the user's metrics backends.
            step_sums: dict[str, float] = {}
            for r in reports:
                add_step_sums(step_sums, r[4])
            metrics = self.iteration_metrics(events, self._new_samples, start, end,
                                             {r: self.table.role_of(r).value for r in range(self.world)},
                                             self.table.num_train, self.table.num_rollout, step_sums, self._step,
                                             self.score.finished)
            metrics.update(self._eval)
            self._step, self._eval = {}, {}
            if self.cfg.log.generations_every > 0 and it % self.cfg.log.generations_every == 0 and self._new_samples:
                self.metrics.log_generations(it, self._generations(it))
            decision = self.policy.decide_timed(self._iteration_stats(it, metrics, generated, trained))
            self._write_timeline(it, events, start, end, generated, trained, decision, metrics)
            self.metrics.log(it, metrics)
            if "console" in self.cfg.logger:
                self._print_progress(it, metrics)
        self._new_samples = []
        decision, self.end_warned = self.ctrl.bcast((decision, warned))
        self._remove_staged_files()       # rank 0 broadcast only after every rank settled its reads
        return decision

    def checkpoint_if_due(self, it: int, ready: list[Sample], decision: Decision) -> None:
        """Checkpoint if due, or if Slurm warned of the job's end."""
        self.last_checkpoint = checkpoint.checkpoint_if_due(self, it, ready, decision, self.end_warned)

    def requeue(self) -> None:
        """After the checkpoint that Slurm's warning asked for: stop here; the job goes back in the
        queue and resumes from it (or stops at cluster.max_requeues: RequeueLimit on rank 0)."""
        self.suspend()
        if self.rank == 0:
            preemption.requeue(self.cfg.cluster.max_requeues, self.last_checkpoint)

    def suspend(self) -> None:
        """Stop without finishing: the timeline stays incomplete, to be continued on resume (from
        the checkpoint: staged state is not needed)."""
        if self.writer is not None:
            self.writer.close(complete=False)
            self.metrics.close()
        self._close_engines()
        self._remove_staging()
        dist.destroy_process_group()
        self.set_status("finished (suspended after a checkpoint, to be resumed)")

    def _remove_staging(self) -> None:
        if self.ctrl.local_rank == 0:
            remove_dir(self.staging_dir)
        self.ctrl.barrier()               # every node's, before the mark that would have them removed goes
        if self.rank == 0:
            remove_mark(self.run_dir, self.run_id)

    def _close_engines(self) -> None:
        for engine in (self.state.engine, self.state.parked_engine):
            if engine is not None:
                engine.close()

    def _remove_staged_files(self) -> None:
        for path in self.staged_files:
            if os.path.isdir(path):         # a fully sharded trainer's folder (rank 0 may be first)
                shutil.rmtree(path, ignore_errors=True)
            elif os.path.exists(path):
                os.remove(path)
        self.staged_files = []

    def finish(self) -> None:
        self.settle_background()
        self.set_status("finish (saving the model, closing the timeline)")
        self._remove_staged_files()
        if self.cfg.run.save_model:
            self._save_final_model(os.path.join(self.run_dir, "final_model"))
        self.ctrl.barrier()
        if self.writer is not None:
            self.writer.close(complete=True, end_time=self.ctrl.now(),
                              groups_created_at_startup=self.registry.creations_at_startup,
                              groups_created_after_startup=self.registry.created_after_startup,
                              **self.policy.decide_time_attrs())
            self.metrics.close()
            self._print_closing_summary()
        self._close_engines()
        self._remove_staging()
        dist.destroy_process_group()
        self.set_status("finished")

    def _save_final_model(self, path: str) -> None:
        """final_model/ in the Hugging Face format, written by rank 0 (a train rank); the fully
        sharded trainer's weights are gathered into rank 0's host memory first (collective)."""
        if not self.sharded:
            if self.rank == 0:
                save_model(self.trainer.model, path, tokenizer_from=self.model_dir)
            return
        full = self.trainer.full_state_dict() if self.trainer is not None else None
        if self.rank == 0:
            model = load_model(self.model_dir, "float32", "cpu")
            model.load_state_dict(full)
            save_model(model, path, tokenizer_from=self.model_dir)

    def _print_closing_summary(self) -> None:
        """Rank 0, after the timeline is closed: the run in three lines, and its report."""
        from dynaresize import analysis
        from dynaresize.analysis.report import closing_summary
        path = os.path.join(self.run_dir, TIMELINE_FILE)
        tl = analysis.load_timeline(path)
        report = analysis.write_report(tl) if self.cfg.run.report else None
        print(f"[dynaresize] done: timeline {path}", flush=True)
        for line in closing_summary(tl, report).splitlines():
            print(f"[dynaresize] {line}", flush=True)

    # --- rank 0 bookkeeping -------------------------------------------------------------------
    def _iteration_stats(self, it, metrics: dict, generated, trained) -> IterationStats:
        return IterationStats(it, self.table.num_train, self.world, metrics["time/rollout"], metrics["time/train"],
                              switch_time=metrics["time/switch_critical"],
                              generated_batch=-1 if generated is None else generated,
                              trained_batch=-1 if trained is None else trained,
                              lengths=batch_lengths(self._new_samples, self.cfg.rollout, self.cfg.trainer)
                              if self._new_samples else None)

    def _generations(self, it: int) -> list[dict]:
        """The first `log.generations` samples generated in iteration `it`, as text."""
        return [{"iteration": it, "batch": s.batch, "sample": s.index, "prompt": self.task.decode(s.prompt_tokens),
                 "response": self.task.decode(s.response), "reward": s.reward, "response_tokens": len(s.response),
                 "finished": self.score.finished(s.response)} for s in self._new_samples[:self.cfg.log.generations]]

    def _write_timeline(self, it, events, start, end, generated, trained, decision: Decision,
                        metrics: dict[str, float]) -> None:
        w = self.writer
        w.append("events", events)
        w.append("iterations", [{"iteration": it, "table_version": self.table.version,
                                 "train_ranks": self.table.num_train, "rollout_ranks": self.table.num_rollout,
                                 "start": start, "end": end,
                                 "trained_batch": -1 if trained is None else trained,
                                 "generated_batch": -1 if generated is None else generated}])
        w.append("samples", [{"iteration": it, "batch": s.batch, "index": s.index, "prompt": s.prompt,
                              "rank": s.rank, "prompt_len": len(s.prompt_tokens),
                              "response_len": len(s.response), "length_cap": s.length_cap,
                              "reward": s.reward, "digest": digest(s.response)} for s in self._new_samples])
        w.append("decisions", [decision.row(self.table.version + int(decision.moves))])
        w.append("metrics", [{"iteration": it, "name": name, "value": value} for name, value in metrics.items()])
        w.flush()

    def _print_progress(self, it, m: dict) -> None:
        """One line per iteration, numbered as the timeline, TensorBoard and the Gantt chart number
        it (from 0; then how far the run is). The pipeline's drain, which trains the last batch
        after the last iteration (max_lag 1), is not an iteration: its line says so."""
        n = self.cfg.run.iterations
        head = f"iter {it:>3} ({it + 1}/{n})" if it < n else f"{'drain':<{9 + 2 * len(str(n))}}"
        line = (f"[dynaresize] {head}  split {self.table.describe():>7}  rollout {m['time/rollout']:6.2f}s  "
                f"train {m['time/train']:6.2f}s  sync {m['time/weight_sync']:5.2f}s  bubble {m['bubble/all']:4.0%}")
        if it < n:
            line += f"  reward {m.get('reward/mean', float('nan')):.3f}  {m['throughput/tokens_per_s']:7.0f} tok/s"
        else:
            line += "  (the last batch trains)"
        print(line, flush=True)


class MicroBatchClock:
    """Called after each micro-batch of a train step: under run.mode=emulate it sleeps until the
    micro-batches so far have lasted the profile's price from `start` (`total`: that price);
    otherwise it only counts."""

    def __init__(self, start: float, cost: CostModel | None, now):
        self.start, self.cost, self.now, self.total = start, cost, now, 0.0

    def __call__(self, index: int, tokens: int) -> None:
        if self.cost is not None:
            self.total += float(self.cost.train_compute_time(tokens, 1))
            time.sleep(max(self.start + self.total - self.now(), 0.0))


def batch_lengths(samples: list[Sample], rollout, trainer) -> Lengths:
    """The prompt and response lengths of a generated batch (sample index = prompt x group size + j),
    its rounds and the groups the trainer takes (dynamic sampling: those whose rewards differ)."""
    spp, ppb = rollout.samples_per_prompt, rollout.prompts_per_batch
    prompts = max(s.prompt for s in samples) + 1
    prompt_lens = np.zeros(prompts, dtype=np.int64)
    response_lens = np.zeros((prompts, spp), dtype=np.int64)
    for s in samples:
        prompt_lens[s.prompt] = len(s.prompt_tokens)
        response_lens[s.prompt, s.index - s.prompt * spp] = len(s.response)
    if not trainer.filter_groups:
        return Lengths(prompt_lens, response_lens, np.arange(min(ppb, prompts)))
    trained = np.asarray(differing_groups(samples)[:ppb], dtype=np.int64)
    return Lengths(prompt_lens, response_lens, trained, (ppb,) * (prompts // ppb))


def resumed_split(old: RoleTable, world: int, unit: int) -> RoleTable:
    """The table a run resumed on `world` ranks starts with: the checkpoint's train ranks, as far
    as the new rank count leaves room for a rollout unit (a multiple of `unit`)."""
    k = max(unit, min(old.num_train, world - unit) // unit * unit)
    return RoleTable.split(world, k, old.version + 1)


def threads_per_rank(ctrl: ControlPlane) -> int:
    """Intra-op threads so the ranks on a node share its cores (at least one each)."""
    on_node = sum(1 for h in ctrl.allgather(os.uname().nodename) if h == os.uname().nodename)
    return max(1, (os.cpu_count() or 1) // on_node)
