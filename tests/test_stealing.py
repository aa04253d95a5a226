"""Work stealing (trainer.work_stealing): real MPI ranks compute stolen micro-batches without
changing the RL; the claim schedule the simulator and the policy price."""
from __future__ import annotations

import json
import time

import numpy as np
import pytest

from conftest import run_cli
from test_resize import assert_same_rl, timeline

from dynaresize.plan.sorting import stable_argsort, stable_argsort_descending
from dynaresize.plan.stealing import claim_schedule, queue_order, worth_joining


def steals(run_dir) -> np.ndarray:
    events = timeline(run_dir)[0]["events"]
    return events[events["name"] == b"steal"]


def test_claim_schedule_gives_the_next_micro_batch_to_the_worker_free_first():
    # two train ranks free at once, a helper free at 2.5 (joining costs nothing): it takes what is
    # left from then on
    owner, start, end, joined = claim_schedule([2, 2, 1, 1, 1, 1], [0, 0, 2.5], helpers_from=2)
    assert owner.tolist() == [0, 1, 0, 1, 2, 0] and joined.tolist() == [2]
    assert start.tolist() == [0, 0, 2, 2, 2.5, 3]
    assert end.tolist() == [4, 3, 3.5]
    # its engine sleeping first (0.6 s) it is free only at 3.1: it joined, but the train ranks,
    # free at 3, took the rest; with a 0.4 s sleep it takes the last one
    owner, _, _, joined = claim_schedule([2, 2, 1, 1, 1, 1], [0, 0, 2.5], helpers_from=2, delay_s=0.6)
    assert owner.tolist() == [0, 1, 0, 1, 0, 1] and joined.tolist() == [2]
    owner, start, _, _ = claim_schedule([2, 2, 1, 1, 1, 1], [0, 0, 2.5], helpers_from=2, delay_s=0.4)
    assert owner.tolist() == [0, 1, 0, 1, 2, 0] and start[4] == 2.9
    # a helper free after the queue is empty takes nothing and ends when it became free
    owner, _, end, joined = claim_schedule([1, 1], [0, 0, 9], helpers_from=2)
    assert 2 not in owner and end[2] == 9 and len(joined) == 0
    # a helper joins only if the compute left, shared with one more worker, saves more than its sum costs
    assert claim_schedule([4, 4, 4, 4], [0, 1], helpers_from=1, join_s=1.0)[0].tolist() == [0, 1, 0, 1]
    assert claim_schedule([4, 4, 4, 4], [0, 1], helpers_from=1, join_s=7.0)[0].tolist() == [0, 0, 0, 0]
    assert worth_joining(12.0, 1, 5.9) and not worth_joining(12.0, 2, 2.0)
    assert queue_order([3, 5, 5, 1]).tolist() == [1, 2, 0, 3]          # the longest first, ties by index


def step_by_step_claims(durations, ready):
    """The claims without helpers, one at a time, by a scan of every worker (ties: the lower)."""
    free, owner, start = list(map(float, ready)), [], []
    for d in durations:
        w = min(range(len(free)), key=lambda i: (free[i], i))
        owner.append(w)
        start.append(free[w])
        free[w] += d
    return owner, start, free


