"""Metrics of a run, per iteration and per run. The definitions below are the only ones used.

Definitions
-----------
Iterations
    Only iterations that have a row in the ``iterations`` dataset count (a run that was killed
    mid-iteration leaves events and samples of the iteration in flight; they are ignored).
    The *span* of an iteration is ``[start, end]`` of its ``iterations`` row.

Role of a rank in an iteration
    The ``role`` of the rank's events in that iteration (train, rollout, both). If they carry
    more than one role, the role with the longest total duration of stage events (schema.STAGES)
    wins, else the longest of any event. A rank with no event in an iteration has role ``none``.
    The ranks are 0..world_size-1 (file attribute) plus any other rank that has events.

Busy time of a rank in an iteration
    The length of the UNION of its intervals of events named in schema.STAGES except
    ``exchange``, plus schema.SWITCH_OPS, each clipped to the span. ``exchange`` is a blocking
    control-plane handoff, mostly waiting, so it is not busy. Background switch ops overlap
    stages, hence the union, not the sum. Bookkeeping events (schema.OTHER) are not busy.

Idle (bubble) time of a rank in an iteration
    span length - busy time.

Bubble share of a role
    sum of idle over the ranks of that role / (span x number of ranks of that role); per
    iteration, or per run with both sums taken over all iterations.

Switch work
    Sum of the durations (end - start, not clipped) of switch-op events (schema.SWITCH_OPS).
    *Critical* switch time: of those with ``critical == 1`` (they blocked the next stage);
    *hidden* switch time: the rest (total - critical). Hidden share = 1 - critical / total
    (NaN when there is no switch op).

Resizes
    Policy decisions with action ``move``.

Stage times of an iteration
    Rollout time: max over ranks of the rank's summed ``rollout`` event durations in that
    iteration. Train time: the same for ``train`` events (which only train ranks have).
    Weight-sync time: the same for ``weight_sync`` events.

Throughput
    Generated response tokens per second (sum of ``samples.response_len`` / time) and samples
    per second. Per run the time is the total time, last iteration end - first iteration start;
    per iteration it is the span and the samples are those generated in that iteration
    (``samples.iteration``). Mean reward, mean and p99 response length (linear interpolation,
    numpy's default) are over the same samples.

GPU-time by state (per run, per role)
    Over all iterations and ranks, with the rank's role in each iteration: total (span x
    ranks), busy, idle (total - busy) and switching (length of the union of switch-op intervals,
    clipped to the span). Switching is part of busy time, so busy + idle = total. GPU time
    between iterations (gaps between one iteration's end and the next one's start) is not in any
    role; it is reported as ``outside_iterations_s``.

Policy decisions
    The rows of ``decisions``, with action and reason.

Prediction error
    For each decision that records ``predicted_s`` (the time it predicted for the next
    iteration, a move's switch included): predicted / measured span of that iteration - 1.
    ``prediction_error_median`` is the median of its absolute value over the run.

The policy's own time
    ``decide_s_median`` and ``decide_s_total``: the wall time of rank 0's decisions on the
    machine that ran it (file attributes of the same names); ``decide_share``: their total / the
    run's time. A real run's time includes the decisions (every rank waits for them); a
    simulated run's time leaves them out unless ``sim.charge_decisions`` (the suite's default)
    starts each next iteration after its decision's wall time.

Training metrics (train/*, of the batch trained in the iteration)
    From the train step's own numbers, summed over its micro-batches on every rank that computed
    some (train ranks and work-stealing helpers) and averaged over the batch's response tokens:
    ``train/policy_loss`` the clipped surrogate loss -min(r A, clip(r) A), with r the ratio of
    the policy's to the behaviour policy's token probability and A the GRPO advantage;
    ``train/loss`` the loss the step minimised (the policy loss plus ``trainer.kl_coef`` x KL);
    ``train/kl_ref`` the k3 estimate of KL(policy || reference) (only with trainer.kl_coef > 0);
    ``train/kl_behaviour`` the k3 estimate of KL(behaviour || policy), how far the weights moved
    from those that generated the batch; ``train/entropy`` the entropy of the policy's next-token
    distribution; ``train/clip_fraction`` the share of tokens whose clipped term was the larger
    loss; ``train/ratio_mean`` and ``train/ratio_max`` the ratio's mean and maximum. Of the whole
    step: ``train/grad_norm`` the global gradient norm before clipping, ``train/grad_norm_clipped``
    after it (``trainer.grad_clip``), ``train/lr`` the learning rate, ``train/advantage_mean`` and
    ``train/advantage_std`` over the batch's samples, ``train/zero_variance_groups`` the share of
    its prompt groups whose rewards are all equal (they carry no signal in GRPO).

Evaluation metrics (eval/*, in the iterations that evaluate: eval.every)
    Over the held-out prompts, each generated `eval.samples_per_prompt` = k times with the weights
    of the iteration's weight sync: ``eval/reward_mean`` the mean reward of every sample,
    ``eval/pass@k`` the share of prompts with at least one of their k samples at
    ``eval.pass_reward`` or more, ``eval/response_length_mean`` the mean response length.

Generation metrics (of the samples generated in the iteration)
    ``reward/mean``, ``reward/std``, response and prompt lengths, and ``response/truncated``: the
    share of responses cut at the length cap (not ended by the model's end-of-sequence token).

Over 400 lines on purpose: the definitions above and the only code that computes them stay side
by side, so that a reader checks one against the other in one file.
"""
from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd

