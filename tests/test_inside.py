"""The inside-iteration estimate (dynaresize/sim/inside.py): tail migration and work stealing priced
with the cost model, an upper estimate that must stay between the per-iteration oracle and the bound."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from dynaresize.plan.costmodel import CostModel
from dynaresize.plan.prediction import IterationModel, Lengths
from dynaresize.data.shapes import batch_shape
from dynaresize.sim import inside
from dynaresize.sim.config import prepare
from dynaresize.sim.suite import compose_base

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def h100(max_num_seqs=None) -> CostModel:
    cm = CostModel("h100", samples_per_prompt=2, micro_batch_size=2, grad_reduce_bytes=4)
    if max_num_seqs is not None:
        cm.max_num_seqs = max_num_seqs
    return cm


def lengths(prompts, responses) -> Lengths:
    return Lengths(np.asarray(prompts, np.int64), np.asarray(responses, np.int64), np.arange(len(prompts)))


@pytest.mark.parametrize("slots", [None, 3])       # 3 slots: the ranks queue their sequences
def test_without_a_mechanism_the_schedule_is_the_cost_models(slots):
    cm = h100(slots)
    rng = np.random.default_rng(3)
    batch = lengths(rng.integers(10, 400, 24), rng.integers(1, 3000, (24, 2)))
    model = IterationModel(cm, 8, 1, 2)
    for k in (1, 3, 5):
        end, free = inside.rollout_with_migration(cm, batch, 8 - k, None)
        assert end == pytest.approx(model.rollout(batch, k), rel=1e-12)
        assert len(free) == 8 - k and free.max() == pytest.approx(end, rel=1e-12)


def test_a_long_tail_moves_to_one_rank_and_frees_the_others():
    """Rank 0 holds one 4,000-token response among short ones; with threshold 1 its tail moves on
    and every rank but the tail is free after its short sequences, while the rollout still lasts
    at least the long sequence decoded alone."""
    cm = h100()
    batch = lengths([50, 50, 50, 50], [[4000, 20], [20, 20], [20, 20], [20, 20]])
    plain, _ = inside.rollout_with_migration(cm, batch, 2, None)
    end, free = inside.rollout_with_migration(cm, batch, 2, inside.Mechanism(1, 0.5, True))
    assert len(free) == 1 and free.max() < 0.05 * plain        # the freed rank's time is its short work
    assert end >= cm.longest_decode_time(batch.prompt_lens, batch.response_lens) * (1 - 1e-12)
    # the tail rank decodes one sequence alone: no slower than the rank that held it with others
    assert end <= plain * (1 + 1e-12)
    prefill, _ = inside.rollout_with_migration(cm, batch, 2, inside.Mechanism(1, 0.5, False))
    assert prefill > end                                        # re-prefilling prompt + prefix costs


def test_helpers_share_the_train_work_from_when_they_are_free():
    cm = h100()
    model = IterationModel(cm, 8, 1, 2)
    batch = lengths([100] * 16, [[500, 500]] * 16)
    tok, mb = model.train_work(batch, 2)
    work = float(np.sum(cm.train_compute_time(tok, mb)))
    sync = cm.train_sync_time(2)
    assert inside.train_with_helpers(model, batch, 2, np.zeros(4)) == pytest.approx(work / 6 + sync, rel=1e-12)
    late = np.full(4, 1e6)                                       # free after the train step: no help
    assert inside.train_with_helpers(model, batch, 2, late) == pytest.approx(model.train(batch, 2), rel=1e-12)
    # one helper from t: 2 t + 3 (T - t) = work
    t = work / 4
    assert inside.train_with_helpers(model, batch, 2, np.array([t])) == pytest.approx((work + t) / 3 + sync, rel=1e-12)


def test_estimate_lies_between_the_oracle_and_the_bound(tmp_path):
    spec = compose_base("stationary", "h100", 64, ["run.iterations=3"])
    grid = (inside.Mechanism(2, 0.25, True), inside.Mechanism(8, 0.5, True))
    row = inside.estimate(spec, grid)
    assert row["bound_s"] <= row["inside_s"] <= row["oracle_s"] * (1 + 1e-12)
    assert row["inside_s"] <= row["inside_prefill_s"]
    assert row["bound_s"] <= row["foresight_s"]
    assert 0 <= inside.gap_closed(row, "inside_s") <= 1
    # the oracle row is the per-iteration best of the shared iteration model, summed
    setup = prepare(spec)
    cfg = setup.cfg
    cm = CostModel.for_job(cfg, setup.profile)
    model = IterationModel(cm, 64, 1, cfg.trainer.micro_batch_size, cfg.policy.resize_unit)
    b = [Lengths.of(batch_shape(cfg.workload, cfg.run.seed, i, cfg.rollout.prompts_per_batch, 8)) for i in range(3)]
    its = [(b[0], None), (b[1], b[0]), (b[2], b[1]), (None, b[2])]
    oracle = sum(min(model.iteration(g, t, k).total for k in model.candidates) for g, t in its)
    assert row["oracle_s"] == pytest.approx(oracle, rel=1e-12)
    # ... and the simulator's oracle run takes as long, iteration by iteration (within 1 %)
    from dynaresize import analysis
    from dynaresize.sim.core import Simulator
    from dynaresize.sim.suite import min_train_ranks, run_specs
    oracle_run = run_specs(spec, min_train_ranks(spec))["oracle"]
    tl = analysis.load_timeline(Simulator(prepare(oracle_run), str(tmp_path)).run())
    assert float(analysis.iteration_metrics(tl)["span_s"].sum()) == pytest.approx(oracle, rel=0.01)


def test_command_writes_the_table_and_refuses_a_sequential_profile(tmp_path):
    out = tmp_path / "inside.md"
    cmd = [sys.executable, "-m", "dynaresize.sim.inside", "--workloads", "dapo", "--out", str(out), "run.iterations=2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr
    table = out.read_text()
    assert "| h100 | 64 | `dapo` |" in table and "gap closed: inside" in table
    bad = subprocess.run(cmd[:-1] + ["--hardware", "cpu_tiny"], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert bad.returncode == 2 and "continuous-batching profile" in bad.stderr, bad.stderr
    typo = subprocess.run([sys.executable, "-m", "dynaresize.sim.cli", "inside", "--workloads", "nope"],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert typo.returncode == 2 and "unknown ['nope']" in typo.stderr, typo.stderr
