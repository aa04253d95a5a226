"""Tail migration (rollout.migration_threshold): a rollout rank hands its last sequences to a tail
rank, which continues them bit-identically; on real MPI ranks the RL is unchanged, with work
stealing and resizes beside it."""
from __future__ import annotations

import json
import os
import pickle
import time

import numpy as np
import pytest

from conftest import run_cli
from test_resize import assert_same_rl, timeline
from test_stealing import steals

from dynaresize.config import ModelConfig, RolloutConfig, WorkloadConfig
from dynaresize.plan.migration import TailRoster, tail_schedule
from dynaresize.data.model import prepare_checkpoint
from dynaresize.runtime.rollout.base import GroupRequest, make_engine, resume
from dynaresize.runtime.status import status_path
from dynaresize.data.workload import make_batch


def test_the_first_ranks_at_their_cut_are_the_tail_ranks():
    import torch.distributed as dist
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    roster = TailRoster(store, iteration=3, rollout_ranks=5, tail_ranks=2)
    tickets = {rank: roster.arrive(rank) for rank in (4, 1, 3, 2, 5)}       # the order they get there
    assert tickets == {4: 0, 1: 1, 3: 2, 2: 3, 5: 4}
    assert [roster.is_tail(t) for t in range(5)] == [True, True, False, False, False]
    assert [roster.tail_of(t) for t in (2, 3, 4)] == [4, 1, 4]                 # dealt in turn
    assert [roster.expected(t) for t in (0, 1)] == [2, 1]
    assert TailRoster(store, iteration=4, rollout_ranks=2, tail_ranks=4).tails == 1   # at least one source
    with pytest.raises(ValueError):
        TailRoster(store, iteration=5, rollout_ranks=1, tail_ranks=1)


def test_a_handed_off_group_continues_bit_identically(tmp_path):
    """Every threshold, from none to all of a rank's sequences: the source's finished groups plus
    what another engine resumes from the pickled handoffs are exactly an uninterrupted run, and
    the tail engine runs only the forward steps the source had not (no regeneration)."""
    checkpoint = prepare_checkpoint(ModelConfig(), str(tmp_path / "model"))
    source, tail = (make_engine(RolloutConfig(), checkpoint, "float32", "cpu", seed=0) for _ in range(2))
    requests = [GroupRequest(p, tuple(100 + 4 * i + j for j in range(4)), first_index=4 * i)
                for i, p in enumerate(make_batch(WorkloadConfig(), 1234, 0, 4, 4))]
    reference = source.generate(requests, 1.0)
    expected = {r.first_index: [(g.tokens, g.logprobs) for g in gens] for r, gens in zip(requests, reference)}
    forwards = []
    tail.model.register_forward_hook(lambda *_: forwards.append(1))
    kinds = set()
    for threshold in range(0, 17):
        finished, handoffs = source.generate_until(requests, 1.0, threshold)
        assert sum(h.running for h in handoffs) <= threshold
        assert [r for r, _ in finished] + [h.request for h in handoffs] == requests, "groups out of order"
        handoffs = pickle.loads(pickle.dumps(handoffs))                  # as sent over MPI
        forwards.clear()
        resumed = resume(tail, handoffs, 1.0)
        # a group of S steps takes S forwards (the prefill, then one after every step but the last);
        # the source ran the prefill and one after each of its p steps
        steps = [max(len(t) for t, _ in expected[h.request.first_index]) for h in handoffs]
        done = [max(map(len, h.state["tokens"])) if h.state is not None else -1 for h in handoffs]
        assert len(forwards) == sum(s - p - 1 for s, p in zip(steps, done)), threshold
        for req, gens in finished + [(h.request, g) for h, g in zip(handoffs, resumed)]:
            assert [(g.tokens, g.logprobs) for g in gens] == expected[req.first_index], (threshold, req.first_index)
        kinds |= {"running" if h.state is not None else "not started" for h in handoffs}
        for h in handoffs:
            if h.state is not None:
                assert h.prefix_lens == tuple(map(len, h.state["tokens"])) and h.generated > 0
    assert kinds == {"running", "not started"}, "the thresholds never handed off a running group"


