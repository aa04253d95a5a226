"""Configuration errors are refused before any rank starts: exit code 2, the field and the fix named.

Each case runs the real `dynaresize` command; validation fails before ranks start, so each takes
about a second (the cluster.device=cuda case imports torch: a few seconds).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT
from dynaresize.launch.validate import load_config

TIMEOUT = 60


def dynaresize(*args: str, timeout: int = TIMEOUT) -> subprocess.CompletedProcess:
    """`dynaresize ARGS` (options before the overrides, as Hydra's parser wants them). Refusals need
    no MPI environment (conftest.run_cli's): nothing is launched."""
    return subprocess.run([sys.executable, "-m", "dynaresize.launch.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def assert_refused(proc: subprocess.CompletedProcess, run_dir, field: str, *words: str) -> None:
    """Exit code 2, a one-problem-per-line message naming `field` (and `words`), no rank started."""
    err = proc.stderr
    assert proc.returncode == 2, f"exit {proc.returncode}\nSTDOUT:\n{proc.stdout[-2000:]}\nSTDERR:\n{err[-3000:]}"
    assert "dynaresize: invalid configuration" in err and "Fix:" in err, err
    assert "Traceback" not in err and "HYDRA_FULL_ERROR" not in err, err
    line = next((ln for ln in err.splitlines() if ln.strip().startswith(field + ":")), None)
    assert line is not None, f"no line for {field}:\n{err}"
    assert "Fix:" in line, line
    for w in words:
        assert w in err, f"{w!r} not in\n{err}"
    assert "[dynaresize]" not in proc.stdout, proc.stdout
    for started in ("timeline.h5", "config.yaml", "initial_model"):
        assert not os.path.exists(os.path.join(run_dir, started)), f"{started} written: ranks were started"


@pytest.fixture
def hf_checkpoint(tmp_path):
    """A Hugging Face checkpoint directory whose config.json has `positions` positions."""
    def make(positions: int):
        path = tmp_path / f"hf{positions}"
        path.mkdir()
        (path / "config.json").write_text(json.dumps({"model_type": "qwen2", "max_position_embeddings": positions}))
        return path
    return make


# (overrides, the field named, words the message must hold); {tmp} is the test's tmp_path.
CASES = {
    # Hydra's own errors (a key not in the schema, a wrong type, an unknown preset): exit 1 before
    "typo": (["trainer.lrr=0.1"], "trainer.lrr", ["trainer.lr"]),
    "typo_group": (["trainerr.lr=0.1"], "trainerr", []),
    "added_unknown": (["+trainer.foo=1"], "trainer.foo", []),
    "type": (["trainer.lr=abc"], "trainer.lr", ["float"]),
    "type_in_list": (["trainer.betas=[0.9,abc]"], "trainer.betas[1]", []),
    "unknown_preset": (["policy=nonexistent"], "policy", ["static"]),
    "sweep_without_m": (["policy.train_ranks=1,2"], "policy.train_ranks", ["-m"]),
    # values the types admit but the trainer, the workload or the machine cannot run
    "betas_length": (["trainer.betas=[0.9]"], "trainer.betas", []),
    "betas_range": (["trainer.betas=[0.9,1.0]"], "trainer.betas", []),
    "eps": (["trainer.eps=0"], "trainer.eps", []),
    "weight_decay": (["trainer.weight_decay=-0.1"], "trainer.weight_decay", []),
    "grad_clip": (["trainer.grad_clip=-1"], "trainer.grad_clip", ["0 to turn clipping off"]),
    "length_growth": (["workload.length_growth=-1"], "workload.length_growth", []),
    "schedule_too_long": (["policy=scripted", "policy.schedule=[1,2,3,1,2]", "run.iterations=3"],
                          "policy.schedule", ["only 4 steps (run.iterations and"]),
    "schedule_not_scripted": (["policy=static", "policy.schedule=[1,2]"], "policy.schedule", ["scripted"]),
    "pricing_workers_negative": (["policy.pricing_workers=-1"], "policy.pricing_workers", ["number of processes"]),
    "simulator_only_policy": (["policy.name=oracle"], "policy.name",
                              ["simulator-only", "policy=static, colocated, scripted, dynamic", "dynaresize-sim"]),
    "unknown_engine": (["rollout.engine=nope"], "rollout.engine", ["use one of torch, vllm"]),
    "migration_threshold": (["rollout.migration_threshold=-1"], "rollout.migration_threshold", []),
    "migration_threshold_word": (["rollout.migration_threshold=sometimes"], "rollout.migration_threshold", ["auto"]),
    "migration_auto_colocated": (["policy=colocated", "run.max_lag=0", "rollout.migration_threshold=auto"],
                                 "rollout.migration_threshold", ["policy=colocated"]),
    "migration_colocated": (["policy=colocated", "run.max_lag=0", "rollout.migration_threshold=2"],
                            "rollout.migration_threshold", ["policy=colocated"]),
    "migration_emulated": (["run.mode=emulate", "rollout.migration_threshold=2"], "rollout.migration_threshold",
                           ["run.mode=real or dynaresize-sim"]),
    "speculation_word": (["rollout.speculation=sometimes"], "rollout.speculation", ["use off, tail, always"]),
    "speculation_tokens": (["rollout.speculation=tail", "rollout.speculation_tokens=0"],
                           "rollout.speculation_tokens", ["1 or more"]),
    "speculation_below": (["rollout.speculation=tail", "rollout.speculation_below=0"],
                          "rollout.speculation_below", ["1 or more"]),
    "speculation_vllm": (["rollout.engine=vllm", "rollout.speculation=tail"], "rollout.speculation",
                         ["speculative_config"]),
    "speculation_acceptance": (["rollout.speculation=tail", "rollout.speculation_acceptance=6"],
                               "rollout.speculation_acceptance", ["1 to 1 + speculation_tokens"]),
    "speculation_migration_emulated": (["run.mode=emulate", "rollout.speculation=tail",
                                        "rollout.migration_threshold=2"], "rollout.speculation",
                                       ["not both together", "run.mode=real"]),
    "colocated_overlap": (["policy=colocated", "run.max_lag=1"], "run.max_lag", ["policy=colocated"]),
    "fp16_on_cpu": (["model.dtype=float16"], "model.dtype", ["cluster.device=cpu"]),
    "cuda_without_gpu": (["cluster.device=cuda"], "cluster.device", ["cluster.device=cpu"]),
    "hf_positions": (["model.path={tmp}/hf32"], "model.path", ["max_position_embeddings"]),
    "scratch_is_a_file": (["cluster.local_scratch={tmp}/scratch_file"], "cluster.local_scratch", ["is a file"]),
    # what the fully sharded trainer does not do yet
    "full_stealing": (["trainer.sharding=full", "trainer.work_stealing=true"], "trainer.work_stealing",
                      ["trainer.sharding=optimizer"]),
    "full_colocated": (["trainer.sharding=full", "policy=colocated", "run.max_lag=0"], "trainer.sharding",
                       ["policy=colocated"]),
}


@pytest.mark.fault('typos in keys, wrong types, out-of-range values (betas, eps, weight_decay, grad_clip, growth, schedules, a simulator-only policy, fp16 on CPU, CUDA without a GPU, a model with too few positions, a scratch path that is a file, what trainer.sharding=full does not do yet)',
                   'exit 2 before any rank starts, naming the field and the fix')
@pytest.mark.parametrize("case", list(CASES))
def test_bad_configuration_exits_2_before_ranks_start(case, tmp_path, hf_checkpoint):
    overrides, field, words = CASES[case]
    if case == "cuda_without_gpu":
        import torch
        if torch.cuda.is_available():
            pytest.skip("a GPU is visible here: cluster.device=cuda is valid")
    hf_checkpoint(32)                                  # too short for the default workload (106 tokens)
    (tmp_path / "scratch_file").write_text("not a directory")
    run_dir = tmp_path / "run"
    if not any(o.startswith("policy=") for o in overrides):
        overrides = ["policy=static", *overrides]     # not the default dynamic policy's cost model
    proc = dynaresize(f"hydra.run.dir={run_dir}", *(o.format(tmp=tmp_path) for o in overrides))
    assert_refused(proc, run_dir, field, *words)


@pytest.mark.fault('a bad point in a `-m` sweep',
                   'exit 2 before the first job')
def test_sweep_refuses_a_bad_point_before_the_first_job(tmp_path):
    sweep = tmp_path / "sweep"
    proc = dynaresize("-m", "policy=static", "policy.train_ranks=1,2,3,4", f"hydra.sweep.dir={sweep}")
    assert_refused(proc, sweep, "policy.train_ranks", "sweep job 4 of 4", "policy.train_ranks=4")
    assert not sweep.exists(), "a job of the sweep was started"
    proc = dynaresize("-m", "trainer.lr=0.1,abc", f"hydra.sweep.dir={sweep}")
    assert_refused(proc, sweep, "trainer.lr", "sweep job 2 of 2")
    assert not sweep.exists()


def test_valid_values_at_the_edges_pass(tmp_path, hf_checkpoint):
    """The checks are not over-eager: edge values compose and validate, and Hydra's own commands
    (--cfg job, --help) still work."""
    from hydra import compose, initialize_config_dir

    from dynaresize import CONF_DIR
    from dynaresize.launch.cli import check_command_line

    valid = ["trainer.betas=[0.0,0.5]", "trainer.eps=1e-6", "trainer.weight_decay=0", "trainer.grad_clip=0",
             "workload.length_growth=-0.5", "model.dtype=bfloat16", "policy=scripted",
             "policy.schedule=[1,2,3,1]", "run.iterations=3",        # 3 + the drain: 4 splits, all used
             f"cluster.local_scratch={tmp_path}", f"model.path={hf_checkpoint(4096)}"]
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        cfg = load_config(compose("config", valid))
    assert cfg.trainer.grad_clip == 0 and cfg.workload.length_growth == -0.5 and len(cfg.policy.schedule) == 4
    assert check_command_line(valid) is None
    assert check_command_line(["-m", *valid, "trainer.lr=1e-3,1e-4"]) is None     # every point validated
    short = load_config({"policy": {"name": "scripted", "schedule": [1]}, "run": {"iterations": 8}})
    assert short.policy.schedule == [1]                                           # shorter: the last holds
    # srun and slurm run the ranks on compute nodes: their GPUs are not checked here
    assert load_config({"cluster": {"launcher": "srun", "device": "cuda"}}).cluster.device == "cuda"
    assert check_command_line(["-m", "hydra/launcher=submitit_slurm", "cluster.device=cuda",
                               "policy.train_ranks=1,2"]) is None
    assert "trainer.lrr" in check_command_line(["-m", "hydra/launcher=submitit_slurm", "trainer.lrr=1,2"])
    import torch
    if not torch.cuda.is_available():                   # the basic launcher runs the jobs here
        assert "cluster.device" in check_command_line(["-m", "cluster.device=cuda", "policy.train_ranks=1,2"])
    proc = dynaresize("--cfg", "job", *valid)
    assert proc.returncode == 0 and "grad_clip: 0.0" in proc.stdout and "length_growth: -0.5" in proc.stdout, \
        proc.stderr[-2000:]
    proc = dynaresize("--help")
    assert proc.returncode == 0 and "policy:" in proc.stdout, proc.stderr[-2000:]


@pytest.mark.fault("a model folder that cannot serve: only its config.json; a non-causal model (BertForMaskedLM)",
                   "exit 2 before any rank starts, naming model.path, what is missing and the fix")
def test_a_model_folder_that_cannot_serve_is_refused_before_ranks_start(tmp_path, hf_checkpoint):
    only_config = hf_checkpoint(4096)               # a config.json and nothing else
    run_dir = tmp_path / "run"
    proc = dynaresize(f"hydra.run.dir={run_dir}", "policy=static", f"model.path={only_config}")
    assert_refused(proc, run_dir, "model.path", "holds no weights", "lacks vocab_size")
    bert = tmp_path / "bert"
    bert.mkdir()
    (bert / "config.json").write_text(json.dumps({
        "architectures": ["BertForMaskedLM"], "model_type": "bert", "vocab_size": 30522, "hidden_size": 768,
        "num_hidden_layers": 12, "num_attention_heads": 12, "intermediate_size": 3072,
        "max_position_embeddings": 512}))
    (bert / "model.safetensors").write_bytes(b"")
    proc = dynaresize(f"hydra.run.dir={run_dir}", "policy=static", f"model.path={bert}")
    assert_refused(proc, run_dir, "model.path", "BertForMaskedLM, not a causal language model")
    assert "holds no weights" not in proc.stderr and "lacks" not in proc.stderr


@pytest.mark.fault("an invalid batch (rollout.samples_per_prompt=0, rollout.prompts_per_batch=0)",
                   "exit 2 naming that field only, not the micro-batch settings it makes look wrong")
@pytest.mark.parametrize("override, field", [("rollout.samples_per_prompt=0", "rollout.samples_per_prompt"),
                                             ("rollout.prompts_per_batch=0", "rollout.prompts_per_batch")])
def test_an_invalid_batch_is_named_once(tmp_path, override, field):
    run_dir = tmp_path / "run"
    proc = dynaresize(f"hydra.run.dir={run_dir}", "policy=static", override)
    assert_refused(proc, run_dir, field)
    named = [line.split(":")[0].strip() for line in proc.stderr.splitlines() if line.startswith("  ")]
    assert named == [field], proc.stderr
