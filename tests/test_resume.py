"""Resume on a local run directory: checkpoints written as data and private, a resume with a
configuration that computes something else refused before anything starts, an old-format
checkpoint refused clearly. (Exact resume after a requeue: tests/test_slurm.py.)"""
from __future__ import annotations

import json
import os
import stat

import pytest
from conftest import run_cli

COMMON = ("run.iterations=3", "run.checkpoint_every=1", "run.report=false", "run.save_model=false")


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.mark.fault('a resume with a changed seed or model; a checkpoint of the previous format (pickles)',
                   'exit 2 before anything starts or is written, naming the fields; checkpoints are data (JSON + HDF5), 0600 in 0700')
def test_checkpoint_is_private_data_and_resume_refuses_a_changed_computation(tmp_path):
    run = tmp_path / "run"
    run_cli(run, *COMMON)
    ckpt = sorted((run / "checkpoints").glob("iter-*"))[-1]           # the newest only is kept
    state = json.loads((ckpt / "state.json").read_text())            # data, no pickles
    assert state["iteration"] == 3 and state["format"] == 2 and len(state["run_id"]) == 16
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
