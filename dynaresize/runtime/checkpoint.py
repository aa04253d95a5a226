"""Checkpoints for preemption and requeue, and exact resume.

A checkpoint is taken at an iteration boundary: every `run.checkpoint_every` iterations, after the
last iteration that generates (before the pipeline's drain, so that a finished run can be continued
with a larger `run.iterations`), and when Slurm warns that the job will end (preemption.py). It
holds everything the next iteration depends on:
- each train rank's optimizer shard (float32 master weights and AdamW moments, with the step
  count), in the staging format (HDF5, per-chunk CRC32): the full weights are their concatenation;
  with the fully sharded trainer (`trainer.sharding=full`) the train group's state saved by
  torch.distributed.checkpoint instead (`train/`, dcp_h5.py), which loads on any number of ranks;
- rank 0's state, as data (state.json, no pickles): the last completed iteration, the role table,
  the policy's state, the batch generated but not yet trained (max_lag 1), the decision taken for
  the next iteration, the run id its shards are bound to and the configuration that wrote it.
No RNG state is needed: every random draw is a pure function of (seed, batch, prompt, sample).
It is written to a private temporary directory (0700, files 0600) and renamed when complete, so a
half-written checkpoint is never loaded. A job started on a run directory that holds one resumes
from it, if its configuration computes the same thing (`check_resume`, in the launcher, before
any rank starts or anything is written); the timeline is cut back to the checkpoint's iteration,
so no iteration is lost or repeated there.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
from dataclasses import dataclass

import numpy as np

from ..config import ConfigError, JobConfig, to_yaml
from ..plan.policy import Decision
from ..plan.roles import Role, RoleTable
from .staging import make_private_dir, read_range, read_shard, shard_path, write_shard
from ..plan.switchplan import shard_range
from .types import Sample

CHECKPOINTS = "checkpoints"
STATE_FILE = "state.json"
FORMAT = 2
LEGACY_STATE_FILE = "state.pkl"    # format 1 (pickles), refused

# What a resumed run must share with the run that wrote its checkpoint: everything that changes
# what is computed. Everything else may change on resume (README: "Resume").
FIXED = ("cluster.ranks", "run.seed", "run.max_lag", "run.mode", "model", "workload", "data", "reward", "trainer", "policy",
         "rollout.engine", "rollout.prompts_per_batch", "rollout.samples_per_prompt", "rollout.temperature",
         "rollout.ignore_eos", "hardware")
FREE = ("data.val_files", "reward.timeout_s")   # inside FIXED, but they change nothing trained
# The fully sharded trainer's checkpoint loads on any number of train ranks and no split changes
# what is computed, so its runs may resume on another allocation (fewer nodes after a failure)
# and with other policy settings (a split that fits the new allocation): the policy then starts
# anew (same_policy).
FREE_SHARDED = ("cluster.ranks", "policy")


@dataclass
class ResumeState:
    path: str
    iteration: int                 # last completed iteration
    table: RoleTable
    policy_state: dict
    pending_batch: list[Sample]
    pending_decision: Decision | None
    run_id: str                    # the run that wrote the checkpoint's shards
    config: str                    # its configuration (YAML)


def latest(run_dir: str) -> str | None:
    root = os.path.join(run_dir, CHECKPOINTS)
    if not os.path.isdir(root):
        return None
    done = sorted(d for d in os.listdir(root) if d.startswith("iter-"))
    return os.path.join(root, done[-1]) if done else None


def checkpoint_if_due(job, it: int, ready: list, decision, warned: bool) -> str | None:
    """Write a checkpoint after iteration `it` if one is due (or Slurm `warned` of the job's end);
    its directory if written."""
    every, iterations = job.cfg.run.checkpoint_every, job.cfg.run.iterations
    if it >= iterations:                # the drain: a run continued from here would train nothing
        return None
    if not (warned or (every > 0 and ((it + 1) % every == 0 or it == iterations - 1))):
        return None
    job.settle_background()
    job.set_status(f"checkpoint (after iteration {it}, writing {CHECKPOINTS}/iter-{it:06d})")
    root = os.path.join(job.run_dir, CHECKPOINTS)
    final = os.path.join(root, f"iter-{it:06d}")
    tmp = os.path.join(root, f".tmp-iter-{it:06d}")
    with job.rec.span(it + 1, "checkpoint", job.role) as ev:
        if job.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(root, exist_ok=True)
            make_private_dir(tmp)
        job.ctrl.barrier()
        try:
            if job.trainer is not None and job.sharded:
                ev["bytes"] = job.trainer.save(train_state_dir(tmp), job.run_id, job.cfg.staging.buffer_mb,
                                               fsync=True)
            elif job.trainer is not None:
                ev["bytes"] = write_shard(shard_path(tmp, job.table.version, job.rank), job.trainer.export_shard(),
                                          job.table.version, job.cfg.staging.buffer_mb, job.run_id, fsync=True)
            if job.rank == 0:
                state = {"format": FORMAT, "iteration": it, "run_id": job.run_id,
                         "table": {"version": job.table.version, "roles": [r.value for r in job.table.roles]},
                         "policy_state": job.policy.state(),
                         "pending_batch": [dataclasses.asdict(x) for x in ready],
                         "pending_decision": dataclasses.asdict(decision) if decision is not None else None,
                         "config": to_yaml(job.cfg)}
                fd = os.open(os.path.join(tmp, STATE_FILE), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
                with os.fdopen(fd, "w") as f:
                    json.dump(state, f)
                    f.flush()
                    os.fsync(f.fileno())
        except BaseException:          # a full or read-only run directory: no half-written checkpoint left
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        job.ctrl.barrier()
        if job.rank == 0:
            os.replace(tmp, final)                      # complete, or not there at all
            for old in os.listdir(root):                # keep the newest only
                if old.startswith("iter-") and old < os.path.basename(final):
                    shutil.rmtree(os.path.join(root, old), ignore_errors=True)
        job.ctrl.barrier()
    return final


def find_resume(run_dir: str) -> ResumeState | None:
    """The newest checkpoint of `run_dir` (None: there is none); a checkpoint this version cannot
    read is a ConfigError that says what to do."""
    path = latest(run_dir)
    if path is None:
        return None
    state_file = os.path.join(path, STATE_FILE)
    if not os.path.exists(state_file):
        old = os.path.exists(os.path.join(path, LEGACY_STATE_FILE))
        raise ConfigError(f"cannot resume from {path}: "
                          + ("it was written by an older DynaResize (state.pkl, pickled objects); this version "
                             "reads checkpoints written as data (state.json)" if old else "it has no state.json")
                          + ". Fix: finish that run with the version that wrote it, or start a fresh run "
                          "directory (remove or move its checkpoints/ to start over there)")
    with open(state_file) as f:
        s = json.load(f)
    if s.get("format") != FORMAT:
        raise ConfigError(f"cannot resume from {path}: checkpoint format {s.get('format')}, this version reads "
                          f"{FORMAT}. Fix: finish that run with the version that wrote it, or start a fresh run "
                          f"directory")
    table = RoleTable(s["table"]["version"], tuple(Role(r) for r in s["table"]["roles"]))
    d = s["pending_decision"]
    return ResumeState(path, s["iteration"], table, s["policy_state"], [Sample(**x) for x in s["pending_batch"]],
                       Decision(**d) if d is not None else None, s["run_id"], s["config"])


def completed(cfg: JobConfig) -> str | None:
    """If `cfg`'s run directory holds a finished run of at least `run.iterations` iterations, what
    to say (the launcher then stops with exit code 0); None otherwise."""
    from ..timeline.reader import TIMELINE_FILE, open_timeline
    from ..timeline.schema import TimelineError
    path = os.path.join(cfg.run.output_dir, TIMELINE_FILE)
    try:
        with open_timeline(path) as f:
            if not f.attrs.get("complete", False):
                return None
            generated = f["iterations"]["generated_batch"]
            done = int(generated.max()) + 1 if len(generated) else 0
    except (OSError, TimelineError):
        return None
    if done < cfg.run.iterations:
        return None
    more = (f"; give a larger run.iterations to continue it from {latest(cfg.run.output_dir)}"
            if latest(cfg.run.output_dir) else "")
    return f"{cfg.run.output_dir} is a finished run of {done} iterations: nothing to do{more}"


def check_resume(cfg: JobConfig) -> None:
    """Refuse, before anything starts or is written, to resume a checkpoint of `cfg`'s run
    directory with a configuration that computes something else (FIXED), naming the fields."""
    resume = find_resume(cfg.run.output_dir)
    if resume is None:
        return
    then, now = _flat(_tree(resume.config)), _flat(_tree(to_yaml(cfg)))
    free = FREE + (FREE_SHARDED if then.get("trainer.sharding") == now.get("trainer.sharding") == "full" else ())
    changed = [f"  {key}: {then.get(key)!r} in the checkpoint, {now.get(key)!r} now"
               for key in sorted(set(then) | set(now))
               if key.startswith(FIXED) and not key.startswith(free) and then.get(key) != now.get(key)]
    if changed:
        ranks = any(line.startswith("  cluster.ranks:") for line in changed)
        raise ConfigError(f"cannot resume {resume.path} with a configuration that computes something else:\n"
                          + "\n".join(changed) + ("\n  (a run with trainer.sharding=full resumes on any number "
                                                   "of ranks; this one's checkpoint is for its own)" if ranks else "")
                          + "\n  Fix: resume with the checkpoint's values (its "
                          f"configuration is in {os.path.join(cfg.run.output_dir, 'config.yaml')}), or start a "
                          f"fresh run directory")


def same_policy(resume: ResumeState, cfg: JobConfig) -> bool:
    """Whether `cfg` has the policy settings of the checkpoint's run: if not (a run with
    trainer.sharding=full, check_resume), the policy starts anew from its own first split."""
    return _tree(resume.config).get("policy") == _tree(to_yaml(cfg)).get("policy")


def _tree(config_yaml: str) -> dict:
    """A config written as YAML (to_yaml, a checkpoint's state.json), as a nested dict."""
    from omegaconf import OmegaConf
    return OmegaConf.to_container(OmegaConf.create(config_yaml))


def _flat(tree, prefix: str = "") -> dict:
    """{dotted key: value} of a nested config dict."""
    out = {}
    for key, value in (tree or {}).items():
        if isinstance(value, dict) and value:
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def train_state_dir(path: str) -> str:
    """The fully sharded trainer's state in checkpoint directory `path`."""
    return os.path.join(path, "train")


def load_flat_params(resume: ResumeState, layout) -> torch.Tensor:
    """The full weights (flat, in `layout`'s order): the concatenated master copies of every train
    rank's shard, or read from the fully sharded trainer's saved state."""
    if os.path.isdir(train_state_dir(resume.path)):
        from .fsdp import load_full_weights
        return load_full_weights(train_state_dir(resume.path), resume.run_id, layout)[0]
    numel, table = layout.numel, resume.table
    k = table.num_train
    parts = []
    for q in range(k):
        lo, hi = shard_range(numel, k, q)
        data, _ = read_range(shard_path(resume.path, table.version, q), table.version, lo, hi, resume.run_id,
                             holds=(lo, hi))
        parts.append(data["params"])
    import torch        # here, not at the top: the launcher imports this module and needs no torch
    return torch.from_numpy(np.concatenate(parts))


def load_shard(resume: ResumeState, numel: int, index: int):
    """Train rank `index`'s shard of the checkpointed table."""
    table = resume.table
    k = table.num_train
    lo, hi = shard_range(numel, k, index)
    return read_shard(resume.path, table.version, k, numel, lo, hi, shard_range, resume.run_id)
