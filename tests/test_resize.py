"""Issue 3, runtime resizing on real ranks: semantics preserved across resizes, group reuse,
dynamic moves on the timeline, a rank dying mid-switch, and staging directories."""
from __future__ import annotations

import json
import os
import time

import h5py
import numpy as np
from safetensors.torch import load_file

from conftest import run_cli

# 8 iterations and the pipeline's drain (lag 1): 4 resizes growing training and 4 shrinking it.
SCHEDULE = "[1,3,2,3,1,2,1,3,2]"


def timeline(run_dir):
    with h5py.File(run_dir / "timeline.h5", "r") as f:
        return {name: f[name][...] for name in ("events", "iterations", "samples", "decisions")}, dict(f.attrs)


def max_rel_weight_diff(a_dir, b_dir) -> float:
    a, b = load_file(a_dir / "final_model" / "model.safetensors"), load_file(b_dir / "final_model" / "model.safetensors")
    assert a.keys() == b.keys()
    return max(float(((a[k] - b[k]).abs() / b[k].abs().clamp_min(1e-6)).max()) for k in a)


def assert_same_rl(a_dir, b_dir, exact=False):
    """Same sampled tokens (per-sample digests) and the same final weights (bit for bit if exact)."""
    (ta, _), (tb, _) = timeline(a_dir), timeline(b_dir)
    key = ["batch", "index", "digest", "response_len", "reward"]
    sa, sb = np.sort(ta["samples"][key], order=["batch", "index"]), np.sort(tb["samples"][key], order=["batch", "index"])
    assert len(sa) == len(sb) > 0 and np.array_equal(sa, sb), "sampled tokens differ"
    diff = max_rel_weight_diff(a_dir, b_dir)
    assert diff <= (0.0 if exact else 1e-5), f"final weights differ: max relative difference {diff}"
    return diff


def switch_ops(run_dir) -> dict[int, set]:
    """{iteration: {(operation, rank, critical?)}} of the switch operations a run recorded (a
    background operation may end with a critical part, the wait for it: it counts as background)."""
    from dynaresize.timeline.schema import BACKGROUND, CRITICAL, SWITCH_OPS
    ev = timeline(run_dir)[0]["events"]
    flags: dict[tuple, set] = {}
    for e in ev[np.isin(ev["critical"], [CRITICAL, BACKGROUND]) & (ev["iteration"] >= 0)]:
        if e["name"].decode() in SWITCH_OPS:
            flags.setdefault((int(e["iteration"]), e["name"].decode(), int(e["rank"])), set()).add(int(e["critical"]))
    out: dict[int, set] = {}
    for (it, name, rank), f in flags.items():
        out.setdefault(it, set()).add((name, rank, BACKGROUND not in f))
    return out


def resizes(run_dir):
    its = timeline(run_dir)[0]["iterations"]
    splits = list(its["train_ranks"])
    return splits, sum(b > a for a, b in zip(splits, splits[1:])), sum(b < a for a, b in zip(splits, splits[1:]))


def test_scripted_resizes_preserve_tokens_and_weights(static_run, tmp_path, capsys):
    static_dir, _ = static_run                        # static 2T/2R, lag 1, 8 iterations
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    run = tmp_path / "scripted"
    run_cli(run, "policy=scripted", f"policy.schedule={SCHEDULE}", f"cluster.local_scratch={scratch}",
            "run.iterations=8")
    splits, grows, shrinks = resizes(run)
    assert splits == [1, 3, 2, 3, 1, 2, 1, 3, 2] and grows >= 3 and shrinks >= 3
    assert_same_rl(run, static_dir)
    events, attrs = timeline(run)
    assert int(attrs["groups_created_after_startup"]) == 0
    names = set(events["events"]["name"][events["events"]["critical"] >= 0])
    assert {b"stage_out", b"stage_in", b"group_switch", b"commit", b"engine_start", b"weight_load",
            b"release"} <= names
    assert os.listdir(scratch) == [], "staging directory left behind"

    # One switch plan: the runtime executed, and the simulator priced, exactly the operations of
    # the plan replayed from the run's table history (names, ranks, critical or background).
    from dynaresize.analysis.plan import switch_plans
    from dynaresize.sim import setup_from_overrides, simulate
    plans = switch_plans(run)
    assert sorted(plans) == list(range(1, 9))
    planned = {it: {(op.name, r, op.critical) for op in p.ops for r in op.ranks} for it, p in plans.items()}
    assert switch_ops(run) == planned
    simulate(setup_from_overrides(["policy=scripted", f"policy.schedule={SCHEDULE}", "run.iterations=8"]),
             tmp_path / "sim")
    assert switch_ops(tmp_path / "sim") == planned
    for tl in (events, timeline(tmp_path / "sim")[0]):                   # the plan's bytes, as moved and priced
        loads = tl["events"][tl["events"]["name"] == b"weight_load"]
        assert set(loads["bytes"]) == {4 * int(attrs["parameters"])}
    from dynaresize.analysis.cli import main as analyze
    capsys.readouterr()
    assert analyze(["plan", str(run), "1"]) == 0                         # dynaresize-analyze plan RUN 1
    printed = capsys.readouterr().out
    assert "iteration 1: switch v0 1T/3R -> v1 3T/1R (file transport)" in printed and "stage_in" in printed


