"""Issue 6: device-time emulation on real ranks agrees with the simulator on the same config."""
from __future__ import annotations

import subprocess
import sys

import analysis
from conftest import ROOT, _env, run_cli

# Responses run to their caps (ignore_eos), as the simulator assumes, so both price the same work.
# time_scale makes the priced stage times several times the real CPU ones, so every stage can be
# stretched to its price even when 4 ranks share 2 busy cores.
COMMON = ["+hardware=h100", "hardware.time_scale=4", "run.iterations=4", "run.max_lag=0",
          "rollout.ignore_eos=true"]
STAGES = ["span_s", "rollout_time_s", "train_time_s"]


def test_emulated_run_matches_simulation_within_15_percent(tmp_path):
    emulated, simulated = tmp_path / "emulated", tmp_path / "simulated"
    run_cli(emulated, "run.mode=emulate", *COMMON)
    proc = subprocess.run([sys.executable, "-m", "dynaresize.sim.cli", f"hydra.run.dir={simulated}", *COMMON],
                          capture_output=True, text=True, timeout=120, cwd=ROOT, env=_env())
    assert proc.returncode == 0, proc.stderr[-2000:]
    emu = analysis.iteration_metrics(analysis.load_timeline(emulated)).set_index("iteration")
    sim = analysis.iteration_metrics(analysis.load_timeline(simulated)).set_index("iteration")
    assert list(emu.index) == list(sim.index) == [0, 1, 2, 3]
    assert (emu["mean_response_len"] == sim["mean_response_len"]).all()      # the same work
    rel = ((emu[STAGES] - sim[STAGES]).abs() / sim[STAGES]).max()
    assert (rel <= 0.15).all(), f"emulated vs simulated, max relative difference per stage:\n{rel}"
    events = analysis.load_timeline(emulated).events
    rollout = events[events["name"] == "rollout"]
    assert all("device_s" in a and "real_s" in a for a in rollout["attrs"])   # both times recorded
