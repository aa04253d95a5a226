"""The simulator's configuration: the job's own schema and validation, in run.mode=simulate.

The simulator composes the same dynaresize/conf/ tree as `dynaresize` (same schema, same groups, same
overrides). Two sections of the schema are read by the simulator only:

- `hardware`: the hardware profile (dynaresize/conf/hardware/NAME.yaml; select with `+hardware=h100`, or an
  experiment's defaults). Absent: the fitted CPU profile of this setting, `cpu_tiny`.
- `sim`: options of the simulation itself (config.SimOptions).

`prepare` applies the `sim` knobs that scale with the allocation, then validates the whole config
with dynaresize.launch.validate.load_config, exactly as the runtime does, in run.mode=simulate (which admits
the simulator-only policies, such as the oracle).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ..config import ConfigError, JobConfig, SimOptions, omegaconf_problem, register_schema, to_yaml
from ..launch.validate import load_config
from ..plan.hardware import HardwareProfile, ProfileError, job_profile


@dataclass
class SimSetup:
    """Everything a simulation needs: the validated job config, the profile and the options."""
    cfg: JobConfig
    profile: HardwareProfile

    @property
    def options(self) -> SimOptions:
        return self.cfg.sim

    def config_yaml(self) -> str:
        """The resolved config as written in the timeline, with the whole hardware profile."""
        return to_yaml(dataclasses.replace(self.cfg, hardware=self.profile.to_dict()))


def prepare(raw: DictConfig | dict, hardware: Any = None, options: SimOptions | None = None) -> SimSetup:
    """Validate a composed config (DictConfig or dict) for the simulator.

    The `sim` knobs that scale with the allocation (prompts_per_rank, units, train_units) are
    applied to the job config first, so the timeline records the values the run used.
    """
    if isinstance(raw, DictConfig):
        data = OmegaConf.to_container(raw, resolve=True)
    else:
        data = OmegaConf.to_container(OmegaConf.create(raw), resolve=True)
    data.pop("hydra", None)
    try:                                 # the knobs are applied before validation: their types first
        opts = options or OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(SimOptions), data.get("sim") or {}))
    except OmegaConfBaseException as e:
        raise ConfigError("invalid configuration:\n" + omegaconf_problem(e, "sim")) from None
    data["sim"] = dataclasses.asdict(opts)
    world = int(data.get("cluster", {}).get("ranks", JobConfig().cluster.ranks))
    policy = data.setdefault("policy", {})
    if opts.units:
        if world % opts.units:
            raise ConfigError(f"invalid configuration:\n  sim.units: {opts.units} does not divide "
                              f"cluster.ranks={world}. Fix: use a divisor of the rank count.")
        policy["resize_unit"] = world // opts.units
    if opts.train_units:
        policy["train_ranks"] = opts.train_units * int(policy.get("resize_unit", 1))
    if opts.prompts_per_rank:
        data.setdefault("rollout", {})["prompts_per_batch"] = opts.prompts_per_rank * world
    data.setdefault("run", {})["mode"] = "simulate"     # admits the simulator-only policy (oracle)
    cfg = load_config(data)
    try:
        profile = job_profile(cfg, hardware)
    except ProfileError as e:
        raise ConfigError(f"invalid configuration:\n  hardware: {e}") from None
    return SimSetup(cfg, profile)


def compose(overrides: list[str] | tuple[str, ...] = ()) -> DictConfig:
    """Compose dynaresize/conf/ with Hydra's compose API (for tests and tools)."""
    from hydra import compose as hydra_compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from .. import CONF_DIR
    register_schema()
    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        return hydra_compose("config", overrides=list(overrides))


def setup_from_overrides(overrides: list[str] | tuple[str, ...] = ()) -> SimSetup:
    return prepare(compose(overrides))