@pytest.mark.parametrize("workers", [5, 40, 300])
def test_claims_without_helpers_are_list_scheduling(workers):
    # From 32 workers claim_schedule takes claims in rounds (a sort a round): the same claims as a
    # scan, with ties in durations and in free times; durations that grow somewhere along the
    # queue are taken one at a time.
    rng = np.random.default_rng(workers)
    for trial in range(4):
        dur = np.sort(rng.integers(1, 40, 25 * workers).astype(float))[::-1]
        if trial == 3:
            dur = rng.permutation(dur)
        ready = rng.integers(0, 3, workers).astype(float) if trial % 2 else np.zeros(workers)
        owner, start, end, joined = claim_schedule(dur, ready)
        ref_owner, ref_start, ref_end = step_by_step_claims(dur, ready)
        assert owner.tolist() == ref_owner and start.tolist() == ref_start and end.tolist() == ref_end
        assert len(joined) == 0
    # helpers free only once the last micro-batch is claimed take none (a tie goes to a train rank)
    train = min(workers, 8)
    owner, start, end, _ = claim_schedule(dur, ready[:train])
    late = np.concatenate((ready[:train], start[-1] + rng.integers(0, 2, 3)))
    assert [x.tolist() for x in claim_schedule(dur, late, helpers_from=train)] == \
        [owner.tolist(), start.tolist(), end.tolist() + late[train:].tolist(), []]
    late[train] = start[-1] - 0.5                                 # free just before it: takes one
    assert train in claim_schedule(dur, late, helpers_from=train)[0]
    # a worker freed inside a round at the very time another becomes free: the lower one goes first
    ready = np.full(workers, 2.0)
    ready[0] = 0.0
    assert claim_schedule(np.full(3, 2.0), ready)[0].tolist() == step_by_step_claims([2.0] * 3, ready)[0]