from dynaresize.timeline import schema

from .load import Timeline

BUSY_NAMES = tuple(s for s in schema.STAGES if s != "exchange") + schema.SWITCH_OPS
ROLES = ("train", "rollout", "both")      # roles that get a bubble share
STATE_ROLES = schema.ROLES                # roles in the GPU-time table (includes "none")


# ---------------------------------------------------------------------------------------------
# Interval arithmetic (vectorised)

def merge_intervals(group: np.ndarray, start: np.ndarray, end: np.ndarray):
    """Merge overlapping intervals within each group.

    Returns ``(group, start, end)`` of the disjoint merged segments, sorted by group then start.
    Intervals that touch are merged. Empty input gives empty arrays.
    """
    group = np.asarray(group, dtype=np.int64)
    start = np.asarray(start, dtype=np.float64)
    end = np.asarray(end, dtype=np.float64)
    if len(group) == 0:
        return group, start, end
    order = np.lexsort((start, group))
    g, s, e = group[order], start[order], end[order]
    # Latest end seen so far within the group: an interval starting after it opens a segment.
    reach = pd.Series(e).groupby(g, sort=False).cummax().to_numpy()
    opens = np.ones(len(g), dtype=bool)
    opens[1:] = (g[1:] != g[:-1]) | (s[1:] > reach[:-1])
    first = np.flatnonzero(opens)
    return g[first], s[first], np.maximum.reduceat(e, first)


def union_length(group: np.ndarray, start: np.ndarray, end: np.ndarray, n_groups: int) -> np.ndarray:
    """Length of the union of the intervals of each group 0..n_groups-1."""
    g, s, e = merge_intervals(group, start, end)
    return np.bincount(g, weights=e - s, minlength=n_groups)[:n_groups]


def iteration_bubble(events: list[dict], start: float, end: float, world: int) -> float:
    """The idle share of one iteration's rank-time (the module's definition: the union of each
    rank's busy events, clipped to the span) from the iteration's raw events (dicts with rank,
    name, start, end), for a job's progress line while it runs."""
    busy = [e for e in events if e["name"] in BUSY_NAMES]
    rank = np.array([e["rank"] for e in busy], dtype=np.int64)
    s = np.maximum(np.array([e["start"] for e in busy], dtype=np.float64), start)
    t = np.minimum(np.array([e["end"] for e in busy], dtype=np.float64), end)
    keep = t > s
    busy_s = union_length(rank[keep], s[keep], t[keep], world).sum() if keep.any() else 0.0
    return 1.0 - busy_s / (max(end - start, 1e-12) * world)


# ---------------------------------------------------------------------------------------------
# Per (iteration, rank) table

