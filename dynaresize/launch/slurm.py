"""Submit the job to Slurm through submitit, then follow it.

Each Slurm task (one per GPU, `srun --mpi=pmix`) runs one rank in place. When Slurm restarts the
job (preemption, node failure, `scontrol requeue`, or the ranks' own requeue after Slurm's warning,
preemption.py), the same task runs again on the same run directory and resumes from the last
checkpoint there. Following the job, each attempt that ended early is reported from Slurm's
accounting (sacct): how it ended, and for a node failure which node and what the ranks there were
doing (their status files).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time

from ..config import ConfigError, JobConfig
from ..timeline.reader import TIMELINE_FILE, open_timeline
from ..timeline.schema import TimelineError
from ..runtime.status import rank_status


# States in which a job may still run (a requeued job is PENDING again), and the ends of an
# attempt after which Slurm runs the job again.
ACTIVE_STATES = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "REQUEUE_HOLD",
                 "REQUEUE_FED", "RESIZING", "SIGNALING", "STAGE_OUT"}
REQUEUED_STATES = ("NODE_FAIL", "PREEMPTED", "REQUEUED")


class RankTask:
    """What every Slurm task runs: this rank of the job `cfg` (pickled by submitit). It has no
    `checkpoint()`: Slurm's warning signal is DynaResize's (preemption.py), not submitit's."""

    def __init__(self, cfg: JobConfig):
        self.cfg = cfg

    def __call__(self) -> str:
        from ..runtime.worker import run_rank
        run_rank(self.cfg)
        return self.cfg.run.output_dir


def _slurm_json(cmd: list[str]) -> dict | None:
    """The JSON answer of a Slurm command (`--json`, Slurm 21.08+), or None if it gives none."""
    if shutil.which(cmd[0]) is None:
        return None
    try:
        out = subprocess.run([*cmd, "--json"], capture_output=True, text=True, timeout=30)
        return json.loads(out.stdout) if out.returncode == 0 else None
    except (subprocess.TimeoutExpired, json.JSONDecodeError):
        return None


def default_partition() -> str | None:
    out = subprocess.run(["scontrol", "show", "partition", "--oneliner"], capture_output=True, text=True,
                         timeout=30)
    for line in out.stdout.splitlines():
        fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
        if fields.get("Default") == "YES":
            return fields.get("PartitionName")
    return None


def partition_capacity(partition: str | None) -> dict | None:
    """Nodes, CPUs and GPUs per node of the partition (`sinfo --json`), or None if Slurm cannot say."""
    info = _slurm_json(["sinfo"])
    partition = partition or default_partition()
    if info is None or partition is None:
        return None
    nodes = [n for n in info.get("nodes", []) if partition in n.get("partitions", [])]
    if not nodes:
        return None
    gpus = [int(m.group(1)) for n in nodes for m in [re.search(r"gpu(?::[^:,(]+)?:(\d+)", n.get("gres", ""))] if m]
    return {"partition": partition, "nodes": len(nodes), "cpus": max(int(n["cpus"]) for n in nodes),
            "gpus": max(gpus, default=0)}


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
    # cluster.max_requeues is enforced by the ranks (preemption.py), not by submitit's handler.
    executor = submitit.AutoExecutor(folder=os.path.join(cfg.run.output_dir, "slurm", "%j"), cluster="slurm")
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
    """A progress line until the job ends, and a line for every attempt that ended early; the
    exit code of the job."""
    timeline = os.path.join(cfg.run.output_dir, TIMELINE_FILE)
    total = cfg.run.iterations + cfg.run.max_lag
    last, reported = None, 0
    while True:
        state, restarts = live_state(job.job_id)
        # Slurm's own state: submitit takes a node failure or a requeue for the job's end.
        done = state not in ACTIVE_STATES if state is not None else job.done(force_check=True)
        if done or reported < restarts:          # accounting is asked only when an attempt ended
            history = attempts(job.job_id)
            ended = history if done else history[:-1]
            for attempt in ended[reported:]:
                if attempt["state"] != "COMPLETED":
                    print(f"[dynaresize] job {job.job_id}: {explain_attempt(attempt, cfg)}", flush=True)
            reported = max(reported, len(ended))
        if done:
            break
        line = f"[dynaresize] job {job.job_id}: {state}, iteration {iterations_done(timeline)}/{total}"
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


def live_state(job_id: str) -> tuple[str | None, int]:
    """The job's state and restart count as slurmctld holds them now (`scontrol show job
    --oneliner`); (None, 0) once slurmctld has forgotten the job."""
    out = subprocess.run(["scontrol", "show", "job", "--oneliner", str(job_id)], capture_output=True, text=True,
                         timeout=30)
    fields = dict(f.split("=", 1) for f in out.stdout.split() if "=" in f)
    if out.returncode != 0:
        return None, 0
    return fields.get("JobState"), int(fields.get("Restarts", "0") or 0)


def attempts(job_id: str) -> list[dict]:
    """Every run of the job so far, oldest first (Slurm's accounting, `sacct --duplicates`): its
    state, nodes and start/end times. Empty if accounting cannot say."""
    info = _slurm_json(["sacct", "--jobs", str(job_id), "--duplicates", "--allocations"]) or {}
    return [{"state": j["state"]["current"], "nodes": j["nodes"], "start": j["time"]["start"],
             "end": j["time"]["end"]} for j in info.get("jobs", [])]


def explain_attempt(attempt: dict, cfg: JobConfig) -> str:
    """How an attempt of the job ended; for a node failure, which node (from the node events in
    the accounting) and what the ranks on it were doing."""
    text = f"an attempt on {attempt['nodes']} ended {attempt['state']}"
    if attempt["state"] == "NODE_FAIL":
        hosts = expand_hostlist(attempt["nodes"])
        for node, reason in failed_nodes(hosts, attempt["start"], attempt["end"]):
            ranks = [r for r in range(cfg.cluster.ranks) if hosts[r // cfg.cluster.gpus_per_node] == node] \
                if len(hosts) == cfg.cluster.nodes else []
            doing = "; ".join(f"rank {r}: {rank_status(cfg.run.output_dir, r) or 'not started'}" for r in ranks)
            text += f": node {node} failed ({reason})" + (f" while {doing}" if doing else "")
    return text + "; Slurm requeues it and it resumes from the last checkpoint" \
        if attempt["state"] in REQUEUED_STATES else text


def expand_hostlist(hostlist: str) -> list[str]:
    out = subprocess.run(["scontrol", "show", "hostnames", hostlist], capture_output=True, text=True, timeout=30)
    return out.stdout.split()


def failed_nodes(hosts: list[str], start: int, end: int) -> list[tuple[str, str]]:
    """(node, reason) of `hosts` that went down between `start` and shortly after `end` (epoch s),
    from the node events Slurm's accounting records."""
    fmt = "%Y-%m-%dT%H:%M:%S"
    out = subprocess.run(["sacctmgr", "--noheader", "--parsable2", "list", "events",
                          f"start={time.strftime(fmt, time.localtime(start - 1))}",
                          f"end={time.strftime(fmt, time.localtime(end + 60))}",
                          f"nodes={','.join(hosts)}", "format=NodeName,State,Reason"],
                         capture_output=True, text=True, timeout=30)
    rows = [line.split("|") for line in out.stdout.splitlines() if line.count("|") == 2]
    return [(node, f"{state}: {reason}" if reason else state) for node, state, reason in rows if node in hosts]


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
