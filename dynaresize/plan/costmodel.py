"""The cost model: how long each stage takes, as a function of the work it does.

One model for three uses: the emulation mode of the runtime (a stage lasts what the model says a
GPU would take), the cluster-scale simulator (dynaresize.sim) and calibration (dynaresize.plan.calibrate),
which fits the model to real timelines.

Every stage time is LINEAR in a small set of coefficients (seconds per unit of work), so that a
fit is a least-squares problem and a prediction is a dot product:

rollout (one rank)   base + per_group x groups + per_step x decode steps + per_token x tokens
                     + per_kv_token x sum over decode steps of the context tokens attended
                     + per_prompt_token x prompt tokens (prefill)
                     Decode steps: with `continuous` batching (vLLM) the rank's sequences are
                     list-scheduled into its slots (max_num_seqs, or fewer when the KV cache is
                     full: capacity from the profile's GPU memory), so without a queue the longest
                     sample sets the steps (the long tail) and with one the queue adds to it; with
                     `sequential` batching (the torch engine: one prompt group at a time) the steps
                     are the sum over groups of each group's longest sample. Tail speculation
                     (rollout.speculation) divides the steps after the point where a rank (a
                     group, sequential) has `below` sequences left by the acceptance length and
                     adds the draft positions verified and rejected to the tokens (Speculation).
train (one rank)     compute: per_micro_batch x micro-batches + per_token x tokens (forward+backward)
                     + per_logprob_token x tokens per forward-only pass the trainer runs (the
                     old-log-prob recompute, the reference model); per_token x RECOMPUTE_FACTOR
                     with activation checkpointing (the forward runs again in backward),
                     then the group's synchronisation: base + per_inverse_rank / k (the optimizer step
                     on a 1/k shard) + latency x log2 steps + per_byte x bytes of the gradient
                     all-reduce and the parameter all-gather.
weight_sync          base + latency x log2(ranks) + per_byte x bytes (broadcast) + load_per_byte x bytes
exchange             base + latency x log2(world) + per_token x tokens of the batch (control plane)
staging              base + bytes / disk bandwidth (write: stage_out, read: stage_in)
switch operations    commit, group_switch, release, engine_start (cold, or a wake-up of the rank's
                     released engine: colocated, or parked while the rank trained), weight_load
                     (local copy or broadcast), reshard (network transport)

The coefficients come from a hardware profile (hardware.py: analytic from hardware figures, or
fitted by calibration) and the model being priced.

This module needs numpy only (no torch, no MPI).
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from .hardware import (HardwareProfile, ModelSpec, ProfileError, analytic_coefficients, kv_capacity_tokens,
                       load_profile)
from .memory import TrainSettings, train_fits
from .sorting import stable_argsort

# Activation checkpointing runs each layer's forward again in backward: forward 2P + backward 4P
# FLOPs a token become 8P (Korthikanti et al., "Reducing Activation Recomputation in Large
# Transformer Models", arXiv:2205.05198: full recomputation costs one extra forward, ~33 %).
RECOMPUTE_FACTOR = 8.0 / 6.0


@dataclass(frozen=True)
class Speculation:
    """Tail speculation as the cost model prices it (rollout.speculation): once a rank (continuous
    batching) or a prompt group (sequential) has `below` running sequences or fewer (inf: from the
    start), each of them gains `acceptance` tokens a decode step on average, and a step computes
    1 + `tokens` positions of each (its last token and the draft). So the steps after that point
    are divided by the acceptance length, and the positions computed per token kept grow to
    (1 + tokens) / acceptance. The KV term stays as without speculation: a verify step reads a
    sequence's context once for all its positions (fewer reads than priced) but attends from more
    positions. Assumes a rank has more slots than `below` (a vLLM rank's hundreds)."""
    below: float
    tokens: int
    acceptance: float

    @classmethod
    def for_rollout(cls, rollout) -> "Speculation | None":
        """The speculation of a config.RolloutConfig (None when off)."""
        if rollout.speculation == "off":
            return None
        below = math.inf if rollout.speculation == "always" else rollout.speculation_below
        return cls(below, rollout.speculation_tokens, rollout.speculation_acceptance)

    @property
    def ends(self) -> int:
        """How many of a unit's last sequence ends `price` reads."""
        return 1 if math.isinf(self.below) else int(self.below) + 1

    def price(self, top, count, tokens) -> tuple[np.ndarray, np.ndarray]:
        """(decode steps, draft positions rejected) of units (ranks or groups) whose sequences end at
        plain decode steps of which `top[i]` are the largest, in descending order (at least
        `below` + 1 of them where the unit has more sequences; all where `below` is inf: then only
        the first is read), `count[i]` sequences holding `tokens[i]` tokens."""
        top = np.asarray(top, dtype=np.float64)
        count = np.asarray(count)
        if math.isinf(self.below):
            start, speculated = np.zeros(len(top)), np.asarray(tokens, dtype=np.float64)
        else:
            b = int(self.below)
            more = count > b
            start = np.where(more, top[:, min(b, top.shape[1] - 1)], 0.0)      # `below` sequences left
            speculated = np.where(more, top[:, :b].sum(axis=1) - b * start, tokens)
        steps = start + (top[:, 0] - start) / self.acceptance
        return steps, speculated * max((1 + self.tokens) / self.acceptance - 1, 0.0)


class Placement:
    """Prompt groups on `ranks` ranks (group i on rank assign[i]), sorted by rank once: what every
    schedule on this placement shares (the dynamic policy prices many batches with the same prompts,
    hence the same placement, at each split)."""

    def __init__(self, assign, ranks: int):
        self.assign = np.asarray(assign, dtype=np.int64)
        self.ranks = ranks
        self.groups = np.bincount(self.assign, minlength=ranks)
        self.order = stable_argsort(self.assign)     # each rank's groups, in index order
        self.starts = np.concatenate(([0], np.cumsum(self.groups)))
        self.held = np.flatnonzero(self.groups)


class GroupWork:
    """The work of each prompt group of a batch (its samples' tokens, the context they attend, its
    prompt tokens, its longest sample), whatever rank it runs on: computed once per batch, summed
    per rank for every placement priced (CostModel.placed_features)."""

    def __init__(self, prompt_lens, response_lens):
        self.response_lens = response_lens
        L = np.asarray(response_lens)
        P = np.asarray(prompt_lens, dtype=np.float64)
        self.samples = L.shape[1] if L.ndim == 2 else 0
        groups = len(L)
        if L.ndim == 2 and L.dtype.kind in "iu":
            # whole numbers, so every sum below is exact in float64 in any order: summed down the
            # contiguous samples-major copy (4 x faster than along the rows), the same values
            L, axis = np.ascontiguousarray(L.T, dtype=np.float64), 0
        else:
            L, axis = np.asarray(L, dtype=np.float64), 1
        self.tokens = L.sum(axis=axis)
        self.kv = P * self.tokens + (L * (L - 1) / 2).sum(axis=axis)
        self.prompt_tokens = P * self.samples
        self.longest = L.max(axis=axis) if L.size else np.zeros(groups)
        self._tops: dict[int, np.ndarray] = {}

    def top(self, n: int) -> np.ndarray:
        """[groups, min(n, samples)]: each group's n longest samples, longest first (kept)."""
        if n not in self._tops:
            L = np.asarray(self.response_lens, dtype=np.float64).reshape(len(self.tokens), -1)
            self._tops[n] = -np.sort(-L, axis=1)[:, :n]
        return self._tops[n]


def continuous_steps(placed: Placement, response_lens, slots, longest=None) -> np.ndarray:
    """Decode steps of every rank under continuous batching: rank r runs `slots[r]` sequences at
    once, admitting its sequences (group by group in index order) first come first served into the
    slot that frees first (list scheduling). Without a queue a rank takes its longest sequence's
    steps (`longest`: each group's longest sample, if known); a queued rank's is its list schedule.
    The dynamic policy calls this for every split it prices: plain lists in the loop, numpy around it."""
    steps = np.zeros(placed.ranks)
    if np.size(response_lens) == 0:
        return steps
    if longest is None:
        longest = np.asarray(response_lens).max(axis=1)
    order, starts, held = placed.order, placed.starts, placed.held
    steps[held] = np.maximum.reduceat(longest[order], starts[held])   # each rank's longest
    queued = _queued(placed, np.shape(response_lens)[1], slots)
    if len(queued):
        L = np.asarray(response_lens, dtype=np.int64)
        for r in queued.tolist():
            steps[r] = list_schedule(L[order[starts[r]:starts[r + 1]]].ravel().tolist(), int(slots[r]))[1]
    return steps


def continuous_top_ends(placed: Placement, work: GroupWork, slots, n: int) -> np.ndarray:
    """[ranks, n]: the n last decode steps at which a rank's sequences end under continuous_steps'
    schedule, last first (0 where a rank has fewer): without a queue its n longest samples, from
    its groups' own n longest; a queued rank's from its list schedule."""
    top = work.top(n)
    ends = np.zeros((placed.ranks, n))
    if not top.size:
        return ends
    # every group's longest samples in rank order, then each rank's sorted, longest first
    values = top[placed.order].ravel()
    rank = np.repeat(placed.assign[placed.order], top.shape[1])
    values = values[np.lexsort((-values, rank))]
    held = placed.held
    per_rank = placed.groups[held] * top.shape[1]
    for j in range(min(n, int(per_rank.max()))):
        has = per_rank > j
        ends[held[has], j] = values[placed.starts[held[has]] * top.shape[1] + j]
    L = np.asarray(work.response_lens, dtype=np.int64)
    for r in _queued(placed, work.samples, slots).tolist():
        lengths = L[placed.order[placed.starts[r]:placed.starts[r + 1]]].ravel()
        finish = np.asarray(list_schedule(lengths.tolist(), int(slots[r]))[0]) + lengths
        last = np.sort(finish)[::-1][:n]
        ends[r, :len(last)] = last
    return ends


def _queued(placed: Placement, samples: int, slots) -> np.ndarray:
    """The ranks whose sequences do not all fit in their slots at once (continuous batching)."""
    return np.flatnonzero(placed.groups * samples > np.asarray(slots, dtype=np.int64))


def list_schedule(lengths: list[int], slots: int) -> tuple[list[int], int]:
    """Continuous batching's admission: `slots` sequences run at once and the next waiting one (in
    order) takes the slot that frees first. Returns (the decode step at which each sequence starts,
    the step at which the last one ends)."""
    free = lengths[:slots]                        # the slots' free times (a heap)
    heapq.heapify(free)
    replace = heapq.heapreplace                   # returns the time it replaced: the next start
    return [0] * len(free) + [replace(free, free[0] + length) for length in lengths[slots:]], max(free, default=0)


def _first_node_ranks(hosts: Sequence[str]) -> int:
    """How many ranks, from rank 0, run on rank 0's node before another node's first rank; 0
    when every rank shares one node (CostModel.gpus_per_node's "one node")."""
    return next((r for r, host in enumerate(hosts) if host != hosts[0]), 0)


def _log2_steps(ranks) -> np.ndarray | float:
    r = np.maximum(np.asarray(ranks, dtype=np.float64), 1.0)
    out = np.ceil(np.log2(r))
    return float(out) if np.ndim(out) == 0 else out


class CostModel:
    """Stage durations for one job: a profile, the model being priced and the job's batch shape.

    All methods return seconds (already multiplied by the profile's `time_scale`).
    """

    def __init__(self, profile: HardwareProfile | str, model: ModelSpec | None = None, *,
                 samples_per_prompt: int = 4, micro_batch_size: int = 4, grad_reduce_bytes: int = 8,
                 reference_model: bool = False, recompute_logprobs: bool = False,
                 hosts: Sequence[str] | None = None, train_settings: TrainSettings | None = None,
                 speculation: Speculation | None = None):
        self.profile = load_profile(profile)
        self.model = self.profile.model or model
        if self.model is None:
            raise ProfileError(f"hardware profile {self.profile.name!r} has no model and none was given. "
                               f"Fix: give hardware.model or build the cost model with CostModel.for_job")
        self.samples_per_prompt = samples_per_prompt
        self.micro_batch_size = micro_batch_size
        self.grad_reduce_bytes = grad_reduce_bytes
        # forward-only passes the trainer runs before the update: reference model, old-log-prob recompute
        self.logprob_passes = int(reference_model) + int(recompute_logprobs)
        self.speculation = speculation       # tail speculation's pricing; None: plain decoding
        # what a train rank holds (plan/memory.py): which splits fit (None: every split), and the
        # recompute of activation checkpointing
        self.train_settings = train_settings
        checkpointing = train_settings is not None and train_settings.activation_checkpointing
        self.update_factor = RECOMPUTE_FACTOR if checkpointing else 1.0
        # The node of each rank: a running job's own (`hosts`), else the profile's layout. Train
        # groups are prefixes of the ranks, so what prices them is how many ranks share rank 0's node.
        self.hosts = list(hosts) if hosts is not None else None
        self.gpus_per_node = self.profile.gpus_per_node if hosts is None else _first_node_ranks(self.hosts)
        self.continuous = self.profile.batching == "continuous"
        self.max_num_seqs = self.profile.max_num_seqs
        self.scale = self.profile.time_scale
        if self.profile.kind == "fitted":
            self.coef = self.profile.coefficients
        else:
            self.coef = analytic_coefficients(self.profile, self.model)
        self.kv_capacity = kv_capacity_tokens(self.profile, self.model)

    @classmethod
    def for_job(cls, cfg, profile: HardwareProfile | str | Mapping, hosts: Sequence[str] | None = None) -> "CostModel":
        """The cost model of a job config (dynaresize.config.JobConfig); `hosts`: the node of each
        of its ranks where the job runs (ControlPlane.hostnames), None for the profile's layout."""
        profile = load_profile(profile)
        model = profile.model or ModelSpec.from_model_config(cfg.model)
        return cls(profile, model, samples_per_prompt=cfg.rollout.samples_per_prompt,
                   micro_batch_size=cfg.trainer.micro_batch_size,
                   grad_reduce_bytes=8 if cfg.trainer.grad_reduce_dtype == "float64" else 4,
                   reference_model=cfg.trainer.kl_coef > 0, recompute_logprobs=cfg.trainer.recompute_logprobs,
                   hosts=hosts, train_settings=TrainSettings.for_job(cfg, model),
                   speculation=Speculation.for_rollout(cfg.rollout))

    def train_fits(self, train_ranks: int) -> bool:
        """Whether each of `train_ranks` train ranks can hold its share (plan/memory.py)."""
        return self.train_settings is None or train_fits(self.profile, self.model, self.train_settings, train_ranks)

    # --- sizes the runtime moves ----------------------------------------------------------------
    @property
    def numel(self) -> int:
        """Parameters of the flat training vector (the priced model)."""
        return int(self.model.params)

    @property
    def weight_bytes(self) -> int:
        """Bytes of a weight sync or weight load: the runtime moves the float32 flat vector."""
        return 4 * self.numel

    def shard_bytes(self, shards: int) -> int:
        """Bytes of one rank's staged optimizer shard: float32 params, exp_avg, exp_avg_sq."""
        return 3 * 4 * (-(-self.numel // max(shards, 1)))

    def multi_node(self, ranks: int) -> bool:
        """Whether a group of `ranks` consecutive ranks (from rank 0) spans nodes."""
        return self.gpus_per_node > 0 and ranks > self.gpus_per_node

    def hostnames(self, ranks: int) -> list[str]:
        """The node of each of the first `ranks` ranks: the job's own hosts if given, else as the
        profile lays them out (gpus_per_node ranks a node, in rank order; one node without it)."""
        if self.hosts is not None:
            return self.hosts[:ranks]
        gpn = self.gpus_per_node
        return [f"node{r // gpn if gpn > 0 else 0}" for r in range(ranks)]

    # --- rollout -----------------------------------------------------------------------------
    # A rank's rollout: prefill, then decode steps. Every step costs per_step_s (reading the
    # weights, host work) plus per_token_s per running sequence plus per_kv_token_s per context
    # token attended, so the time is linear in (steps, tokens, kv, prompt tokens); the schedule
    # only decides the number of steps:
    # - sequential batching (the torch engine): one group after another, a group runs until its
    #   longest sample ends;
    # - continuous batching (vLLM): sequences are admitted in order into `slots` concurrent ones
    #   (max_num_seqs, or fewer when the KV cache fills: slots = KV capacity / the mean context a
    #   running sequence holds) and a freed slot takes the next waiting one; the rank ends when its
    #   last sequence does. Without a queue, the longest sample sets the steps (the long tail).
    #   Preemption and recompute when the cache overflows are not modelled (vLLM's default
    #   recompute preemption would only add work).

    def rollout_rank_features(self, assign, prompt_lens, response_lens, ranks: int,
                              schedule: bool = True) -> dict[str, np.ndarray]:
        """Work of every rollout rank: prompt group i (prompt_lens[i] tokens; its samples' response
        lengths response_lens[i, :]) runs on rank assign[i]; a rank admits its groups in index
        order. schedule=False leaves out the decode steps (the only part that needs a schedule)."""
        return self.placed_features(Placement(assign, ranks), GroupWork(prompt_lens, response_lens), schedule)

    def placed_features(self, placed: Placement, work: GroupWork, schedule: bool = True) -> dict[str, np.ndarray]:
        """rollout_rank_features from the placement and the groups' work (each possibly kept)."""
        assign, ranks = placed.assign, placed.ranks
        tokens = np.bincount(assign, weights=work.tokens, minlength=ranks)
        kv = np.bincount(assign, weights=work.kv, minlength=ranks)
        f = {"base": np.ones(ranks), "groups": placed.groups.astype(np.float64), "tokens": tokens, "kv": kv,
             "prompt_tokens": np.bincount(assign, weights=work.prompt_tokens, minlength=ranks)}
        if not schedule:
            return f
        spec = self.speculation
        if self.continuous:
            slots = self.decode_slots(tokens, kv)
            if spec is None:
                f["steps"] = continuous_steps(placed, work.response_lens, slots, work.longest)
            else:
                f["steps"], f["draft_tokens"] = spec.price(continuous_top_ends(placed, work, slots, spec.ends),
                                                           placed.groups * work.samples, tokens)
        elif spec is None:
            f["steps"] = np.bincount(assign, weights=work.longest, minlength=ranks)
        else:                          # sequential: each group on its own
            steps, drafts = spec.price(work.top(spec.ends), np.full(len(work.tokens), work.samples), work.tokens)
            f["steps"] = np.bincount(assign, weights=steps, minlength=ranks)
            f["draft_tokens"] = np.bincount(assign, weights=drafts, minlength=ranks)
        return f

    def decode_slots(self, tokens, kv) -> np.ndarray:
        """Concurrent sequences of a rank: max_num_seqs, or what its KV cache holds at the mean
        context a running sequence keeps (kv / tokens: the context attended per decoded token)."""
        tokens = np.asarray(tokens, dtype=np.float64)
        kv = np.asarray(kv, dtype=np.float64)
        slots = np.full(tokens.shape, float(self.max_num_seqs))
        if math.isfinite(self.kv_capacity):
            context = np.where(tokens > 0, kv / np.maximum(tokens, 1.0), 1.0)
            slots = np.minimum(slots, np.floor(self.kv_capacity / np.maximum(context, 1.0)))
        return np.maximum(slots, 1.0).astype(np.int64)

    def rollout_times(self, assign, prompt_lens, response_lens, ranks: int) -> np.ndarray:
        """Seconds of every rollout rank: prompt group i (prompt_lens[i] tokens, its samples'
        response lengths response_lens[i, :]) runs on rank assign[i]."""
        return self.rollout_from_features(self.rollout_rank_features(assign, prompt_lens, response_lens, ranks))

    def rollout_cuts(self, assign, prompt_lens, response_lens, ranks: int,
                     threshold: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Tail migration under continuous batching: the seconds at which each rollout rank is down
        to `threshold` or fewer unfinished sequences (its cut; with 0, its end: rollout_times), and
        the sequences it has left then, each as (its rank, tokens still to generate, context tokens
        so far). A rank admits its groups in index order, as rollout_rank_features."""
        if not self.continuous:
            raise ValueError("tail migration is priced for continuous batching only (a GPU profile)")
        c = self.coef.rollout
        P, L = np.asarray(prompt_lens, dtype=np.float64), np.asarray(response_lens, dtype=np.int64)
        assign = np.asarray(assign, dtype=np.int64)
        spp = L.shape[1]
        # every sequence, ordered as a rank admits them: its groups in index order, samples in order
        order = stable_argsort(assign)
        rank = np.repeat(assign[order], spp)
        prompt = np.repeat(P[order], spp)
        length = L[order].ravel()
        n = np.bincount(rank, minlength=ranks)
        first = np.concatenate(([0], np.cumsum(n)[:-1]))
        tokens = np.bincount(rank, weights=length, minlength=ranks)
        kv = np.bincount(rank, weights=prompt * length + length * (length - 1) / 2, minlength=ranks)
        slots = self.decode_slots(tokens, kv)
        start = np.zeros(len(length), dtype=np.int64)
        for r in np.flatnonzero(n > slots).tolist():          # queued ranks: continuous batching's admission
            start[first[r]:first[r] + n[r]] = list_schedule(length[first[r]:first[r] + n[r]].tolist(),
                                                            int(slots[r]))[0]
        end = start + length
        groups = np.bincount(assign, minlength=ranks).astype(np.float64)
        fixed = c.base_s + c.per_group_s * groups + c.per_prompt_token_s * np.bincount(rank, weights=prompt,
                                                                                        minlength=ranks)
        # the step of the cut: when the rank's (n - threshold)-th sequence ends
        ends = end[np.lexsort((end, rank))]                    # by rank, then by end
        pos = np.minimum(first + np.maximum(n - threshold - 1, 0), max(len(end) - 1, 0))
        cut = np.where(n > threshold, ends[pos] if len(end) else 0, 0).astype(np.float64)
        done = np.clip(cut[rank] - start, 0, length)
        cut_s = self.scale * (fixed + c.per_step_s * cut
                              + c.per_token_s * np.bincount(rank, weights=done, minlength=ranks)
                              + c.per_kv_token_s * np.bincount(rank, weights=done * prompt + done * (done - 1) / 2,
                                                               minlength=ranks))
        left = done < length
        return cut_s, rank[left], (length - done)[left], (prompt + done)[left]

    def tail_times(self, arrive_s, remaining, context) -> np.ndarray:
        """Continuous batching on a tail rank that admits sequences while it runs (tail migration):
        sequence i arrives at `arrive_s[i]` with `remaining[i]` tokens to generate after
        `context[i]` tokens (prompt + prefix, re-prefilled when it is admitted). It joins the running
        batch at the next step (first come first served into the rank's slots), and every step costs
        what it costs a rollout rank: per_step + per_token x running + per_kv_token x their
        contexts. Returns the second at which each sequence ends. Between two events (an arrival, a
        sequence ending) the running set is fixed, so the steps of the gap are summed in closed form."""
        c, scale = self.coef.rollout, self.scale
        arrive = np.asarray(arrive_s, dtype=np.float64)
        rem = np.asarray(remaining, dtype=np.int64)
        ctx = np.asarray(context, dtype=np.float64)
        end = np.zeros(len(arrive))
        if not len(arrive):
            return end
        slots = int(self.decode_slots(rem.sum(), (ctx * rem + rem * (rem - 1) / 2).sum()))
        order = np.argsort(arrive, kind="stable").tolist()
        arrive_l, rem_l, ctx_l = arrive.tolist(), rem.tolist(), ctx.tolist()
        clock, step = arrive_l[order[0]] + scale * c.base_s, 0
        running: list[tuple[int, int]] = []      # (the step it ends at, sequence): a heap
        waiting: list[int] = []
        offset = 0.0                             # sum over running of context - admission step
        nxt = 0
        while nxt < len(order) or running or waiting:
            while nxt < len(order) and arrive_l[order[nxt]] <= clock:
                waiting.append(order[nxt])
                nxt += 1
            if not running and not waiting:
                clock = max(clock, arrive_l[order[nxt]])
                continue
            while waiting and len(running) < slots:
                i = waiting.pop(0)
                clock += scale * (c.per_group_s + c.per_prompt_token_s * ctx_l[i])
                heapq.heappush(running, (step + max(rem_l[i], 1), i))
                offset += ctx_l[i] - step
            n = len(running)
            first = scale * (c.per_step_s + c.per_token_s * n + c.per_kv_token_s * (offset + n * step))
            grow = scale * c.per_kv_token_s * n  # each step attends n more context tokens
            steps = running[0][0] - step         # to the next sequence's end ...
            if nxt < len(order):                 # ... or to the step the next arrival joins
                gap = arrive_l[order[nxt]] - clock
                if gap < steps * first + grow * steps * (steps - 1) / 2:
                    need = gap / first if grow == 0 else \
                        ((grow / 2 - first) + math.sqrt((first - grow / 2) ** 2 + 2 * grow * gap)) / grow
                    steps = min(max(math.ceil(need), 1), steps)
            clock += steps * first + grow * steps * (steps - 1) / 2
            step += steps
            while running and running[0][0] <= step:
                ends_at, i = heapq.heappop(running)
                end[i] = clock
                offset -= ctx_l[i] - (ends_at - max(rem_l[i], 1))
        return end

    def rollout_features(self, groups: Sequence, prompt_lens: Sequence[int] | None = None,
                         samples_per_prompt: int | None = None) -> dict[str, float]:
        """Work of one rank's rollout: `groups` is one entry per prompt group, either the response
        lengths of its samples (a list) or one length for all `samples_per_prompt` samples (an int).
        `prompt_lens`: prompt tokens of each group (default 0)."""
        spp = samples_per_prompt or self.samples_per_prompt
        lens = [list(g) if isinstance(g, (list, tuple, np.ndarray)) else [g] * spp for g in groups]
        width = max((len(g) for g in lens), default=spp)
        if any(len(g) != width for g in lens):
            raise ValueError("rollout_features: every prompt group needs the same number of samples")
        L = np.asarray(lens, dtype=np.float64).reshape(len(lens), width)
        plens = np.zeros(len(lens)) if prompt_lens is None else np.asarray(prompt_lens, dtype=np.float64)
        f = self.rollout_rank_features(np.zeros(len(lens), dtype=np.int64), plens, L, 1)
        return {k: float(v[0]) for k, v in f.items()}

    def rollout_time(self, groups: Sequence, prompt_lens: Sequence[int] | None = None,
                     samples_per_prompt: int | None = None) -> float:
        """Seconds one rollout rank takes to generate `groups` (see rollout_features)."""
        return self.rollout_from_features(self.rollout_features(groups, prompt_lens, samples_per_prompt))

    def rollout_from_features(self, f: Mapping[str, Any]):
        c = self.coef.rollout
        t = (c.base_s * f["base"] + c.per_group_s * f["groups"] + c.per_step_s * f["steps"]
             + c.per_token_s * (f["tokens"] + f.get("draft_tokens", 0.0)) + c.per_kv_token_s * f["kv"]
             + c.per_prompt_token_s * f["prompt_tokens"])
        return t * self.scale

    # --- what no split can beat ----------------------------------------------------------------
    def longest_decode_time(self, prompt_lens, response_lens) -> float:
        """The batch's longest sample generated alone on one rank: decode is sequential, so no
        number of rollout ranks finishes the batch sooner."""
        response_lens = np.asarray(response_lens)
        i, j = np.unravel_index(np.argmax(response_lens), response_lens.shape)
        return self.rollout_time([[int(response_lens[i, j])]], [int(np.asarray(prompt_lens)[i])])

    def rollout_work(self, prompt_lens, response_lens) -> float:
        """Rank-seconds of generating the batch with every step at full concurrency (no tail)."""
        f = self.rollout_rank_features(np.zeros(len(response_lens), dtype=np.int64), prompt_lens, response_lens, 1,
                                       schedule=False)
        f = {k: float(v[0]) for k, v in f.items()}
        concurrency = float(self.decode_slots(f["tokens"], f["kv"])) if self.continuous else self.samples_per_prompt
        f["steps"] = f["tokens"] / concurrency
        return float(self.rollout_from_features(f))

    # --- training ----------------------------------------------------------------------------
    def train_compute_time(self, tokens, micro_batches=1):
        """Forward-only log-prob passes (when the trainer runs them) and forward and backward of the
        update, of one train rank over `tokens` in `micro_batches`."""
        c = self.coef.train
        per_token = c.per_token_s * self.update_factor + self.logprob_passes * c.per_logprob_token_s
        return (c.per_micro_batch_s * np.asarray(micro_batches, dtype=np.float64)
                + per_token * np.asarray(tokens, dtype=np.float64)) * self.scale

    def train_pass_times(self, tokens) -> dict[str, float]:
        """Seconds of each pass over `tokens` on one rank: log-prob (one forward-only pass, e.g. the
        old-log-prob recompute or the reference model) and update (forward + backward)."""
        c = self.coef.train
        return {"logprob": c.per_logprob_token_s * tokens * self.scale,
                "update": c.per_token_s * self.update_factor * tokens * self.scale}

    def train_sync_parts(self, train_ranks: int) -> tuple[float, float, float]:
        """(before the optimizer step: base + gradient all-reduce; the optimizer step on a 1/k shard;
        after it: the parameter all-gather) for a train group of `train_ranks`."""
        c, k = self.coef.train, max(int(train_ranks), 1)
        per_byte = c.per_byte_inter_s if self.multi_node(k) else c.per_byte_intra_s
        reduce = gather = 0.0
        if k > 1:
            steps = _log2_steps(k)
            reduce = 2 * steps * c.latency_s + per_byte * 2 * (k - 1) / k * self.grad_reduce_bytes * self.numel
            gather = steps * c.latency_s + per_byte * (k - 1) / k * 4 * self.numel
        return ((c.base_s + reduce) * self.scale, c.per_inverse_rank_s / k * self.scale, gather * self.scale)

    def helper_sums_time(self, helpers: int, train_ranks: int, multi_node: bool) -> float:
        """Work stealing: the gradient sums (grad_reduce_bytes a parameter) of `helpers` helpers on
        their way to the train ranks, each cut into the train ranks' ranges, one to each: a train
        rank receives `helpers` slices of 1/k of the vector, a helper sends its whole vector."""
        if helpers <= 0:
            return 0.0
        c, k = self.coef.train, max(int(train_ranks), 1)
        per_byte = c.per_byte_inter_s if multi_node else c.per_byte_intra_s
        nbytes = self.grad_reduce_bytes * self.numel
        receive = helpers * (c.latency_s + per_byte * nbytes / k)
        return max(receive, k * c.latency_s + per_byte * nbytes) * self.scale

    def helper_engine_times(self, release_mode: str) -> tuple[float, float]:
        """Work stealing: (release, wake) of a helper's engine around its stolen micro-batches. On
        a GPU profile (continuous batching: vLLM, which holds gpu_memory_utilization of the GPU)
        the engine must sleep while the rank trains; the CPU engine holds no GPU memory."""
        if not self.continuous:
            return 0.0, 0.0
        return (self.switch_op_time("release", release_mode=release_mode),
                self.switch_op_time("engine_start", restore=True, release_mode=release_mode))

    def train_sync_time(self, train_ranks: int) -> float:
        return float(sum(self.train_sync_parts(train_ranks)))

    def train_time(self, tokens: int, train_ranks: int, micro_batches: int = 1) -> float:
        """Seconds of one train rank's update: its forward/backward over `tokens` (prompt + response
        tokens of its micro-batches) and the group's synchronisation and optimizer step."""
        return float(self.train_compute_time(tokens, micro_batches)) + self.train_sync_time(train_ranks)

    def train_stage_time(self, batch_tokens: int, train_ranks: int, micro_batches: int | None = None) -> float:
        """The train stage with the batch spread evenly over `train_ranks`."""
        k = max(int(train_ranks), 1)
        mb = micro_batches if micro_batches is not None else 1
        return self.train_time(math.ceil(batch_tokens / k), k, math.ceil(mb / k))

    # --- data movement -----------------------------------------------------------------------
    def broadcast_time(self, nbytes: int, ranks: int, multi_node: bool | None = None) -> float:
        """A broadcast of `nbytes` from one rank to a group of `ranks` (pipelined: bandwidth-bound)."""
        c = self.coef.sync
        if ranks <= 1:
            return c.base_s * self.scale
        multi = self.multi_node(ranks) if multi_node is None else multi_node
        per_byte = c.per_byte_inter_s if multi else c.per_byte_intra_s
        return (c.base_s + c.latency_s * _log2_steps(ranks) + per_byte * nbytes) * self.scale

    def weight_sync_time(self, nbytes: int | None = None, ranks: int = 2, multi_node: bool | None = None) -> float:
        """Train rank 0 broadcasts the weights to the rollout ranks (`ranks` = 1 + rollout ranks),
        which load them into their engines."""
        nbytes = self.weight_bytes if nbytes is None else nbytes
        return self.broadcast_time(nbytes, ranks, multi_node) + self.coef.sync.load_per_byte_s * nbytes * self.scale

    def exchange_time(self, tokens: int, world: int) -> float:
        """The control-plane hand-over of the generated batch (`tokens`: its prompt + response
        tokens) to every rank."""
        c = self.coef.exchange
        return (c.base_s + c.latency_s * _log2_steps(world) + c.per_token_s * tokens) * self.scale

    def staging_time(self, nbytes: int, write: bool = True) -> float:
        """Spilling (write) or reading back (read) `nbytes` of optimizer state on node-local disk."""
        c = self.coef.staging
        if write:
            return (c.write_base_s + c.write_per_byte_s * nbytes) * self.scale
        return (c.read_base_s + c.read_per_byte_s * nbytes) * self.scale

    def reshard_time(self, nbytes: int, ranks: int, messages: int) -> float:
        """Network transport among the `ranks` of the train block (switchplan.reshard_load): point
        to point, all messages at once; it lasts as long as the rank that moves the most, `nbytes`
        in `messages` messages (each pays a collective step's latency)."""
        c = self.coef.sync
        multi = self.multi_node(ranks)
        per_byte = c.per_byte_inter_s if multi else c.per_byte_intra_s
        return (c.base_s + messages * c.latency_s + per_byte * nbytes) * self.scale

    # --- switch operations -------------------------------------------------------------------
    def switch_op_time(self, name: str, nbytes: int = 0, ranks: int = 1, messages: int = 1,
                       restore: bool = False, release_mode: str = "sleep", colocated: bool | None = None) -> float:
        """One switch operation (schema.SWITCH_OPS) on one rank.

        commit: all `ranks` acknowledge the new table; release: free the engine's memory
        (`release_mode` = rollout.release: sleep or teardown cost release_s, keep costs nothing);
        engine_start: a new engine (cold start), or with restore=True the rank's released engine
        back (sleep: a wake-up, engine_wake_s; teardown: a cold start; keep: nothing) - a rank
        returning to rollout with a parked engine, or a colocated rank after training
        (colocated=True is restore=True); weight_load: `ranks`=1 copies the rank's own weights into
        its engine, more broadcasts them from train rank 0; stage_out / stage_in: write / read
        `nbytes`; reshard: see reshard_time; group_switch: a registry lookup.
        """
        o = self.coef.ops
        restore = restore or bool(colocated)
        if name == "commit":
            return (o.commit_s + self.coef.sync.latency_s * _log2_steps(ranks)) * self.scale
        if name == "group_switch":
            return o.group_switch_s * self.scale
        if name == "release":
            return (0.0 if release_mode == "keep" else o.release_s) * self.scale
        if name == "engine_start":
            if restore and release_mode == "keep":
                return 0.0
            return (o.engine_wake_s if restore and release_mode == "sleep" else o.engine_start_s) * self.scale
        if name == "weight_load":
            if ranks <= 1:
                return (o.weight_load_local_s + o.weight_load_local_per_byte_s * nbytes) * self.scale
            return self.broadcast_time(nbytes, ranks)
        if name == "stage_out":
            return self.staging_time(nbytes, write=True)
        if name == "stage_in":
            return self.staging_time(nbytes, write=False)
        if name == "reshard":
            return self.reshard_time(nbytes, ranks, messages)
        if name == "drain":
            return o.drain_s * self.scale
        raise ValueError(f"unknown switch operation {name!r}")

    def iteration_overhead(self) -> float:
        return self.coef.run.iteration_overhead_s * self.scale

    def startup_time(self) -> float:
        return self.coef.run.startup_s * self.scale

    def describe(self) -> str:
        m = self.model
        return (f"{self.profile.name} ({self.profile.kind}, {self.profile.batching} batching), model "
                f"{m.name} {m.params / 1e9:.3g}B params")