def test_lag0_resizes_without_reuse_over_network_transport_and_colocated(static_lag0_run, tmp_path):
    common = ["run.max_lag=0", "run.iterations=8"]
    static, scripted, colocated = static_lag0_run, tmp_path / "scripted", tmp_path / "colocated"
    run_cli(scripted, *common, "policy=scripted", "policy.schedule=[1,3,2,3,1,2,1,3]",
            "staging.reuse_groups=false", "staging.transport=network")
    assert_same_rl(scripted, static)
    events, attrs = timeline(scripted)
    assert int(attrs["groups_created_after_startup"]) > 0      # without reuse, every switch creates groups
    assert b"reshard" in set(events["events"]["name"])
    # Colocated: every rank generates, then every rank trains: the same RL, a switch every iteration.
    run_cli(colocated, *common, "policy=colocated")
    assert_same_rl(colocated, static)
    events = timeline(colocated)[0]["events"]
    for op in (b"release", b"engine_start", b"weight_load"):
        per_it = events[(events["name"] == op)]
        assert set(per_it["iteration"]) == set(range(8)) and set(per_it["rank"]) == {0, 1, 2, 3}, op
        assert (per_it["critical"] == 1).all()


def test_dynamic_policy_moves_and_records_its_reasons(tmp_path):
    # One rollout rank against three trainers with long responses: clearly rollout-bound. Rank 0
    # prices its decisions on a worker process (spawned beside an MPI rank; the decisions are the
    # same as without it: test_policy.py).
    run = tmp_path / "dynamic"
    proc = run_cli(run, "policy=dynamic", "policy.train_ranks=3", "workload.length_median=40", "run.iterations=8",
                   "policy.pricing_workers=1")
    data, attrs = timeline(run)
    assert attrs["decide_pricing_workers"] == 1 and attrs["decide_priced_by_workers"] > 0, dict(attrs)
    decisions = data["decisions"]
    moves = decisions[decisions["action"] == b"move"]
    assert len(moves) >= 1, decisions
    assert moves[0]["to_train"] < moves[0]["from_train"]                  # toward more rollout ranks
    assert all(r.startswith(b"move to") for r in moves["reason"])
    first = moves[0]["iteration"]
    assert data["iterations"]["train_ranks"][first + 1] == moves[0]["to_train"]
    assert np.all(np.isfinite(moves["predicted_gain"])) and np.all(moves["predicted_gain"] > 0)
    # every decision, kept or moved, carries the predicted time of the next iteration
    assert all("predicted_s" in json.loads(a) for a in decisions["attrs"][:-1])
    assert f"split   {moves[0]['to_train']}T/{4 - moves[0]['to_train']}R" in proc.stdout


def test_rank_killed_mid_switch_fails_fast_naming_rank_and_operation(tmp_path):
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    env_fault = {"DYNARESIZE_INJECT_FAULT": "1:stage_out"}    # rank 1 leaves training at iteration 2
    start = time.monotonic()
    old = {k: os.environ.get(k) for k in env_fault}
    os.environ.update(env_fault)
    try:
        proc = run_cli(tmp_path / "run", "policy=scripted", "policy.schedule=[2,2,1]", "run.iterations=4",
                       f"cluster.local_scratch={scratch}", check=False, timeout=120)
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    elapsed = time.monotonic() - start
    assert proc.returncode != 0
    assert "rank 1 died" in proc.stderr and "'stage_out'" in proc.stderr, proc.stderr[-3000:]
    assert elapsed < 60, f"took {elapsed:.0f} s"
    assert os.listdir(scratch) == [], "staging directory left behind after the failure"


def test_dynamic_sampling_trains_the_groups_whose_rewards_differ_and_resizes_change_nothing(tmp_path):
    """trainer.filter_groups (DAPO's dynamic sampling) on short responses, where many prompt groups
    score all alike: rollout generates rounds of new groups until 8 differ, every round on the
    timeline; each batch trains exactly its first 8 differing groups; and with resizes in between
    the samples and the final weights are the static run's."""
    common = ["trainer.filter_groups=true", "workload.length_median=3", "workload.length_growth=0",
              "workload.length_max=8", "run.iterations=4", "run.report=false"]
    static, scripted = tmp_path / "static", tmp_path / "scripted"
    run_cli(static, *common, "policy.train_ranks=2")
    run_cli(scripted, *common, "policy=scripted", "policy.schedule=[1,2,1,3]")
    assert resizes(scripted)[0] == [1, 2, 1, 3, 3]                  # the drain holds the last entry
    assert_same_rl(scripted, static)
    data, _ = timeline(static)
    samples, events = data["samples"], data["events"]
    rounds = {}
    for e in events[events["name"] == b"rollout"]:
        rounds.setdefault(int(e["iteration"]), set()).add(json.loads(e["attrs"])["round"])
    assert max(len(r) for r in rounds.values()) >= 2, rounds         # some batch took more rounds
    for b in range(4):
        mine = samples[samples["batch"] == b]
        differ = sorted(p for p in set(mine["prompt"].tolist()) if len(set(mine["reward"][mine["prompt"] == p])) > 1)
        assert len(set(mine["prompt"].tolist())) == 8 * len(rounds[b]) and len(differ) >= 8
        trained = mine[np.isin(mine["prompt"], differ[:8])]
        want = int((trained["prompt_len"] + trained["response_len"]).sum())
        got = int(events["tokens"][(events["name"] == b"train")
                                   & (events["iteration"] == b + 1)].sum())    # batch b trains in iteration b + 1
        assert got == want, (b, got, want)