def test_tail_migration_keeps_the_rl_exact(static_lag0_run, tmp_path):
    """4 ranks, synchronous, resizes between 1 and 2 train ranks (3 or 2 rollout ranks, the first
    at its cut the tail), work stealing: the same samples and bit-identical final weights as the
    static run."""
    run = tmp_path / "migration"
    run_cli(run, "policy=scripted", "policy.schedule=[1,2,1,1,2,2,1,2]", "run.max_lag=0", "run.iterations=8",
            "rollout.migration_threshold=6", "trainer.work_stealing=true")
    assert_same_rl(run, static_lag0_run, exact=True)
    tl = timeline(run)[0]
    events, samples = tl["events"], tl["samples"]
    migrations = events[events["name"] == b"migrate"]
    handed = [e for e in migrations if json.loads(e["attrs"])["sequences"] > 0]
    assert {int(e["iteration"]) for e in handed} == set(range(8)), "a migration every iteration"
    for e in handed:
        attrs = json.loads(e["attrs"])
        assert attrs["to"] != e["rank"] and 0 < attrs["sequences"] <= 6 and e["bytes"] > 0
        tail = [t for t in events if t["name"] == b"rollout" and t["rank"] == attrs["to"]
                and t["iteration"] == e["iteration"] and json.loads(t["attrs"]).get("tail")]
        assert len(tail) == 1 and tail[0]["end"] >= e["start"], "the tail rank continued the handed-off groups"
        assert json.loads(tail[0]["attrs"])["sequences"] >= attrs["sequences"]
        own = [t for t in events if t["name"] == b"rollout" and t["rank"] == e["rank"]
               and t["iteration"] == e["iteration"] and not json.loads(t["attrs"]).get("tail")]
        mine = samples[(samples["iteration"] == e["iteration"]) & (samples["rank"] == e["rank"])]
        assert len(mine) == 4 * (json.loads(own[0]["attrs"])["groups"] - attrs["groups"]), \
            "the handed-off groups' samples come from the tail rank"
    # tokens are counted once: the rollout events add up to the samples' responses
    rollout = events[events["name"] == b"rollout"]
    assert rollout["tokens"].sum() == samples["response_len"].sum()
    assert len(steals(run)) > 0, "no rollout rank helped the train step"


@pytest.mark.fault("a rollout rank killed (SIGKILL) in a tail migration, handing its last sequences off or "
                   "continuing another rank's", "the job ends within 60 s naming that rank and `migrate`; "
                   "the rank waiting for it does not hang")
