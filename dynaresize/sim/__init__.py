"""Cluster-scale simulation of DynaResize jobs: the runtime's recipe, workload, placement,
policies and switch plan, priced by dynaresize.plan.costmodel, written as a timeline.

    from dynaresize.sim import simulate
    path = simulate(cfg)          # cfg: a JobConfig, a composed config, or a SimSetup

Command line: `python -m dynaresize.sim.cli` (console script `dynaresize-sim`).
"""
from __future__ import annotations

from ..config import SimOptions
from .config import SimSetup, compose, prepare, setup_from_overrides
from .core import Simulator, simulate

__all__ = ["simulate", "Simulator", "SimOptions", "SimSetup", "prepare", "compose", "setup_from_overrides"]
