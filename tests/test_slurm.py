"""Against a real local Slurm cluster of two nodes with accounting (slurm/testcluster, started by
tests/run.sh): a two-node run resharding over the network, Hydra multirun on Slurm, the sbatch
template, a node failure, warnings and the requeue limit with exact resume, and refusal of jobs
that cannot fit."""
from __future__ import annotations

import concurrent.futures
import json
import os
import re
import shutil
import subprocess
import sys
import time

import h5py
import numpy as np
import pytest

from dynaresize import analysis
from conftest import ROOT, run_cli
from test_resize import assert_same_rl, timeline

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


def sacct_states(job) -> list[str]:
    """Every attempt of the job, oldest first, as Slurm's accounting (slurmdbd) recorded it."""
    out = subprocess.run(["sacct", "-j", str(job), "--duplicates", "--allocations", "--noheader", "--parsable2",
                          "-o", "State"], capture_output=True, text=True, check=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


TWO_NODES = ["cluster=slurm", "cluster.nodes=2", "cluster.gpus_per_node=2",
             # /var/tmp is each test node's own disk: a staged file is not visible from the other node
             "cluster.local_scratch=/var/tmp"]


def test_two_node_resizes_move_training_state_over_the_network_exactly(static_run, tmp_path):
    """4 ranks on 2 nodes, resized so that training state crosses nodes: the network transport
    reshards it, and the weights equal a one-node static run's bit for bit (the static 2T/2R run
    of 8 iterations)."""
    run = tmp_path / "slurm"
    proc = run_cli(run, *TWO_NODES, "policy=scripted", "policy.schedule=[1,3,2,1]", "run.iterations=8", timeout=300)
    job = re.search(r"submitted Slurm job (\d+): 2 node\(s\) x 2 rank\(s\)", proc.stdout).group(1)
    (tl, attrs) = timeline(run)
    assert json.loads(attrs["hostnames"]) == ["node1", "node1", "node2", "node2"] and bool(attrs["complete"])
    ev = tl["events"]
    names = [n.decode() for n in ev["name"]]
    reshards = [e for e, n in zip(ev, names) if n == "reshard"]
    # The moves that put training state on node2 or take it from there (1->3 and 3->2 train
    # ranks) reshard over the network: node2's rank 2 takes part, and state is sent (bytes sent).
    for it in (1, 2):
        ops = [e for e in reshards if e["iteration"] == it]
        assert 2 in {int(e["rank"]) for e in ops} and sum(int(e["bytes"]) for e in ops) > 0, it
    assert {int(e["iteration"]) for e in reshards} == {1, 2}
    assert "stage_out" in names             # 2->1 keeps training state on node1: the file transport
    fig = analysis.gantt(analysis.load_timeline(run), tmp_path / "gantt.png")
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == ["0 node1", "1 node1", "2 node2", "3 node2"]
    assert_same_rl(run, static_run[0], exact=True)
    # The ranks' result is in before the job has ended: wait for Slurm's accounting to close it.
    wait_for(lambda: sacct_states(job) == ["COMPLETED"], 60, f"sacct to report job {job} COMPLETED")
    tres = subprocess.run(["sacct", "-j", job, "--allocations", "--noheader", "--parsable2", "-o", "AllocTRES"],
                          capture_output=True, text=True, check=True).stdout
    assert "gres/gpu=4" in tres, f"the job's 4 GPUs are not accounted: {tres!r}"


def test_fully_sharded_training_across_nodes_ships_its_files(static_run, tmp_path):
    """trainer.sharding=full on 2 nodes: a resize whose train block spans both nodes sends the
    saved shard files to the node that reads them (a reshard of files, switchplan.file_routes);
    the run trains what the one-node ZeRO-1 run trains (FSDP2's tolerance)."""
    from test_fsdp_trainer import FULL, assert_same_rl as assert_same_rl_full
    run = tmp_path / "slurm"
    run_cli(run, *TWO_NODES, FULL, "policy=scripted", "policy.schedule=[1,3,2,1]", "run.iterations=8", timeout=300)
    ev = timeline(run)[0]["events"]
    reshards = ev[ev["name"] == b"reshard"]
    # 1 -> 3 train ranks: node2's rank 2 receives writer 0's file; 3 -> 2: each node gets the other's
    for it, receivers in ((1, {2}), (2, {0, 2})):
        moved = reshards[(reshards["iteration"] == it) & (reshards["bytes"] > 0)]
        assert receivers <= set(moved["rank"].tolist()), (it, moved)
    assert set(reshards["iteration"].tolist()) == {1, 2}
    assert_same_rl_full(run, static_run[0])


def test_a_fully_sharded_run_on_two_nodes_resumes_on_one(tmp_path):
    """What a user does after losing a node: the run (trainer.sharding=full, 2 nodes) is submitted
    again on the node left, and its sharded checkpoint resumes on 2 ranks instead of 4."""
    from test_fsdp_trainer import FULL
    run = tmp_path / "slurm"
    run_cli(run, *TWO_NODES, FULL, "policy.train_ranks=1", "run.iterations=2", timeout=300)
    run_cli(run, "cluster=slurm", "cluster.nodes=1", "cluster.gpus_per_node=2", "cluster.local_scratch=/var/tmp",
            FULL, "policy.train_ranks=1", "run.iterations=4", timeout=300)
    attrs, its, _, _ = attrs_and_iterations(run)
    assert bool(attrs["complete"]) and {0, 1, 2, 3} <= set(its.tolist())
    rows = timeline(run)[0]["iterations"]
    assert {int(r["rollout_ranks"]) for r in rows if r["iteration"] in (0, 1)} == {3}      # 1T/3R on 2 nodes
    assert {int(r["rollout_ranks"]) for r in rows if r["iteration"] == 3} == {1}           # 1T/1R on 1 node


def test_hydra_multirun_on_slurm_makes_one_job_per_point(tmp_path):
    sweep = tmp_path / "sweep"
    cmd = [sys.executable, "-m", "dynaresize.launch.cli", "-m", "hydra/launcher=submitit_slurm",
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


@pytest.mark.fault("a node of a 2-node Slurm job lost mid-run (its slurmd and ranks killed, the node DOWN until "
                   "it is started again); then Slurm's end-of-job warning (USR2), more times than "
                   "cluster.max_requeues allows",
                   "the follower names the node, its reason and what its ranks were doing; the other node's ranks "
                   "end and the requeued job waits for a node; once the node is back it resumes and removes the "
                   "staging the lost attempt left on both nodes; a warning checkpoints and requeues, the one past "
                   "the limit checkpoints and stops with the fix; submitted again, it ends with the same weights "
                   "(bit for bit)")
def test_node_failure_warnings_and_the_requeue_limit_resume_exactly(tmp_path):
    """A 2-node job loses a node (every process on it killed; it stays down until started again),
    then is warned of its end (USR2) twice with cluster.max_requeues=2: Slurm requeues it after the
    node failure (reported with the node and what its ranks were doing) and it waits for the node,
    the ranks requeue it after the first warning and stop after the second. Submitted again, it resumes and ends with the same weights as an uninterrupted run,
    each iteration once. Slurm's accounting has every attempt."""
    # Iterations long enough (1-3 s on 2 cores) that each interruption lands mid-run; the three
    # interruptions take 7 of the 14 iterations.
    common = ["run.iterations=14", "policy=scripted", "policy.schedule=[2,2,1,1,3,3,2]",
              "workload.length_median=24", "workload.length_growth=0"]
    reference = tmp_path / "reference"       # the uninterrupted run, beside the Slurm job (which mostly waits)
    uninterrupted = concurrent.futures.ThreadPoolExecutor(1).submit(run_cli, reference, *common)

    run = tmp_path / "slurm"
    before = {node: set(staging_on(node)) for node in ("node1", "node2")}      # other runs'
    cmd = [sys.executable, "-m", "dynaresize.launch.cli", f"hydra.run.dir={run}", *common, *TWO_NODES,
           "run.checkpoint_every=1", "cluster.max_requeues=2"]
    out = open(tmp_path / "follow.log", "w+")
    follower = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    wait_for(lambda: re.search(r"submitted Slurm job (\d+)", open(tmp_path / "follow.log").read()), 60, "the job id")
    job = re.search(r"submitted Slurm job (\d+)", open(tmp_path / "follow.log").read()).group(1)

    def resumed(n):
        try:
            return attrs_and_iterations(run)[0].get("resumed", 0) == n
        except OSError:     # not written yet, or a rank is between opening it and switching to SWMR
            return False

    def progress_after_resume():
        first = newest_checkpoint(run)
        wait_for(lambda: newest_checkpoint(run) > first, 180, "progress after the resume")

    wait_for(lambda: newest_checkpoint(run) >= 2, 180, "a checkpoint after iteration 3")
    at_failure = newest_checkpoint(run)
    # node2 is lost: every process on it (slurmd, step daemons, ranks 2 and 3) killed at once. Slurm
    # marks such a node DOWN after SlurmdTimeout (30 s here); the test does at once what slurmctld
    # then does.
    cluster_node("node2", "lose")
    subprocess.run(["scontrol", "update", "nodename=node2", "state=down", "reason=test: node lost"], check=True)
    # Slurm ends the attempt (NODE_FAIL) and requeues the job, which waits: one node is not enough.
    wait_for(lambda: job_state(job) == "PENDING", 60, "the requeued job to wait for a node")
    wait_for(lambda: not processes_on("node1"), 60, "the job's processes on node1 to end")
    lost = set(staging_on("node2")) - before["node2"]
    assert lost, "the lost ranks' staging is not on node2's disk"
    checkpoint_at_loss = newest_checkpoint(run)
    time.sleep(3)
    assert job_state(job) == "PENDING" and newest_checkpoint(run) == checkpoint_at_loss
    # The node comes back; it is idle once its slurmd registers (ReturnToService=2), and the job resumes.
    cluster_node("node2", "start")
    wait_for(lambda: resumed(1), 180, "the resume after the node failure")
    progress_after_resume()
    subprocess.run(["scancel", "--signal=USR2", job], check=True)       # what Slurm sends before the limit
    wait_for(lambda: resumed(2), 180, "the resume after the first warning")
    progress_after_resume()
    subprocess.run(["scancel", "--signal=USR2", job], check=True)
    assert follower.wait(timeout=180) == 1
    followed = open(tmp_path / "follow.log").read()
    assert re.search(r"ended NODE_FAIL: node node2 failed \(DOWN: test: node lost\) while rank 2: \w+.*; rank 3: \w+",
                     followed), followed
    # Slurm's SIGTERM ends the ranks at once (submitit would bypass it): the report names the
    # iteration the node was lost in, not one the ranks ran on to.
    node_fail = re.search(r"ended NODE_FAIL: .*", followed).group(0)
    named = [int(i) for i in re.findall(r"iteration (\d+)", node_fail)]
    assert named and max(named) <= at_failure + 2, (at_failure, node_fail)
    assert "ended REQUEUED; Slurm requeues it and it resumes from the last checkpoint" in followed, followed
    assert "RequeueLimit: Slurm warned of the job's end after 2 restart(s) (cluster.max_requeues=2)" in followed
    assert sacct_states(job) == ["NODE_FAIL", "REQUEUED", "FAILED"]

    run_cli(run, *common, *TWO_NODES, "cluster.max_requeues=2", timeout=300)     # submitted again
    attrs, its, _, samples = attrs_and_iterations(run)
    assert list(its) == list(range(15)), f"iterations lost or repeated: {list(its)}"
    keys = samples[["batch", "index"]]
    assert len(samples) == 14 * 32 and len(np.unique(keys)) == len(keys)
    log = open(next((run / "slurm" / job).glob("*_0_log.out"))).read()
    assert "requeueing (restart 2 of at most 2)" in log
    uninterrupted.result()
    assert_same_rl(run, reference, exact=True)
    for node in before:         # the next attempt removed what the lost one left; its own is gone
        assert set(staging_on(node)) <= before[node], f"staging left on {node}: {staging_on(node)}"


def cluster_node(node: str, action: str) -> None:
    subprocess.run(["bash", os.path.join(ROOT, "slurm", "testcluster", "node.sh"),
                    os.environ["DYNARESIZE_TESTCLUSTER_DIR"], node, action], check=True, timeout=180)


def processes_on(node: str) -> list[str]:
    """The processes on a test node other than its slurmd: a job's step daemons and ranks."""
    pids = subprocess.run(["ip", "netns", "pids", f"drtc-{node}"], capture_output=True, text=True).stdout.split()
    return [pid for pid in pids if _comm(pid) not in ("slurmd", "")]


def staging_on(node: str) -> list[str]:
    """The job staging directories on a test node's own disk (its /var/tmp)."""
    scratch = os.path.join(os.environ["DYNARESIZE_TESTCLUSTER_DIR"], "nodes", node, "var-tmp")
    return [name for name in os.listdir(scratch) if name.startswith("dynaresize-")]


def job_state(job) -> str:
    out = subprocess.run(["squeue", "-h", "-t", "all", "-j", str(job), "-o", "%T"], capture_output=True, text=True)
    return out.stdout.strip() or "GONE"


@pytest.mark.fault("SIGTERM to every process of a 2-node job under the srun launcher (scancel --signal=TERM "
                   "--full), as a cancel sends it",
                   "the launcher stops srun's tasks on both nodes, removes the staging, mends the timeline and "
                   "exits 143 saying so; no rank is left")
def test_sigterm_to_a_job_under_srun_stops_it_cleanly(tmp_path):
    scratch = tmp_path / "scratch"            # both test nodes see this folder (one machine)
    scratch.mkdir()
    env = dict(os.environ, DYNARESIZE=os.path.join(os.path.dirname(sys.executable), "dynaresize"))
    sub = subprocess.run(["sbatch", "--nodes=2", "--ntasks-per-node=2", "--gpus-per-node=2",
                          os.path.join(ROOT, "slurm", "dynaresize.sbatch"), "run.iterations=200", "policy=static",
                          "policy.train_ranks=2", "run.report=false", f"cluster.local_scratch={scratch}"],
                         capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env, check=True)
    job = re.search(r"Submitted batch job (\d+)", sub.stdout).group(1)
    out, run = tmp_path / f"slurm-{job}.out", tmp_path / "outputs" / f"slurm-{job}"
    try:
        wait_for(lambda: out.exists() and "[dynaresize] iter " in out.read_text(), 180, "the first iteration")
        assert list(scratch.iterdir()), "no staging directory"
        subprocess.run(["scancel", "--signal=TERM", "--full", job], check=True)
        wait_for(lambda: job_state(job) not in ("PENDING", "CONFIGURING", "RUNNING"), 60, "the job to end")
    finally:
        subprocess.run(["scancel", job], check=False)
    text = out.read_text()
    assert "dynaresize: stopped by SIGTERM: the ranks were stopped and the job's staged state removed" in text, text
    assert not list(scratch.iterdir()), list(scratch.iterdir())
    config = str(run / "config.yaml").encode()
    ranks = [pid for pid in os.listdir("/proc") if pid.isdigit() and config in _cmdline(pid)]
    assert not ranks, f"ranks outlived the job: {ranks}"
    with h5py.File(run / "timeline.h5", "r") as f:           # mended: plain h5py opens it
        assert len(f["iterations"]) >= 1


def _comm(pid: str) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def _cmdline(pid: str) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


@pytest.mark.parametrize("overrides,message", [
    (["cluster.gpus_per_node=8"], "cluster.gpus_per_node=8 but nodes of partition 'debug' have 4 GPUs"),
    (["cluster.nodes=3", "cluster.gpus_per_node=2"], "cluster.nodes=3 but partition 'debug' has 2 nodes"),
])
def test_job_that_cannot_fit_is_refused_before_submission(tmp_path, overrides, message):
    def job_ids():
        return set(subprocess.run(["squeue", "-h", "-t", "all", "-o", "%i"],
                                  capture_output=True, text=True, check=True).stdout.split())

    before = job_ids()
    proc = run_cli(tmp_path, "cluster=slurm", *overrides, check=False, timeout=60)
    assert proc.returncode == 2 and message in proc.stderr and "Fix:" in proc.stderr, proc.stderr
    # Finished jobs of earlier tests may age out of the controller (MinJobAge) meanwhile;
    # a job submitted here would stay listed for at least that long.
    assert job_ids() - before == set()
