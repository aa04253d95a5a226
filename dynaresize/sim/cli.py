"""`dynaresize-sim`: simulate a job at any scale from the same Hydra config as `dynaresize`.

    python -m dynaresize.sim.cli cluster.ranks=1024 run.iterations=1000 rollout.prompts_per_batch=2048
    python -m dynaresize.sim.cli +hardware=h100 policy=dynamic ...
    python -m dynaresize.sim.cli -m +experiment=seed_comparison cluster.ranks=64 policy=static 'sim.train_units=range(1,32)'
    dynaresize-sim suite --ranks 64 256 --hardware h100 h200      # the comparison suite (sim/suite.py)

It composes dynaresize/conf/ (the runtime's schema; `hardware` and `sim` are read here, see dynaresize.sim.config),
runs the discrete-event simulation (dynaresize.sim.core) and writes RUN_DIR/timeline.h5 in the
runtime's schema (file attribute mode="simulate"): `python -m dynaresize.analysis.cli RUN_DIR` and
`python -m dynaresize.analysis.cli compare MULTIRUN_DIR` read it unchanged. Exit status 2 for a bad config.
"""
from __future__ import annotations

import math
import os
import sys

import numpy as np

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from .. import CONF_DIR
from ..config import ConfigError
from ..config import register_schema
from .config import prepare
from .core import Simulator

register_schema()


def summary_line(path: str) -> str:
    """One line about a simulated run, read back from its timeline (h5py only)."""
    from ..timeline.reader import read_arrays
    attrs, data = read_arrays(path, ("iterations", "events", "decisions"),
                              fields={"events": ["name", "tokens"], "decisions": ["action"]})
    its, ev = data["iterations"], data["events"]
    tokens = int(ev["tokens"][ev["name"] == b"rollout"].astype(np.int64).sum())
    moves = int((data["decisions"]["action"] == b"move").sum())
    wall = float(attrs.get("sim_wall_s", math.nan))
    span = float(its["end"].max() - its["start"].min()) if len(its) else math.nan
    return (f"{attrs['policy']}: {int(attrs['world_size'])} ranks, {len(its)} iterations, "
            f"simulated {span:,.1f} s, {tokens / span if span > 0 else math.nan:,.0f} tok/s, "
            f"{moves} resizes, wall {wall:.2f} s")


@hydra.main(version_base=None, config_path=CONF_DIR, config_name="config")
def simulate_job(raw: DictConfig) -> None:
    try:
        setup = prepare(raw)
    except ConfigError as e:
        print(f"dynaresize-sim: {e}", file=sys.stderr)
        sys.exit(2)
    run_dir = HydraConfig.get().runtime.output_dir
    setup.cfg.run.output_dir = os.path.abspath(run_dir)
    sim = Simulator(setup, run_dir)
    path = sim.run()
    print(f"[dynaresize-sim] {summary_line(path)}  ({sim.cm.describe()})\n[dynaresize-sim] timeline {path}",
          flush=True)


def main() -> None:
    """`dynaresize-sim suite ...` runs the comparison suite, `dynaresize-sim inside ...` the
    inside-iteration estimate (sim/inside.py); anything else is one Hydra (multi)run."""
    if len(sys.argv) > 1 and sys.argv[1] == "suite":
        from .suite import main as suite_main
        sys.exit(suite_main(sys.argv[2:]))
    if len(sys.argv) > 1 and sys.argv[1] == "inside":
        from .inside import main as inside_main
        sys.exit(inside_main(sys.argv[2:]))
    from ..launch.cli import check_command_line
    problem = check_command_line(sys.argv[1:], validate=prepare)   # exit 2 for typos, types and bad sweeps
    if problem:
        print(f"dynaresize-sim: {problem}", file=sys.stderr)
        sys.exit(2)
    simulate_job()


if __name__ == "__main__":
    main()
