"""The memory model (plan/memory.py): what a train rank holds, validation that refuses splits
that cannot fit, and policies that never choose one."""
from __future__ import annotations

import pytest
import torch

from dynaresize import analysis
from dynaresize.config import ConfigError, ModelConfig, TrainerConfig
from dynaresize.data.model import build_tiny_model
from dynaresize.plan import memory
from dynaresize.plan.hardware import ModelSpec
from dynaresize.runtime.trainer import ShardedTrainer
from dynaresize.sim import setup_from_overrides, simulate

H200_14B = ["+experiment=suite", "hardware=h200", "workload=deepscaler", "cluster.ranks=16", "sim.units=8",
            "run.iterations=12"]


def fewest(setup) -> int:
    cfg, profile = setup.cfg, setup.profile
    return memory.min_train_ranks(profile, *memory.job_train_side(cfg, profile),
                                  cfg.cluster.ranks - cfg.policy.resize_unit, cfg.policy.resize_unit)


def test_validation_refuses_a_14b_model_on_too_few_h200_train_ranks():
    k = fewest(setup_from_overrides([*H200_14B, "policy=static", "policy.train_ranks=8"]))
    assert k > 2
    with pytest.raises(ConfigError) as e:
        setup_from_overrides([*H200_14B, "policy=static", "policy.train_ranks=2"])
    assert "policy.train_ranks: 2 train ranks of qwen2.5-14b" in str(e.value)
    assert f"use at least {k} train ranks (the fewest that fit)" in str(e.value)
    with pytest.raises(ConfigError, match=r"policy.schedule\[1\]: 2 train ranks"):
        setup_from_overrides([*H200_14B, "policy=scripted", f"policy.schedule=[{k},2]"])
    # no split fits without checkpointing: the error names the settings that would help
    with pytest.raises(ConfigError, match="trainer: no split fits.*Fix: trainer.activation_checkpointing=true"):
        setup_from_overrides([*H200_14B, "trainer.activation_checkpointing=false"])
    # the runtime's own trainer (every train rank holds the whole model) cannot hold it at all
    with pytest.raises(ConfigError, match="Fix: trainer.sharding=full"):
        setup_from_overrides([*H200_14B, "trainer.sharding=optimizer"])


def test_min_train_ranks_is_the_boundary():
    setup = setup_from_overrides([*H200_14B, "policy=static", "policy.train_ranks=8"])
    profile, m = setup.profile, setup.profile.model
    s = memory.TrainSettings.for_job(setup.cfg, m)
    k = fewest(setup)
    assert memory.train_fits(profile, m, s, k) and not memory.train_fits(profile, m, s, k - 2)
    parts = {n: memory.train_memory(m, s, j) for n, j in (("few", 4), ("many", 8))}
    for state in ("parameters", "gradients", "optimizer"):      # sharded: halved by twice the ranks
        assert parts["many"][state] == pytest.approx(parts["few"][state] / 2)
    assert parts["many"]["activations"] == parts["few"]["activations"]


@pytest.mark.parametrize("policy", ["policy=dynamic", "policy.name=oracle", "policy.name=oracle_expected"])
def test_no_policy_chooses_a_split_that_does_not_fit(tmp_path, policy):
    """A larger reserve per train rank raises the fewest train ranks that fit; every split the
    policy runs stays at or above it, where without the reserve it goes below."""
    free = [*H200_14B, policy, "policy.train_ranks=auto" if policy == "policy=dynamic" else "policy.train_ranks=14"]
    tight = [*free, "hardware.train_reserved_bytes=40e9"]
    limit = fewest(setup_from_overrides(tight))
    assert limit > fewest(setup_from_overrides(free))
    splits = {}
    for name, overrides in (("free", free), ("tight", tight)):
        path = simulate(setup_from_overrides(overrides), tmp_path / name)
        splits[name] = analysis.load_timeline(path).iterations["train_ranks"].tolist()
    assert min(splits["free"]) < limit, splits             # the reserve binds: the test can fail
    assert min(splits["tight"]) >= limit, splits


def test_optimizer_layout_matches_the_runtime_trainer():
    """The `optimizer` layout against the tensors the runtime's trainer holds on 1, 2 and 4 train
    ranks: the whole float32 model, and the master range and AdamW's moments of 1/k of it."""
    cfg = ModelConfig(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128)
    spec = ModelSpec.from_model_config(cfg)
    settings = memory.TrainSettings(sharding="optimizer")
    for k in (1, 2, 4):
        t = ShardedTrainer(build_tiny_model(cfg), TrainerConfig(), temperature=1.0)
        t.join(None, list(range(k)), 0)
        shard = t.export_shard()
        held = {"parameters": t.flat.numel() * 4 + shard.params.numel() * 4,
                "optimizer": (shard.exp_avg.numel() + shard.exp_avg_sq.numel()) * 4}
        model = memory.train_memory(spec, settings, k)
        for part, measured in held.items():
            assert model[part] == pytest.approx(measured, rel=0.01), (k, part)
        assert t.flat.dtype == torch.float32


def test_fsdp2_shards_fall_as_one_over_n_and_match_the_model(tmp_path):
    """`dynaresize-bench memory` on 4 real MPI ranks: one FSDP2 AdamW step per group of 1, 2 and 4
    ranks; what the largest rank holds of each state is the memory model's `full` layout within
    15 %, and falls as 1/N."""
    import json
    import subprocess
    import sys

    from conftest import ROOT, _env
    proc = subprocess.run([sys.executable, "-m", "dynaresize.launch.bench", "memory", "--ranks", "4",
                           "--model", "small", "--out", str(tmp_path)], capture_output=True, text=True,
                          timeout=300, env=_env(), cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {r["ranks"]: r for r in json.loads((tmp_path / "memory_bench.json").read_text())["rows"]}
    assert sorted(rows) == [1, 2, 4]
    for k, row in rows.items():
        for state in ("parameters", "gradients", "optimizer"):
            assert row[state] == pytest.approx(row[f"{state}_model"], rel=0.15), (k, state)
            assert row[state] <= rows[1][state] / k * 1.05, (k, state)
    assert "train ranks" in proc.stdout