def test_a_rank_killed_while_migrating_ends_the_job_naming_the_operation(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_cli(run_dir, "run.iterations=3", "rollout.migration_threshold=6",
                   check=False, timeout=120, env={"DYNARESIZE_INJECT_FAULT": "2:migrate"})
    ended = time.time()
    assert proc.returncode != 0
    assert "rank 2 died" in proc.stderr and "during migrate" in proc.stderr, proc.stderr[-3000:]
    # from the kill (its status, "migrate ...", is the rank's last write), not from the start:
    # start-up takes its share of a busy machine's CPU
    killed_at = os.stat(status_path(str(run_dir), 2)).st_mtime
    assert ended - killed_at < 60, f"the job ended {ended - killed_at:.0f} s after the kill"


def test_a_tail_rank_admits_what_arrives_into_its_running_batch():
    """CostModel.tail_times is the cost model's continuous batching with arrivals: sequences there
    at once cost what one rollout rank takes for them; a later arrival joins the running batch
    (it ends before the first sequence would have ended, then the second had to start) and
    lengthens the steps of those running beside it; tail_schedule deals the tickets in cut order."""
    from dynaresize.plan.costmodel import CostModel
    from dynaresize.sim import setup_from_overrides
    setup = setup_from_overrides(["+experiment=suite", "workload=stationary", "hardware=h100"])
    cm = CostModel.for_job(setup.cfg, setup.profile)
    rng = np.random.default_rng(0)
    remaining, context = rng.integers(1, 3000, 20), rng.integers(100, 2000, 20)
    together = cm.tail_times(np.zeros(20), remaining, context)
    alone = cm.rollout_times(np.zeros(20, dtype=np.int64), context, remaining[:, None], 1)[0]
    assert together.max() == pytest.approx(alone, rel=1e-12)
    assert np.argsort(together, kind="stable").tolist() == np.argsort(remaining, kind="stable").tolist()
    one = cm.tail_times([0.0], [2000], [500])[0]
    two = cm.tail_times([0.0, one / 2], [2000, 1000], [500, 500])
    assert one < two[0] < one * 1.05, "the arrival slows the running sequence's steps a little"
    assert two[1] < one / 2 + cm.tail_times([0.0], [1000], [500])[0] * 1.05
    assert two[1] == pytest.approx(two[0], rel=0.05), "admitted at once, not after the first ends"
    # tail_schedule: ranks 2, 0 reach their cuts first (tickets 0, 1: the tails); 3 and 1 are dealt to them
    cut = np.array([2.0, 4.0, 1.0, 3.0])
    rank, remaining, context = np.array([0, 1, 2, 3]), np.array([100, 100, 100, 100]), np.array([50, 50, 50, 50])
    end, runs = tail_schedule(cm, cut, rank, remaining, context, tail_ranks=2)
    assert [(tail, sources) for tail, sources, _, _ in runs] == [(2, [2, 3]), (0, [0, 1])]
    assert end[1] == 4.0 and end[3] == 3.0, "a rank that handed off is done at its cut"
    assert end[2] == pytest.approx(cm.tail_times([1.0, 3.0], [100, 100], [50, 50]).max(), rel=1e-12)
    end, runs = tail_schedule(cm, cut, rank, remaining, context, tail_ranks=1)
    assert [(tail, sources) for tail, sources, _, _ in runs] == [(2, [0, 1, 2, 3])]


def test_simulated_migration_is_the_policys_prediction(tmp_path):
    """The simulator's rollout stage with tail migration is IterationModel's (the dynamic policy's
    prediction): every rank to its cut, a `migrate` event where it hands off, one `rollout` event
    per tail rank, tokens counted once."""
    from dynaresize.plan.prediction import Lengths
    from dynaresize.sim import setup_from_overrides, simulate
    from dynaresize.sim.core import Simulator
    from dynaresize.timeline.reader import read_arrays
    setup = setup_from_overrides(["+experiment=suite", "workload=stationary", "cluster.ranks=64", "run.iterations=4",
                                  "policy=static", "policy.train_ranks=32", "sim.noise=0",
                                  "rollout.migration_threshold=1", "rollout.tail_ranks=2"])
    ev = read_arrays(simulate(setup, tmp_path / "run"), ("events",))[1]["events"]
    sim = Simulator(setup, tmp_path / "model")
    for it in range(4):
        rollout = ev[(ev["name"] == b"rollout") & (ev["iteration"] == it)]
        predicted = sim.model.rollout_times(Lengths.of(sim.batch(it)), 32)
        ends = np.full(64, -np.inf)
        np.maximum.at(ends, rollout["rank"], rollout["end"])
        start = rollout["start"].min()
        assert ends[32:] - start == pytest.approx(predicted, rel=1e-9, abs=1e-9)
        moved = ev[(ev["name"] == b"migrate") & (ev["iteration"] == it)]
        tails = {int(e["rank"]) for e in rollout if json.loads(e["attrs"] or b"{}").get("tail")}
        assert len(moved) > 0 and {json.loads(a)["to"] for a in moved["attrs"]} <= tails
        assert rollout["tokens"].sum() == sim.batch(it).response_lens.sum()


def test_migration_is_priced_only_for_continuous_batching():
    from dynaresize.sim import setup_from_overrides
    from dynaresize.sim.core import Simulator
    with pytest.raises(ValueError, match="continuous"):
        Simulator(setup_from_overrides(["+hardware=cpu_tiny", "rollout.migration_threshold=1"]))


def test_auto_migration_is_chosen_from_the_cost_model(tmp_path):
    """rollout.migration_threshold=auto: the cost model's predicted steady-state iteration with
    each (threshold, tail ranks) against none. Where migration is predicted to lose, none (the run
    is plain dynamic, to the last event); a run asked to take any migration short of doubling the
    iteration (policy.dead_band -1) takes the predicted best and simulates its hand-offs; the
    torch engine's sequential batching never migrates."""
    from dynaresize.plan.costmodel import CostModel
    from dynaresize.plan.policy import MIGRATION_CHOICES, choose_migration
    from dynaresize.sim import setup_from_overrides, simulate
    from dynaresize.timeline.reader import read_arrays
    base = ["+experiment=suite", "workload=stationary", "hardware=h100", "cluster.ranks=64", "run.iterations=4",
            "policy=dynamic", "trainer.work_stealing=true",
            "sim.charge_decisions=false"]      # the two runs' times compared exactly: not this machine's
    setup = setup_from_overrides(base + ["rollout.migration_threshold=auto"])
    threshold, tails, why = choose_migration(setup.cfg, CostModel.for_job(setup.cfg, setup.profile))
    assert threshold == 0 and "none: predicted" in why and "the best tail migration" in why
    plain = read_arrays(simulate(setup_from_overrides(base), tmp_path / "plain"), ("events",))[1]["events"]
    auto = read_arrays(simulate(setup, tmp_path / "auto"), ("events",))[1]["events"]
    assert np.array_equal(plain["end"], auto["end"])
    eager = setup_from_overrides(base + ["rollout.migration_threshold=auto"])
    eager.cfg.policy.dead_band = -1.0        # past validation (which wants >= 0): any migration will do
    threshold, tails, why = choose_migration(eager.cfg, CostModel.for_job(eager.cfg, eager.profile))
    assert (threshold, tails) in MIGRATION_CHOICES and f"threshold {threshold}, {tails} tail ranks" in why
    ev = read_arrays(simulate(eager, tmp_path / "eager"), ("events",))[1]["events"]
    assert (ev["name"] == b"migrate").any()
    cpu = setup_from_overrides(["+hardware=cpu_tiny", "policy=dynamic", "rollout.migration_threshold=auto"])
    assert choose_migration(cpu.cfg, CostModel.for_job(cpu.cfg, cpu.profile))[0] == 0