def test_the_fast_stable_sorts_are_numpys_stable_sort():
    # whole numbers by 16-bit radix passes (one below 2**16, two below 2**32), anything else by
    # numpy: the same order as numpy's stable sort, ties (many, here) by index, either way round
    rng = np.random.default_rng(7)
    for high in (1, 3, 700, 2**16, 70_000, 2**32, 2**40):
        for n in (0, 1, 5, 4_000):
            keys = rng.integers(0, high, n)
            for x in (keys, keys.astype(np.float64), keys + 0.5, keys - high // 2, keys.astype(np.int32)):
                assert stable_argsort(x).tolist() == np.argsort(x, kind="stable").tolist()
                assert stable_argsort_descending(x).tolist() == np.argsort(-x, kind="stable").tolist()


def test_work_stealing_keeps_the_rl_exact(static_run, static_lag0_run, tmp_path):
    # Synchronous (max_lag 0): the rollout ranks are free when training starts, and help at once.
    stealing = tmp_path / "stealing_lag0"
    run_cli(stealing, "run.max_lag=0", "run.iterations=8", "trainer.work_stealing=true")
    assert_same_rl(stealing, static_lag0_run, exact=True)
    stolen = steals(stealing)
    assert len(stolen) > 0 and set(stolen["rank"].tolist()) <= {2, 3}       # only rollout ranks steal
    events = timeline(stealing)[0]["events"]
    train = events[(events["name"] == b"train")]
    helpers = {int(e["iteration"]): json.loads(e["attrs"]).get("helpers", []) for e in train}
    for e in stolen:                           # every stolen micro-batch reached the train ranks
        assert int(e["rank"]) in helpers[int(e["iteration"])]
        assert e["tokens"] > 0 and e["end"] >= e["start"]

    # One step off-policy, with resizes: ranks leaving training help with their trainer's weights.
    static_dir, _ = static_run                                   # static 2T/2R, max_lag 1, 8 iterations
    scripted = tmp_path / "scripted"
    run_cli(scripted, "policy=scripted", "policy.schedule=[1,3,2,3,1,2,1,3,2]", "run.iterations=8",
            "trainer.work_stealing=true")
    assert_same_rl(scripted, static_dir, exact=True)
    last = steals(scripted)
    # the pipeline's drain only trains: its rollout ranks (2 and 3; rank 2 trained in iteration 7) help
    assert 8 in set(last["iteration"].tolist()), last


@pytest.mark.fault("a rollout rank killed (SIGKILL) while it computes a stolen micro-batch (work stealing)",
                   "the job ends within 60 s naming that rank and `steal`; the train ranks waiting for its "
                   "gradients do not hang")
def test_a_helper_killed_while_stealing_ends_the_job_naming_the_operation(tmp_path):
    start = time.monotonic()
    proc = run_cli(tmp_path / "run", "run.max_lag=0", "run.iterations=3", "trainer.work_stealing=true",
                   check=False, timeout=120, env={"DYNARESIZE_INJECT_FAULT": "2:steal"})
    assert proc.returncode != 0
    assert "rank 2 died" in proc.stderr and "during steal" in proc.stderr, proc.stderr[-3000:]
    assert time.monotonic() - start < 60


def test_colocated_work_stealing_is_refused(tmp_path):
    proc = run_cli(tmp_path / "run", "policy=colocated", "run.max_lag=0", "trainer.work_stealing=true",
                   check=False, timeout=60)
    assert proc.returncode == 2 and "trainer.work_stealing" in proc.stderr and "every rank trains" in proc.stderr


@pytest.mark.parametrize("lag", [1, 0])
def test_simulated_stealing_is_the_policys_prediction(tmp_path, lag):
    """The simulator's stolen micro-batches and train stage are IterationModel's (the dynamic
    policy's prediction), and a train-bound split gets faster."""
    from dynaresize.plan.prediction import Lengths
    from dynaresize.sim import setup_from_overrides, simulate
    from dynaresize.sim.core import Simulator
    common = ["+experiment=suite", "workload=deepscaler", "cluster.ranks=64", "run.iterations=6",
              f"run.max_lag={lag}", "policy=static", "policy.train_ranks=16", "sim.noise=0"]
    spans = {}
    for ws in (False, True):
        setup = setup_from_overrides(common + [f"trainer.work_stealing={str(ws).lower()}"])
        path = simulate(setup, tmp_path / f"ws{ws}")
        from dynaresize.timeline.reader import read_arrays
        _, data = read_arrays(path, ("iterations", "events"))
        its, ev = data["iterations"], data["events"]
        spans[ws] = float(its["end"].max() - its["start"].min())
    assert spans[True] < 0.97 * spans[False], spans                         # 16 of 64 train: train-bound
    stolen = ev[ev["name"] == b"steal"]
    assert len(stolen) > 0 and (stolen["rank"] >= 16).all()
    # iteration 3 priced by the policy's model equals the simulated train stage
    sim = Simulator(setup, tmp_path / "model")
    it = 3
    trained = Lengths.of(sim.batch(it - lag))
    generated = Lengths.of(sim.batch(it))
    free = sim.model.rollout_times(generated, 16) if lag else np.zeros(48)
    predicted = sim.model.train(trained, 16, free)
    train = ev[(ev["name"] == b"train") & (ev["iteration"] == it)]
    measured = float(train["end"].max() - train["start"].min())
    assert measured == pytest.approx(predicted, rel=1e-9)
    mine = stolen[stolen["iteration"] == it]
    rollout = ev[(ev["name"] == b"rollout") & (ev["iteration"] == it)]
    ends = dict(zip(rollout["rank"].tolist(), rollout["end"].tolist()))
    # vLLM (the GPU profile) holds the GPU's memory: a helper's engine sleeps first, wakes after
    sleeps = ev[(ev["name"] == b"release") & (ev["iteration"] == it)]
    wakes = ev[(ev["name"] == b"engine_start") & (ev["iteration"] == it)]
    assert set(mine["rank"].tolist()) <= set(sleeps["rank"].tolist()) == set(wakes["rank"].tolist())
    assert (sleeps["critical"] == 0).all() and (wakes["critical"] == 0).all()      # background
    slept = dict(zip(sleeps["rank"].tolist(), sleeps["end"].tolist()))
    for e in mine:                          # a helper steals only once its rollout is done, its engine asleep
        assert e["start"] >= max(ends.get(int(e["rank"]), -np.inf), slept[int(e["rank"])]) - 1e-9


def test_stealing_is_validated_in_the_simulator_too():
    from dynaresize.config import ConfigError
    from dynaresize.sim import setup_from_overrides
    with pytest.raises(ConfigError, match="trainer.work_stealing"):
        setup_from_overrides(["policy=colocated", "run.max_lag=0", "trainer.work_stealing=true"])
