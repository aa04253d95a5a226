"""Resume on a local run directory: checkpoints written as data and private, a resume with a
configuration that computes something else refused before anything starts, an old-format
checkpoint refused clearly. (Exact resume after a requeue: tests/test_slurm.py.)"""
from __future__ import annotations

import json
import os
import stat

import subprocess
import sys

import pytest
from conftest import ROOT, _env, run_cli

COMMON = ("run.iterations=3", "run.checkpoint_every=1", "run.report=false", "run.save_model=false",
          "cluster.ranks=2", "policy.train_ranks=1")


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.mark.fault('a resume with a changed seed or model; a checkpoint of the previous format (pickles)',
                   'exit 2 before anything starts or is written, naming the fields; checkpoints are data (JSON + HDF5), 0600 in 0700')
def test_checkpoint_is_private_data_and_resume_refuses_a_changed_computation(tmp_path):
    run = tmp_path / "run"
    run_cli(run, *COMMON)
    ckpt = sorted((run / "checkpoints").glob("iter-*"))[-1]           # the newest only is kept
    state = json.loads((ckpt / "state.json").read_text())            # data, no pickles
    # the newest is the last iteration's (the pipeline's drain, iteration 3, checkpoints nothing)
    assert state["iteration"] == 2 and state["format"] == 2 and len(state["run_id"]) == 16
    assert not list(ckpt.rglob("*.pkl"))
    shards = list(ckpt.rglob("rank*.h5"))
    assert shards and mode(ckpt) == 0o700
    assert all(mode(p) == 0o600 for p in [ckpt / "state.json", *shards])

    config = (run / "config.yaml").read_text()
    proc = run_cli(run, *COMMON, "run.seed=7", "model.hidden_size=256", check=False)
    assert proc.returncode == 2, proc.stderr
    assert "run.seed: 1234 in the checkpoint, 7 now" in proc.stderr and "model.hidden_size" in proc.stderr
    assert "starting" not in proc.stdout                           # refused before any rank started
    assert (run / "config.yaml").read_text() == config              # and before anything was written

    os.replace(ckpt / "state.json", ckpt / "state.pkl")               # what the previous format wrote
    proc = run_cli(run, *COMMON, check=False)
    assert proc.returncode == 2 and "older DynaResize (state.pkl" in proc.stderr, proc.stderr


def resume(run_dir, *overrides, check=True) -> subprocess.CompletedProcess:
    """`dynaresize run.resume=RUN_DIR OVERRIDES` (no Hydra run directory: the run's own)."""
    proc = subprocess.run([sys.executable, "-m", "dynaresize.launch.cli", f"run.resume={run_dir}", *overrides],
                          capture_output=True, text=True, timeout=300, env=_env(), cwd=ROOT)
    assert not check or proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.mark.fault("a finished run launched again",
                   "it says the run is complete (exit 0) and computes nothing; with more iterations it continues "
                   "exactly")
def test_a_finished_run_says_so_and_continues_exactly_with_more_iterations(static_run, tmp_path):
    """Checkpoints are on by default and one follows the last iteration: launched again, a
    finished run says it is complete (exit 0, nothing written); `run.resume` with a larger
    run.iterations continues it from the configuration it ran with, to the samples and weights of
    one run that long (the static 2T/2R run of 8 iterations)."""
    import h5py
    from safetensors.torch import load_file

    short, whole = tmp_path / "short", static_run[0]
    run_cli(short, "run.iterations=3", "policy.train_ranks=2")
    assert sorted(p.name for p in (short / "checkpoints").iterdir()) == ["iter-000002"]
    timeline = (short / "timeline.h5").read_bytes()

    again = run_cli(short, "run.iterations=3", "policy.train_ranks=2")
    assert f"{short} is a finished run of 3 iterations: nothing to do" in again.stdout, again.stdout
    assert "starting" not in again.stdout and (short / "timeline.h5").read_bytes() == timeline
    assert "nothing to do" in resume(short).stdout                          # its own config: 3

    proc = resume(short, "run.iterations=8")
    assert "resumed from" in proc.stdout and "iterations 0-2 done" in proc.stdout, proc.stdout
    assert "iter   3 (4/8)" in proc.stdout and "8 iterations and the pipeline's drain" in proc.stdout
    # The resumed attempt's clock goes on from the first's: times rise across attempts, and the
    # gap (here the seconds between the two commands) is counted as lost, and said so.
    from dynaresize import analysis
    tl = analysis.load_timeline(short)
    its = tl.iterations.sort_values("iteration")
    assert (its["start"].diff().dropna() > 0).all(), its[["iteration", "start", "end"]]
    tries = analysis.attempts(tl)
    assert tries["after_iteration"].tolist() == [2] and float(tries["lost_s"].iloc[0]) > 0, tries
    assert float(tries["start_s"].iloc[0]) < float(its.loc[its["iteration"] == 3, "start"].iloc[0])
    assert "resumed 1 time: " in proc.stdout and "attempt 2 resumed after iteration 2" in proc.stdout, proc.stdout
    assert [t.get_text() for t in analysis.gantt(tl).axes[0].texts] == ["attempt 2"]
    digests = []
    for run in (short, whole):
        with h5py.File(run / "timeline.h5", "r") as f:
            s = f["samples"][...]
            digests.append(sorted(zip(s["batch"].tolist(), s["index"].tolist(), s["digest"].tolist())))
            assert sorted(set(f["iterations"]["iteration"].tolist())) == list(range(9))
    assert digests[0] == digests[1] and len(digests[0]) == 8 * 32
    a = load_file(short / "final_model" / "model.safetensors")
    b = load_file(whole / "final_model" / "model.safetensors")
    assert a.keys() == b.keys() and all(bool((a[k] == b[k]).all()) for k in a)


def test_run_resume_takes_fields_only(tmp_path):
    proc = resume(tmp_path / "nothing", check=False)
    assert proc.returncode == 2 and "holds no config.yaml" in proc.stderr, proc.stderr
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("run:\n  iterations: 2\n")
    proc = resume(run, "policy=static", check=False)
    assert proc.returncode == 2 and "only fields can change" in proc.stderr and "policy=static" in proc.stderr
