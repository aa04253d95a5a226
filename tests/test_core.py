"""Issue 2, the runnable core: a real 4-rank run, placement and split invariance, weight sync,
group reuse, and config validation."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import h5py
import numpy as np
import pytest

from conftest import ROOT, run_cli, run_ranks


def scenario_result(proc) -> dict:
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("OK ")][-1]
    return json.loads(line[3:])


def test_static_run_records_every_rank_every_iteration(static_run):
    run_dir, proc = static_run
    progress = [line for line in proc.stdout.splitlines() if line.startswith("[dynaresize] iter ")]
    assert [line.split()[2:4] for line in progress] == [[str(i), f"({i + 1}/8)"] for i in range(8)], proc.stdout
    assert sum(line.startswith("[dynaresize] drain ") for line in proc.stdout.splitlines()) == 1, proc.stdout
    with h5py.File(run_dir / "timeline.h5", "r") as f:
        assert bool(f.attrs["complete"])
        assert int(f.attrs["mpi_world_size"]) == 4
        assert int(f.attrs["groups_created_after_startup"]) == 0
        assert int(f.attrs["groups_created_at_startup"]) == 9    # 3 splits x (train, rollout, sync)
        assert 0 < f.attrs["decide_s_median"] <= f.attrs["decide_s_total"]     # rank 0's decisions, timed
        events, iterations = f["events"][...], f["iterations"][...]
        samples = f["samples"][...]
    assert list(iterations["iteration"]) == list(range(9))
    for it in range(9):
        ranks = set(events["rank"][events["iteration"] == it])
        assert ranks == {0, 1, 2, 3}, f"iteration {it} has events of ranks {ranks}"
    assert np.all(events["end"] >= events["start"])
    trained = events[events["name"] == b"train"]
    assert set(trained["rank"]) == {0, 1} and len(trained) == 2 * 8
    assert len(samples) == 8 * 32 and set(samples["rank"]) == {2, 3}
    assert (run_dir / "config.yaml").exists()


def test_default_run_shows_the_dynamic_policy_at_work(default_run):
    """The README's first command: the dynamic policy on long-tailed, growing responses starts
    from the cost model's split, resizes at least once and closes with a summary and a report."""
    run_dir, proc = default_run
    out = proc.stdout
    assert "policy.train_ranks=auto:" in out, out
    with h5py.File(run_dir / "timeline.h5", "r") as f:
        decisions = f["decisions"][...]
        assert bool(f.attrs["complete"]) and f.attrs["policy"] == "dynamic"
    # the iterations' resizes, and apart from them the move for the pipeline's drain, if any
    into_drain = int(decisions["action"][-2] == b"move")
    resizes = int((decisions["action"] == b"move").sum()) - into_drain
    assert resizes + into_drain >= 1
    assert "12 iterations and the pipeline's drain" in out and "[dynaresize] drain" in out, out
    assert f"{resizes} resizes" in out and ("the drain on" in out) == bool(into_drain), out
    assert "bubbles: train" in out and "hidden" in out, out
    assert f"report: {run_dir / 'report'}" in out and f"dynaresize-analyze {run_dir}" in out, out
    assert (run_dir / "report" / "gantt.png").exists() and (run_dir / "report" / "prediction.png").exists()


def test_the_summary_says_what_the_decisions_cost(default_run):
    """Rank 0 decides while every rank waits: the closing summary gives the decisions' median and
    their share of the run's wall time, from the timeline's attributes."""
    import re

    from dynaresize import analysis
    run_dir, proc = default_run
    m = analysis.run_metrics(analysis.load_timeline(run_dir))
    with h5py.File(run_dir / "timeline.h5", "r") as f:
        median, total = float(f.attrs["decide_s_median"]), float(f.attrs["decide_s_total"])
    assert m["decide_s_median"] == median and m["decide_share"] == pytest.approx(total / m["total_time_s"])
    assert 0 < m["decide_share"] < 1
    printed = re.search(r"decisions: median (\S+) s, ([\d.]+)% of the run", proc.stdout)
    assert printed, proc.stdout
    assert float(printed.group(1)) == float(f"{median:.2g}")
    assert abs(float(printed.group(2)) - 100 * m["decide_share"]) <= 0.05 + 1e-9


def test_printed_bubble_is_the_reports(default_run):
    """The progress line's bubble is the analysis' (busy = the union of each rank's busy events,
    so a background switch op that overlaps a stage is not counted twice)."""
    import re

    from dynaresize import analysis
    run_dir, proc = default_run
    iterations = 12                                  # the default config's; the drain is iteration 12
    printed = {int(m.group(1) or iterations): int(m.group(2)) for m in
               re.finditer(r"\[dynaresize\] (?:iter +(\d+) \(\d+/\d+\)|drain) .*? bubble +(\d+)%", proc.stdout)}
    ri = analysis.rank_iterations(analysis.load_timeline(run_dir))
    by_it = ri.groupby("iteration")[["busy_s", "span_s"]].sum()
    report = 100 * (1 - by_it["busy_s"] / by_it["span_s"])
    assert sorted(printed) == list(report.index), proc.stdout
    for it, pct in printed.items():
        assert abs(pct - report[it]) <= 0.5 + 1e-6, (it, pct, report[it])