def spans(tl: Timeline) -> pd.DataFrame:
    """The iterations rows (one per iteration, sorted), with ``span_s = end - start``."""
    if "spans" not in tl.cache:
        its = tl.iterations.drop_duplicates("iteration", keep="last").sort_values("iteration")
        its = its.reset_index(drop=True)
        its["span_s"] = its["end"] - its["start"]
        tl.cache["spans"] = its
    return tl.cache["spans"]


def _event_positions(tl: Timeline):
    """Per event: position of its iteration in spans() (-1 if it has no row), rank position."""
    if "event_positions" not in tl.cache:
        its = spans(tl)["iteration"].to_numpy()
        ev_it = tl.events["iteration"].to_numpy()
        pos = np.searchsorted(its, ev_it)
        pos_ok = np.minimum(pos, max(len(its) - 1, 0))
        valid = (pos < len(its)) & (its[pos_ok] == ev_it) if len(its) else np.zeros(len(ev_it), bool)
        it_pos = np.where(valid, pos, -1)
        rank_pos = np.searchsorted(tl.ranks, tl.events["rank"].to_numpy())
        tl.cache["event_positions"] = (it_pos, rank_pos)
    return tl.cache["event_positions"]


def _clipped(tl: Timeline, mask: np.ndarray):
    """Keys (iteration position x n_ranks + rank position) and span-clipped intervals of the
    events selected by `mask` that belong to an iteration with a row."""
    it_pos, rank_pos = _event_positions(tl)
    sp = spans(tl)
    mask = mask & (it_pos >= 0)
    ip = it_pos[mask]
    s = np.maximum(tl.events["start"].to_numpy()[mask], sp["start"].to_numpy()[ip])
    e = np.minimum(tl.events["end"].to_numpy()[mask], sp["end"].to_numpy()[ip])
    keep = e > s
    return (ip * len(tl.ranks) + rank_pos[mask])[keep], s[keep], e[keep]


