"""Submit the job to Slurm through submitit, then follow it.

Each Slurm task (one per GPU, `srun --mpi=pmix`) runs one rank in place. The submitted callable
is checkpointable: when Slurm requeues the job (preemption, `scontrol requeue`, or our own
requeue after a time-limit warning), it runs again on the same run directory and resumes from
the last checkpoint there.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time

from ..config import ConfigError, JobConfig
from ..timeline.reader import TIMELINE_FILE, open_timeline
from ..timeline.schema import TimelineError


class RankTask:
    """What every Slurm task runs: this rank of the job `cfg` (pickled by submitit)."""

    def __init__(self, cfg: JobConfig):
        self.cfg = cfg

    def __call__(self) -> str:
        from ..worker import run_rank
        run_rank(self.cfg)
        return self.cfg.run.output_dir

    def checkpoint(self):
        """Called by submitit on requeue: run the same task again; it resumes from disk."""
        import submitit
        return submitit.helpers.DelayedSubmission(RankTask(self.cfg))


def partition_capacity(partition: str | None) -> dict | None:
    """Nodes, CPUs and GPUs per node of the partition (sinfo), or None if Slurm cannot say."""
    if shutil.which("sinfo") is None:
        return None
    cmd = ["sinfo", "-h", "-o", "%P|%D|%c|%G"] + (["-p", partition] if partition else [])
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    rows = [line.split("|") for line in out.stdout.splitlines() if line.count("|") == 3]
    if partition is None:
        rows = [r for r in rows if r[0].endswith("*")]          # the default partition
    if out.returncode != 0 or not rows:
        return None
    gpus = [int(m.group(1)) for r in rows for m in [re.search(r"gpu(?::[^:,(]+)?:(\d+)", r[3])] if m]
    return {"partition": rows[0][0].rstrip("*"), "nodes": sum(int(r[1]) for r in rows),
            "cpus": max(int(r[2].rstrip("+")) for r in rows), "gpus": max(gpus, default=0)}


def check_fits(cfg: JobConfig) -> None:
    """Refuse, before submitting, a job the partition can never run (it would pend forever)."""
    c = cfg.cluster
    cap = partition_capacity(c.partition)
    if cap is None:
        return
    where = f"partition {cap['partition']!r}"
    problems = []
    if c.gpus_per_node > cap["gpus"]:
        problems.append(f"cluster.gpus_per_node={c.gpus_per_node} but nodes of {where} have "
                        f"{cap['gpus']} GPUs. Fix: request at most {cap['gpus']} per node (and more nodes)")
    if c.nodes > cap["nodes"]:
        problems.append(f"cluster.nodes={c.nodes} but {where} has {cap['nodes']} nodes. "
                        f"Fix: request at most {cap['nodes']}")
    if c.gpus_per_node * c.cpus_per_task > cap["cpus"]:
        problems.append(f"{c.gpus_per_node} tasks x cluster.cpus_per_task={c.cpus_per_task} exceed the "
                        f"{cap['cpus']} CPUs per node of {where}. Fix: lower cluster.cpus_per_task")
    if problems:
        raise ConfigError("this job cannot fit:\n" + "\n".join(f"  {p}." for p in problems))


def make_executor(cfg: JobConfig):
    import submitit

    c = cfg.cluster
    executor = submitit.AutoExecutor(folder=os.path.join(cfg.run.output_dir, "slurm", "%j"), cluster="slurm",
                                     slurm_max_num_timeout=c.max_requeues)
    params = dict(name="dynaresize", nodes=c.nodes, tasks_per_node=c.gpus_per_node,
                  gpus_per_node=c.gpus_per_node, cpus_per_task=c.cpus_per_task, timeout_min=c.time_min,
                  slurm_signal_delay_s=c.signal_delay_s,
                  slurm_srun_args=[f"--mpi={c.mpi}"],
                  slurm_setup=["export PMIX_MCA_psec=${PMIX_MCA_psec:-native}", *c.setup],
                  slurm_additional_parameters=dict(c.sbatch_extra))
    optional = {"slurm_partition": c.partition, "slurm_account": c.account, "slurm_qos": c.qos,
                "mem_gb": c.mem_gb}
    params.update({k: v for k, v in optional.items() if v is not None})
    executor.update_parameters(**params)
    return executor


def follow(job, cfg: JobConfig, poll_s: float = 2.0) -> int:
    """A progress line until the job ends; the exit code of the job."""
    timeline = os.path.join(cfg.run.output_dir, TIMELINE_FILE)
    total = cfg.run.iterations + cfg.run.max_lag
    last = None
    while not job.done():
        line = f"[dynaresize] job {job.job_id}: {job.state}, iteration {iterations_done(timeline)}/{total}"
        if line != last:
            print(line, flush=True)
            last = line
        time.sleep(poll_s)
    try:
        job.results()
    except Exception as e:  # noqa: BLE001 - submitit raises the rank's failure here
        print(f"dynaresize: Slurm job {job.job_id} failed: {e}\n  logs: {job.paths.folder}", file=sys.stderr)
        return 1
    print(f"[dynaresize] job {job.job_id} finished: {cfg.run.output_dir}", flush=True)
    return 0


def iterations_done(timeline: str) -> int:
    try:
        with open_timeline(timeline, swmr=True) as f:
            return len(f["iterations"])
    except (OSError, TimelineError):          # not written yet, or being created
        return 0


def launch(cfg: JobConfig, config_path: str) -> int:
    try:
        check_fits(cfg)
    except ConfigError as e:
        print(f"dynaresize: {e}", file=sys.stderr)
        return 2
    executor = make_executor(cfg)
    try:
        job = executor.submit(RankTask(cfg))
    except Exception as e:  # noqa: BLE001 - sbatch's own refusal, passed on in its words
        print(f"dynaresize: Slurm refused the job: {e}", file=sys.stderr)
        return 2
    print(f"[dynaresize] submitted Slurm job {job.job_id}: {cfg.cluster.nodes} node(s) x "
          f"{cfg.cluster.gpus_per_node} rank(s)\n  run directory: {cfg.run.output_dir}\n"
          f"  logs: {job.paths.stdout} (and .err)", flush=True)
    return follow(job, cfg) if cfg.cluster.wait else 0
