"""Issue 4, against a real local Slurm cluster (slurm/testcluster, started by tests/run.sh):
submitit launch, Hydra multirun on Slurm, the sbatch template, requeue with exact resume, and
refusal of jobs that cannot fit."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time

import h5py
import numpy as np
import pytest
from safetensors.torch import load_file

from conftest import ROOT, run_cli

pytestmark = [pytest.mark.slurm,
              pytest.mark.skipif(not os.environ.get("DYNARESIZE_TESTCLUSTER_DIR") or not shutil.which("sbatch"),
                                 reason="no local Slurm test cluster (tests/run.sh starts one)")]


def attrs_and_iterations(run_dir):
    with h5py.File(os.path.join(run_dir, "timeline.h5"), "r", libver="latest", swmr=True) as f:
        return dict(f.attrs), f["iterations"]["iteration"][...], f["events"]["rank"][...], f["samples"][...]


def wait_for(predicate, timeout, what):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def newest_checkpoint(run_dir) -> int:
    root = os.path.join(run_dir, "checkpoints")
    done = [int(d[5:]) for d in os.listdir(root) if d.startswith("iter-")] if os.path.isdir(root) else []
    return max(done, default=-1)


def test_submitit_job_runs_4_ranks(tmp_path):
    proc = run_cli(tmp_path, "cluster=slurm", "run.iterations=2", timeout=300)
    assert re.search(r"submitted Slurm job \d+", proc.stdout) and "finished" in proc.stdout, proc.stdout
    attrs, its, ranks, _ = attrs_and_iterations(tmp_path)
    assert bool(attrs["complete"]) and int(attrs["mpi_world_size"]) == 4
    assert set(ranks) == {0, 1, 2, 3} and list(its) == [0, 1, 2]


def test_hydra_multirun_on_slurm_makes_one_job_per_point(tmp_path):
    sweep = tmp_path / "sweep"
    cmd = [sys.executable, "-m", "dynaresize.cli", "-m", "hydra/launcher=submitit_slurm",
           "policy=static", "policy.train_ranks=1,2", "run.iterations=2", f"hydra.sweep.dir={sweep}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    jobs = [d for d in os.listdir(sweep / ".submitit") if re.fullmatch(r"\d+_\d+", d)]
    assert len(jobs) == 2, jobs                     # one Slurm job (array task) per sweep point
    for point, k in (("0", 1), ("1", 2)):
        attrs, its, ranks, _ = attrs_and_iterations(sweep / point)
        assert bool(attrs["complete"]) and int(attrs["mpi_world_size"]) == 4 and set(ranks) == {0, 1, 2, 3}
        with h5py.File(sweep / point / "timeline.h5", "r") as f:
            assert set(f["iterations"]["train_ranks"]) == {k}


def test_sbatch_template(tmp_path):
    env = dict(os.environ, DYNARESIZE=os.path.join(os.path.dirname(sys.executable), "dynaresize"))
    proc = subprocess.run(["sbatch", "--wait", os.path.join(ROOT, "slurm", "dynaresize.sbatch"), "run.iterations=2"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job = re.search(r"Submitted batch job (\d+)", proc.stdout).group(1)
    attrs, its, ranks, _ = attrs_and_iterations(tmp_path / "outputs" / f"slurm-{job}")
    assert bool(attrs["complete"]) and int(attrs["mpi_world_size"]) == 4 and list(its) == [0, 1, 2]


def test_requeue_and_time_limit_warning_resume_exactly(tmp_path):
    """Interrupted twice, by `scontrol requeue` and by Slurm's warning signal (USR2): the job resumes
    each time and ends with the same weights as an uninterrupted run, each iteration once."""
    # Iterations long enough (~1 s) that each interruption lands mid-run: a requeued job keeps
    # running for a few seconds (submitit ignores SIGTERM until Slurm's KillWait has passed).
    common = ["run.iterations=24", "policy=scripted", "policy.schedule=[2,2,1,1,3,3,2]",
              "workload.length_median=48"]
    reference = tmp_path / "reference"
    run_cli(reference, *common)

    run = tmp_path / "slurm"
    proc = run_cli(run, *common, "cluster=slurm", "cluster.wait=false", "run.checkpoint_every=1", timeout=120)
    job = re.search(r"submitted Slurm job (\d+)", proc.stdout).group(1)

    wait_for(lambda: newest_checkpoint(run) >= 2, 180, "a checkpoint after iteration 3")
    subprocess.run(["scontrol", "requeue", job], check=True)
    wait_for(lambda: os.path.exists(run / "timeline.h5") and attrs_and_iterations(run)[0].get("resumed") == 1,
             180, "the requeued job to resume")
    first_resume = newest_checkpoint(run)
    wait_for(lambda: newest_checkpoint(run) > first_resume, 180, "progress after the resume")
    subprocess.run(["scancel", "--signal=USR2", job], check=True)      # what Slurm sends before the limit
    wait_for(lambda: attrs_and_iterations(run)[0].get("resumed") == 2, 180, "the second resume")
    wait_for(lambda: os.path.exists(run / "final_model" / "model.safetensors")
             and bool(attrs_and_iterations(run)[0]["complete"]), 240, "the job to finish")

    attrs, its, _, samples = attrs_and_iterations(run)
    assert list(its) == list(range(25)), f"iterations lost or repeated: {list(its)}"
    keys = samples[["batch", "index"]]
    assert len(samples) == 24 * 32 and len(np.unique(keys)) == len(keys)
    log = open(next((run / "slurm" / job).glob("*_0_log.out"))).read()
    assert "Slurm warned of the job's end: checkpointed" in log
    a = load_file(run / "final_model" / "model.safetensors")
    b = load_file(reference / "final_model" / "model.safetensors")
    diff = max(float(((a[k] - b[k]).abs() / b[k].abs().clamp_min(1e-6)).max()) for k in a)
    assert diff <= 1e-5, f"max relative difference {diff}"


@pytest.mark.parametrize("overrides,message", [
    (["cluster.gpus_per_node=8"], "cluster.gpus_per_node=8 but nodes of partition 'debug' have 4 GPUs"),
    (["cluster.nodes=2", "cluster.gpus_per_node=2"], "cluster.nodes=2 but partition 'debug' has 1 nodes"),
])
def test_job_that_cannot_fit_is_refused_before_submission(tmp_path, overrides, message):
    before = subprocess.run(["squeue", "-h", "-t", "all", "-o", "%i"], capture_output=True, text=True).stdout
    proc = run_cli(tmp_path, "cluster=slurm", *overrides, check=False, timeout=60)
    assert proc.returncode == 2 and message in proc.stderr and "Fix:" in proc.stderr, proc.stderr
    assert subprocess.run(["squeue", "-h", "-t", "all", "-o", "%i"], capture_output=True, text=True).stdout == before
