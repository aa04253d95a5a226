"""Tail migration (rollout.migration_threshold): a rollout rank hands its last sequences to a tail
rank, which continues them bit-identically; on real MPI ranks the RL is unchanged, with work
stealing and resizes beside it."""
from __future__ import annotations

import json
import pickle
import time

import numpy as np
import pytest

from conftest import run_cli
from test_resize import assert_same_rl, timeline
from test_stealing import steals

from dynaresize.config import ModelConfig, RolloutConfig, WorkloadConfig
from dynaresize.migration import TailRoster, tail_schedule
from dynaresize.model import prepare_checkpoint
from dynaresize.rollout.base import GroupRequest, make_engine
from dynaresize.workload import make_batch


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
        resumed = tail.resume(handoffs, 1.0)
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
                and t["iteration"] == e["iteration"] and json.loads(t["attrs"]).get("migrated_from") == int(e["rank"])]
        assert len(tail) == 1 and tail[0]["start"] >= e["start"], "the tail rank continued the handed-off groups"
        own = [t for t in events if t["name"] == b"rollout" and t["rank"] == e["rank"]
               and t["iteration"] == e["iteration"] and "migrated_from" not in json.loads(t["attrs"])]
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
    start = time.monotonic()
    proc = run_cli(tmp_path / "run", "run.iterations=3", "rollout.migration_threshold=6",
                   check=False, timeout=120, env={"DYNARESIZE_INJECT_FAULT": "2:migrate"})
    assert proc.returncode != 0
    assert "rank 2 died" in proc.stderr and "during migrate" in proc.stderr, proc.stderr[-3000:]
    assert time.monotonic() - start < 60


def test_tail_schedule_prices_the_runtimes_hand_offs():
    """The first ranks at their cut finish their own last sequences, then the later ranks' in
    ticket order, each from when it arrives (dealt in turn over the tail ranks)."""
    cut, finish = [1.0, 2.0, 3.0, 4.0], [0.5, 0.0, 2.0, 1.0]
    end, continuations = tail_schedule(cut, finish, tail_ranks=1)
    assert end.tolist() == [6.0, 2.0, 3.0, 4.0]
    assert continuations == [(0, 0, 1.0, 1.5), (0, 2, 3.0, 5.0), (0, 3, 5.0, 6.0)]
    end, _ = tail_schedule(cut, finish, tail_ranks=2)      # tickets 2 and 3 go to the tails of 0 and 1
    assert end.tolist() == [5.0, 5.0, 3.0, 4.0]
    end, _ = tail_schedule([3.0, 1.0], [1.0, 1.0], tail_ranks=1)   # tickets follow the cuts, not the ranks
    assert end.tolist() == [3.0, 4.0]


def test_simulated_migration_is_the_policys_prediction(tmp_path):
    """The simulator's rollout stage with tail migration is IterationModel's (the dynamic policy's
    prediction): every rank to its cut, a `migrate` event where it hands off, one `rollout` event
    per continuation, tokens counted once."""
    from dynaresize.prediction import Lengths
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
        continued = [json.loads(a or b"{}").get("migrated_from") for a in rollout["attrs"]]
        assert len(moved) > 0 and {int(r) for r in moved["rank"]} <= {c for c in continued if c is not None}
        assert rollout["tokens"].sum() == sim.batch(it).response_lens.sum()


def test_migration_is_priced_only_for_continuous_batching():
    from dynaresize.sim import setup_from_overrides
    from dynaresize.sim.core import Simulator
    with pytest.raises(ValueError, match="continuous"):
        Simulator(setup_from_overrides(["+hardware=cpu_tiny", "rollout.migration_threshold=1"]))