def test_final_model_loads_with_transformers(default_run):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run_dir, _ = default_run
    model = AutoModelForCausalLM.from_pretrained(run_dir / "final_model")
    tokenizer = AutoTokenizer.from_pretrained(run_dir / "final_model")
    initial = AutoModelForCausalLM.from_pretrained(run_dir / "initial_model")
    ids = torch.tensor([tokenizer("123=")["input_ids"]])
    assert model(input_ids=ids).logits.shape[-1] == model.config.vocab_size
    changed = [n for (n, a), (_, b) in zip(model.named_parameters(), initial.named_parameters())
               if not torch.equal(a, b)]
    assert changed, "training did not change any weight"


def test_placement_invariance_1_vs_3_rollout_ranks(tmp_path):
    result = scenario_result(run_ranks(4, "placement", tmp_path))
    assert result["samples"] == 32 and result["ranks_three"] == [1, 2, 3]


def test_split_invariance_of_training_and_sharded_adamw(tmp_path):
    result = scenario_result(run_ranks(3, "split_training", tmp_path))
    for k in (2, 3):           # token-balanced micro-batches, engine and recomputed old log-probs
        assert result[f"one_vs_{k}_max_rel_diff"] == 0.0
        assert result[f"one_vs_{k}_recompute_max_rel_diff"] == 0.0
    assert result["sharded_adamw_vs_torch_max_rel_diff"] <= 1e-6


def test_weight_sync_is_bit_exact_and_creates_no_group(tmp_path):
    result = scenario_result(run_ranks(4, "weight_sync", tmp_path))
    assert result["rollout_ranks_checked"] == 3 and result["groups_created_after_startup"] == 0


def test_ranks_waiting_on_the_control_plane_leave_the_cores_to_the_others(tmp_path):
    result = scenario_result(run_ranks(3, "waiting", tmp_path))
    assert set(result["most_cpu_s_while_waiting"]) == {"bcast", "allgather", "gather", "barrier", "receive"}


def test_the_launcher_does_not_import_torch():
    """The launcher (config, validation, resume checks, local and Slurm launch) runs before the
    ranks start, on the critical path of every job: importing torch there costs seconds of CPU."""
    code = ("import sys, dynaresize.launch.cli, dynaresize.launch.local, dynaresize.launch.slurm, dynaresize.runtime.checkpoint, "
            "dynaresize.launch.validate; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stdout + proc.stderr


BAD_CONFIGS = [
    (["cluster.ranks=1"], "cluster.ranks"),
    (["policy.train_ranks=4"], "policy.train_ranks"),
    (["policy.train_ranks=0"], "policy.train_ranks"),
    (["trainer.micro_batch_size=5"], "trainer.micro_batch_size"),
    (["model.path=/nonexistent/checkpoint"], "model.path"),
    (["rollout.samples_per_prompt=1"], "rollout.samples_per_prompt"),
    (["run.max_lag=2"], "run.max_lag"),
    (["model.num_heads=8"], "model.num_heads"),
    (["cluster.launcher=kubernetes"], "cluster.launcher"),
    (["policy.name=greedy"], "policy.name"),
    (["run.iterations=many"], "run.iterations"),
    (["trainer.lr=-1"], "trainer.lr"),
    (["+run.speed=11"], "run.speed"),
    (["workload.length_max=300"], "model.max_position"),
    (["cluster.ranks=4", "policy.resize_unit=3"], "policy.resize_unit"),
    (["policy.name=colocated", "run.max_lag=1"], "run.max_lag"),
]


@pytest.mark.parametrize("overrides,field", BAD_CONFIGS, ids=[b[1] + ":" + b[0][-1] for b in BAD_CONFIGS])
def test_bad_config_is_refused_before_any_rank_starts(tmp_path, overrides, field):
    proc = run_cli(tmp_path, *overrides, check=False, timeout=60)
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert field in proc.stderr, proc.stderr
    if proc.returncode == 2:              # our validation; type errors are Hydra's own (exit code 1)
        assert "Fix" in proc.stderr, proc.stderr
    else:
        assert "could not be converted" in proc.stderr, proc.stderr
    assert "starting" not in proc.stdout                      # mpiexec was never called
    assert not (tmp_path / "config.yaml").exists() and not (tmp_path / "timeline.h5").exists()


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed here")
def test_vllm_without_vllm_fails_fast_with_install_hint(tmp_path):
    proc = run_cli(tmp_path, "rollout.engine=vllm", check=False, timeout=60)
    assert proc.returncode == 2 and "rollout.engine" in proc.stderr and "pip install" in proc.stderr