def busy_segments(tl: Timeline) -> pd.DataFrame:
    """The merged busy intervals (see module docs) of each rank in each iteration, clipped to
    the span: columns iteration, rank, start, end. Their lengths sum to the busy time."""
    if "busy_segments" not in tl.cache:
        key, s, e = _clipped(tl, tl.events["name"].isin(BUSY_NAMES).to_numpy())
        g, s, e = merge_intervals(key, s, e)
        its = spans(tl)["iteration"].to_numpy()
        n = len(tl.ranks)
        tl.cache["busy_segments"] = pd.DataFrame({
            "iteration": its[g // n] if len(g) else np.array([], dtype=np.int32),
            "rank": tl.ranks[g % n] if len(g) else np.array([], dtype=np.int64),
            "start": s, "end": e})
    return tl.cache["busy_segments"]


def _roles(tl: Timeline) -> np.ndarray:
    """Role of each (iteration, rank) key, as an object array of str (see module docs)."""
    n_keys = len(spans(tl)) * len(tl.ranks)
    roles = np.full(n_keys, "none", dtype=object)
    it_pos, rank_pos = _event_positions(tl)
    ok = it_pos >= 0
    if not ok.any():
        return roles
    ev = tl.events
    role_codes, role_names = pd.factorize(ev["role"].to_numpy()[ok])
    df = pd.DataFrame({
        "key": (it_pos * len(tl.ranks) + rank_pos)[ok],
        "stage": ev["name"].isin(schema.STAGES).to_numpy()[ok],
        "role": role_codes,
        "dur": np.maximum((ev["end"] - ev["start"]).to_numpy()[ok], 0.0),
    })
    score = df.groupby(["key", "stage", "role"], sort=False)["dur"].sum().reset_index()
    best = score.sort_values(["key", "stage", "dur"], ascending=[True, False, False])
    best = best.drop_duplicates("key")
    roles[best["key"].to_numpy()] = np.asarray(role_names, dtype=object)[best["role"].to_numpy()]
    return roles


def rank_iterations(tl: Timeline) -> pd.DataFrame:
    """One row per (iteration, rank): role, span_s, busy_s, idle_s, switching_s."""
    if "rank_iterations" not in tl.cache:
        sp = spans(tl)
        n_ranks, n_its = len(tl.ranks), len(sp)
        n_keys = n_ranks * n_its
        seg = busy_segments(tl)
        # Keys of the busy segments, rebuilt from their iteration and rank.
        it_index = np.searchsorted(sp["iteration"].to_numpy(), seg["iteration"].to_numpy())
        seg_key = it_index * n_ranks + np.searchsorted(tl.ranks, seg["rank"].to_numpy())
        busy = np.bincount(seg_key, weights=(seg["end"] - seg["start"]).to_numpy(),
                           minlength=n_keys)[:n_keys]
        key, s, e = _clipped(tl, tl.events["name"].isin(schema.SWITCH_OPS).to_numpy())
        switching = union_length(key, s, e, n_keys)
        span = np.repeat(sp["span_s"].to_numpy(), n_ranks)
        tl.cache["rank_iterations"] = pd.DataFrame({
            "iteration": np.repeat(sp["iteration"].to_numpy(), n_ranks),
            "rank": np.tile(tl.ranks, n_its),
            "role": _roles(tl),
            "span_s": span,
            "busy_s": busy,
            "idle_s": span - busy,
            "switching_s": switching,
        })
    return tl.cache["rank_iterations"]


# ---------------------------------------------------------------------------------------------
# Per iteration

def _stage_time(tl: Timeline, name: str, index: pd.Index) -> pd.Series:
    """Per iteration: max over ranks of the rank's summed durations of events called `name`."""
    it_pos, _ = _event_positions(tl)
    ev = tl.events
    mask = (ev["name"] == name).to_numpy() & (it_pos >= 0)
    per_rank = pd.DataFrame({"iteration": ev["iteration"].to_numpy()[mask],
                             "rank": ev["rank"].to_numpy()[mask],
                             "dur": (ev["end"] - ev["start"]).to_numpy()[mask]})
    per_rank = per_rank.groupby(["iteration", "rank"])["dur"].sum()
    return per_rank.groupby(level="iteration").max().reindex(index)


def _switch_table(tl: Timeline) -> pd.DataFrame:
    """Per iteration: switch_ops, switch_total_s, switch_critical_s (iterations with a row)."""
    it_pos, _ = _event_positions(tl)
    ev = tl.events
    mask = ev["name"].isin(schema.SWITCH_OPS).to_numpy() & (it_pos >= 0)
    dur = (ev["end"] - ev["start"]).to_numpy()[mask]
    critical = ev["critical"].to_numpy()[mask] == schema.CRITICAL
    df = pd.DataFrame({"iteration": ev["iteration"].to_numpy()[mask], "dur": dur,
                       "crit": np.where(critical, dur, 0.0)})
    out = df.groupby("iteration").agg(switch_ops=("dur", "size"), switch_total_s=("dur", "sum"),
                                      switch_critical_s=("crit", "sum"))
    return out


def _sample_table(samples: pd.DataFrame, keys: pd.Series | np.ndarray) -> pd.DataFrame:
    """Per key: samples, tokens, mean_reward, mean_response_len, p99_response_len."""
    samples = samples.assign(reward=samples["reward"].astype(np.float64))
    grouped = samples.groupby(keys)
    return pd.DataFrame({
        "samples": grouped.size(),
        "tokens": grouped["response_len"].sum(),
        "mean_reward": grouped["reward"].mean(),
        "mean_response_len": grouped["response_len"].mean(),
        "p99_response_len": grouped["response_len"].quantile(0.99),
    })


def samples_recorded(tl: Timeline) -> bool:
    """False for a simulated sweep run written without per-sample rows (sim.samples=no, or auto on a large run)."""
    return bool(tl.attrs.get("samples_recorded", True))


def rollout_tokens(tl: Timeline) -> pd.Series:
    """Generated tokens per iteration from the rollout events (when no sample rows were written)."""
    ev = tl.events[tl.events["name"] == "rollout"]
    return ev.groupby("iteration")["tokens"].sum()


def speculation(tl: Timeline) -> dict[str, float]:
    """Tail speculation over the run's rollout events (rollout.speculation): draft_acceptance (the
    share of draft tokens accepted) and tokens_per_verify (tokens a row gained per verify step:
    the accepted ones and the one drawn after them); NaN where nothing was drafted."""
    ev = tl.events[tl.events["name"] == "rollout"]
    counts = dict.fromkeys(("verify_rows", "draft_tokens", "accepted_tokens"), 0)
    for raw in (ev["attrs"] if "attrs" in ev.columns else []):
        attrs = schema.decode_attrs(raw.encode()) if raw else {}
        for key in counts:
            counts[key] += int(attrs.get(key, 0))
    drafted, rows = counts["draft_tokens"], counts["verify_rows"]
    return {"draft_acceptance": counts["accepted_tokens"] / drafted if drafted else math.nan,
            "tokens_per_verify": (rows + counts["accepted_tokens"]) / rows if rows else math.nan}


def train_step_metrics(sums: dict[str, float], step: dict[str, float]) -> dict[str, float]:
    """The train/* metrics of one step (module docs) from `sums`, its per-token sums over every
    micro-batch (the trainer's: tokens, policy_loss, kl_behaviour, entropy, clipped, ratio,
    ratio_max, kl_ref; loss: the step's loss, already normalised by the batch's tokens), and
    `step`, its step-wide figures (grad_norm, grad_norm_clipped, lr, advantage_mean,
    advantage_std, zero_variance_groups)."""
    tokens = sums.get("tokens", 0.0)
    if tokens <= 0:
        return {}
    out = {f"train/{key}": sums[key] / tokens for key in ("policy_loss", "kl_behaviour", "entropy", "kl_ref")
           if key in sums}
    out["train/loss"] = sums.get("loss", math.nan)
    out["train/clip_fraction"] = sums["clipped"] / tokens
    out["train/ratio_mean"] = sums["ratio"] / tokens
    out["train/ratio_max"] = sums["ratio_max"]
    out.update({f"train/{key}": float(value) for key, value in step.items()})
    return out


RL_METRICS = ("train/", "eval/", "response/")     # logged by the run, not derived from its events


def logged_metrics(tl: Timeline) -> pd.DataFrame:
    """The metrics the run's loggers got (the timeline's `metrics` dataset), one row per
    iteration (index), one column per metric; empty for a simulated run."""
    m = tl.metrics
    if m.empty:
        return pd.DataFrame(index=pd.Index([], name="iteration"))
    wide = m.pivot_table(index="iteration", columns="name", values="value", aggfunc="last", observed=True)
    wide.columns = [str(c) for c in wide.columns]
    return wide


def eval_metrics(rewards: np.ndarray, lengths: np.ndarray, pass_reward: float) -> dict[str, float]:
    """The eval/* metrics (module docs) of `rewards` and response `lengths`, arrays [prompts, k]."""
    k = rewards.shape[1]
    return {"eval/reward_mean": float(rewards.mean()),
            f"eval/pass@{k}": float((rewards.max(axis=1) >= pass_reward).mean()),
            "eval/response_length_mean": float(lengths.mean())}


def hidden_share(total: float, critical: float) -> float:
    """1 - critical / total, NaN if there is no switch work."""
    return 1.0 - critical / total if total > 0 else math.nan


def iteration_metrics(tl: Timeline) -> pd.DataFrame:
    """One row per iteration (see the module docs for the definitions).

    Columns: iteration, table_version, train_ranks, rollout_ranks, start, end, span_s,
    rollout_time_s, train_time_s, weight_sync_time_s, switch_ops, switch_total_s,
    switch_critical_s, switch_hidden_s, hidden_share, bubble_train, bubble_rollout, bubble_both
    (NaN where no rank has that role), samples, tokens, tokens_per_s, samples_per_s,
    mean_reward, mean_response_len, p99_response_len, decision, decision_reason,
    decision_to_train (the decision taken at the end of the iteration, if any); then the RL's own
    metrics the run logged (train/*, eval/*, response/truncated: `logged_metrics`), if any.
    """
    if "iteration_metrics" in tl.cache:
        return tl.cache["iteration_metrics"].copy()
    sp = spans(tl)
    out = sp[["iteration", "table_version", "train_ranks", "rollout_ranks", "start", "end",
              "span_s"]].copy()
    index = pd.Index(out["iteration"].to_numpy(), name="iteration")
    out = out.set_index(index, drop=False)

    out["rollout_time_s"] = _stage_time(tl, "rollout", index)
    out["train_time_s"] = _stage_time(tl, "train", index)
    out["weight_sync_time_s"] = _stage_time(tl, "weight_sync", index)

    sw = _switch_table(tl).reindex(index)
    out["switch_ops"] = sw["switch_ops"].fillna(0).astype(np.int64)
    out["switch_total_s"] = sw["switch_total_s"].fillna(0.0)
    out["switch_critical_s"] = sw["switch_critical_s"].fillna(0.0)
    out["switch_hidden_s"] = out["switch_total_s"] - out["switch_critical_s"]
    out["hidden_share"] = [hidden_share(t, c) for t, c in
                           zip(out["switch_total_s"], out["switch_critical_s"])]

    ri = rank_iterations(tl)
    by_role = ri.groupby(["iteration", "role"]).agg(idle=("idle_s", "sum"), cap=("span_s", "sum"))
    for role in ROLES:
        share = pd.Series(np.nan, index=index)
        if len(by_role) and role in by_role.index.get_level_values("role"):
            part = by_role.xs(role, level="role")
            share = (part["idle"] / part["cap"]).reindex(index)
        out[f"bubble_{role}"] = share

    its = sp["iteration"].to_numpy()
    samples = tl.samples[np.isin(tl.samples["iteration"].to_numpy(), its)]
    st = _sample_table(samples, samples["iteration"]).reindex(index)
    out["samples"] = st["samples"].fillna(0).astype(np.int64)
    out["tokens"] = st["tokens"].fillna(0).astype(np.int64)
    if not samples_recorded(tl):
        out["tokens"] = rollout_tokens(tl).reindex(index).fillna(0).astype(np.int64)
    with np.errstate(divide="ignore", invalid="ignore"):
        out["tokens_per_s"] = out["tokens"] / out["span_s"]
        out["samples_per_s"] = out["samples"] / out["span_s"]
    for column in ("mean_reward", "mean_response_len", "p99_response_len"):
        out[column] = st[column]

    dec = tl.decisions.drop_duplicates("iteration", keep="last").set_index("iteration")
    dec = dec.reindex(index)
    out["decision"] = dec["action"]
    out["decision_reason"] = dec["reason"]
    out["decision_to_train"] = dec["to_train"].astype("Int64")
    logged = logged_metrics(tl)
    rl = [c for c in logged.columns if c.startswith(RL_METRICS)]
    out = out.join(logged[rl].reindex(index)) if rl else out
    out = out.reset_index(drop=True)
    tl.cache["iteration_metrics"] = out
    return out.copy()


# ---------------------------------------------------------------------------------------------
# Per run

def policy_kind(name: str) -> str:
    """Classify a policy name: "static", "oracle" (the simulator's oracles: names starting with
    "oracle"), "scripted" (a split schedule given by hand), "colocated" (names starting with
    "coloc"), "unknown", or "dynamic" (any other name)."""
    name = (name or "unknown").lower()
    if name in ("static", "scripted", "unknown"):
        return name
    if name.startswith("oracle"):
        return "oracle"
    if name.startswith("coloc"):
        return "colocated"
    return "dynamic"


def gpu_time(tl: Timeline) -> dict:
    """GPU-seconds per role: ``{role: {"total_s", "busy_s", "idle_s", "switching_s"}}`` for
    each role present, plus ``"all"`` (see the module docs)."""
    ri = rank_iterations(tl)
    table = {}
    for role, part in list(ri.groupby("role", sort=False)) + [("all", ri)]:
        table[str(role)] = {"total_s": float(part["span_s"].sum()),
                            "busy_s": float(part["busy_s"].sum()),
                            "idle_s": float(part["idle_s"].sum()),
                            "switching_s": float(part["switching_s"].sum())}
    order = {role: i for i, role in enumerate(STATE_ROLES + ("all",))}
    return dict(sorted(table.items(), key=lambda kv: order.get(kv[0], len(order))))


def split_label(train_ranks, world_size) -> str:
    """"T/R": train ranks / rollout ranks."""
    if train_ranks is None or (isinstance(train_ranks, float) and math.isnan(train_ranks)):
        return "?"
    return f"{int(train_ranks)}/{int(world_size) - int(train_ranks)}"


def attempts(tl: Timeline) -> pd.DataFrame:
    """The run's resumed attempts, one row each: `start_s` (on the run's clock, which goes on
    across attempts), `after_iteration` (the checkpoint it resumed from) and `lost_s`, the time
    between that iteration's end and the attempt's start: the iterations computed again and the
    time the job was down or queued. Empty for a run that was never resumed (or an older file,
    whose clock restarted with each attempt)."""
    try:
        rows = json.loads(tl.attrs.get("attempts") or "[]")
    except (TypeError, ValueError):
        rows = []
    out = pd.DataFrame(rows, columns=["start_s", "after_iteration"])
    ends = spans(tl).set_index("iteration")["end"]
    out["lost_s"] = [start - float(ends.get(after, np.nan)) for start, after in
                     zip(out["start_s"], out["after_iteration"])]
    return out


def run_metrics(tl: Timeline) -> dict:
    """Metrics of the whole run as a flat dict (plus ``gpu_time``, a dict per role).

    Keys: run, path, policy, kind, world_size, complete, iterations, initial_train_ranks,
    split (initial "train/rollout"), final_split, splits (distinct train_ranks used),
    total_time_s, samples, tokens, tokens_per_s, samples_per_s, mean_reward,
    mean_response_len, p99_response_len, bubble_train, bubble_rollout, bubble_both,
    bubble_all, switch_ops, switch_total_s, switch_critical_s, switch_hidden_s, hidden_share,
    resizes, prediction_error_median (median |predicted / measured - 1| of the next iteration's
    time, see predictions), decisions, decide_s_median, decide_s_total, decide_share (their
    total / total_time_s), outside_iterations_s, gpu_time, draft_acceptance and tokens_per_verify
    (tail speculation, see speculation); the RL's: final_reward (the mean reward
    of the last quarter of the iterations that generated), eval_reward and eval_pass (the last
    evaluation's eval/reward_mean and eval/pass@k; NaN without one).
    """
    its = iteration_metrics(tl)
    sp = spans(tl)
    ri = rank_iterations(tl)
    n = len(sp)
    total_time = float(sp["end"].max() - sp["start"].min()) if n else math.nan
    samples = tl.samples[np.isin(tl.samples["iteration"].to_numpy(), sp["iteration"].to_numpy())]
    tokens = int(samples["response_len"].sum())
    if not samples_recorded(tl):
        tokens = int(rollout_tokens(tl).reindex(sp["iteration"]).fillna(0).sum())
    lengths = samples["response_len"].to_numpy()

    out = {
        "run": tl.name,
        "path": tl.path,
        "policy": tl.policy,
        "kind": policy_kind(tl.policy),
        "world_size": tl.world_size,
        "complete": tl.complete,
        "iterations": n,
        "initial_train_ranks": tl.initial_train_ranks,
        "split": split_label(tl.initial_train_ranks, tl.world_size),
        "final_split": (f"{int(sp['train_ranks'].iloc[-1])}/{int(sp['rollout_ranks'].iloc[-1])}"
                        if n else "?"),
        "splits": sorted(int(t) for t in sp["train_ranks"].unique()),
        "total_time_s": total_time,
        "samples": int(len(samples)),
        "tokens": tokens,
        "tokens_per_s": tokens / total_time if total_time > 0 else math.nan,
        "samples_per_s": len(samples) / total_time if total_time > 0 else math.nan,
        "mean_reward": float(samples["reward"].astype(np.float64).mean()) if len(samples) else math.nan,
        "mean_response_len": float(lengths.mean()) if len(lengths) else math.nan,
        "p99_response_len": float(np.percentile(lengths, 99)) if len(lengths) else math.nan,
    }
    for role in ROLES:
        part = ri[ri["role"] == role]
        cap = part["span_s"].sum()
        out[f"bubble_{role}"] = float(part["idle_s"].sum() / cap) if cap > 0 else math.nan
    active = ri[ri["role"].isin(ROLES)]
    cap = active["span_s"].sum()
    out["bubble_all"] = float(active["idle_s"].sum() / cap) if cap > 0 else math.nan

    total = float(its["switch_total_s"].sum())
    critical = float(its["switch_critical_s"].sum())
    decide_total = float(tl.attrs.get("decide_s_total", math.nan))
    out.update({
        "switch_ops": int(its["switch_ops"].sum()),
        "switch_total_s": total,
        "switch_critical_s": critical,
        "switch_hidden_s": total - critical,
        "hidden_share": hidden_share(total, critical),
        "resizes": int((tl.decisions["action"] == "move").sum()),
        "prediction_error_median": float(predictions(tl)["error"].abs().median()),
        "decisions": int(len(tl.decisions)),
        # the policy's own time: rank 0 decides while every rank waits (this machine's seconds; a
        # real run's time includes them, a simulated one leaves them out)
        "decide_s_median": float(tl.attrs.get("decide_s_median", math.nan)),
        "decide_s_total": decide_total,
        "decide_share": decide_total / total_time if total_time > 0 else math.nan,
        "outside_iterations_s": (float((total_time - sp["span_s"].sum()) * len(tl.ranks))
                                 if n else math.nan),
        "gpu_time": gpu_time(tl),
        **speculation(tl),
    })
    generating = sp.loc[sp["generated_batch"] >= 0, "iteration"].to_numpy()
    last = generating[-max(1, len(generating) // 4):]
    rewards = samples.loc[np.isin(samples["iteration"].to_numpy(), last), "reward"]
    out["final_reward"] = float(rewards.astype(np.float64).mean()) if len(rewards) else math.nan
    logged = logged_metrics(tl)
    for key, prefix in (("eval_reward", "eval/reward_mean"), ("eval_pass", "eval/pass@")):
        column = next((c for c in logged.columns if c.startswith(prefix)), None)
        values = logged[column].dropna() if column else pd.Series(dtype=float)
        out[key] = float(values.iloc[-1]) if len(values) else math.nan
    return out


def predictions(tl: Timeline) -> pd.DataFrame:
    """The policy's prediction of the next iteration's time against the measured one.

    One row per decision that records ``predicted_s`` (the dynamic policy and the oracle do;
    a move's prediction includes its switch), for the iteration predicted: iteration, split
    (train ranks), predicted_s, measured_s (its span) and error = predicted / measured - 1."""
    columns = ["iteration", "train_ranks", "predicted_s", "measured_s", "error"]
    d = tl.decisions
    if not len(d) or "attrs" not in d:
        return pd.DataFrame(columns=columns)
    predicted = [schema.decode_attrs(a).get("predicted_s") for a in d["attrs"]]
    rows = pd.DataFrame({"iteration": d["iteration"].to_numpy() + 1, "predicted_s": predicted}).dropna()
    sp = spans(tl)[["iteration", "train_ranks", "span_s"]].rename(columns={"span_s": "measured_s"})
    out = rows.merge(sp, on="iteration")
    out["predicted_s"] = out["predicted_s"].astype(float)
    out["error"] = out["predicted_s"] / out["measured_s"] - 1.0
    return out[columns].reset_index(drop=True)


def decisions(tl: Timeline) -> pd.DataFrame:
    """The policy decisions: iteration, table_version, from_train, to_train, action, reason,
    the stage times they were based on and the predicted gain and cost."""
    columns = [c for c in tl.decisions.columns if c != "attrs"]
    return tl.decisions[columns].reset_index(drop=True)


def iteration_role_bubbles(events: list[dict], start: float, end: float,
                           roles: dict[int, str]) -> dict[str, float]:
    """The idle share of each role's rank-time in one iteration (``roles``: rank -> role), from
    the iteration's raw events, by the same definition as iteration_bubble."""
    out = {}
    for role in sorted(set(roles.values())):
        # Number this role's ranks 0..n-1, so iteration_bubble sees them as a world of their own.
        index = {rank: i for i, rank in enumerate(sorted(r for r, x in roles.items() if x == role))}
        own = [{**e, "rank": index[e["rank"]]} for e in events if e["rank"] in index]
        out[role] = iteration_bubble(own, start, end, len(index))
    return out
