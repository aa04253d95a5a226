"""The simulator's configuration: the job's Hydra config plus two simulator-only sections.

The simulator composes the same conf/ tree as `dynaresize` (same schema, same groups, same
overrides) with two more top-level keys:

- `hardware`: the hardware profile (conf/hardware/NAME.yaml; select with `+hardware=h100`, or an
  experiment's defaults). Absent: the fitted CPU profile of this setting, `cpu_tiny`.
- `sim`: options of the simulation itself (SimOptions below).

To compose them, the schema registered by dynaresize.cli (`dynaresize_schema`, the JobConfig
dataclass) is replaced in the simulator's process by `SimJobConfig`, the same dataclass with the
two keys added. `prepare` then takes them out and validates the rest with
dynaresize.config.load_config, exactly as the runtime does, in run.mode=simulate (which admits the
simulator-only policy `oracle`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, Optional

from omegaconf import DictConfig, OmegaConf

from ..config import ConfigError, JobConfig, load_config, to_yaml
from ..hardware import HardwareProfile, ProfileError, job_profile



@dataclass
class SimOptions:
    noise: float = 0.0             # relative std of multiplicative noise on every simulated duration
    prompts_per_rank: int = 0      # > 0: rollout.prompts_per_batch = prompts_per_rank x cluster.ranks
    units: int = 0                 # > 0: policy.resize_unit = cluster.ranks / units
    train_units: int = 0           # > 0: policy.train_ranks = train_units x policy.resize_unit
    samples: str = "auto"          # one timeline row per sample: yes | no | auto (runs of up to 5M
                                   # samples); without them the analysis counts tokens from rollout events
    flush_every: int = 64          # iterations buffered between timeline writes
    progress: bool = False         # print one line per iteration


@dataclass
class SimJobConfig(JobConfig):
    """JobConfig plus the simulator's sections (registered as the schema in the simulator only)."""
    hardware: Optional[Dict[str, Any]] = None
    sim: SimOptions = field(default_factory=SimOptions)


def register_schema(schema: type = None) -> None:
    """Make `dynaresize_schema` (the base of conf/config.yaml) the simulator's schema (or `schema`)."""
    import dynaresize.cli  # noqa: F401  (registers the runtime schema and CONF_DIR first)
    from hydra.core.config_store import ConfigStore
    ConfigStore.instance().store(name="dynaresize_schema", node=schema or SimJobConfig)


@dataclass
class SimSetup:
    """Everything a simulation needs: the validated job config, the profile and the options."""
    cfg: JobConfig
    profile: HardwareProfile
    options: SimOptions

    def config_yaml(self) -> str:
        """The resolved config as written in the timeline: the job's, then hardware and sim."""
        extra = {"hardware": self.profile.to_dict(), "sim": dataclasses.asdict(self.options)}
        return to_yaml(self.cfg) + OmegaConf.to_yaml(OmegaConf.create(extra))


def _options(raw: Any) -> SimOptions:
    raw = dict(raw or {})
    names = {f.name for f in dataclasses.fields(SimOptions)}
    unknown = sorted(set(raw) - names)
    if unknown:
        raise ConfigError(f"invalid configuration:\n  sim: unknown fields {unknown}. Fix: use {sorted(names)}.")
    opts = SimOptions(**raw)
    errors = []
    if opts.noise < 0:
        errors.append(f"  sim.noise: is {opts.noise}. Fix: use 0 or a small positive relative std.")
    if opts.samples not in ("auto", "yes", "no"):
        errors.append(f"  sim.samples: unknown {opts.samples!r}. Fix: use auto, yes or no.")
    if opts.flush_every < 1:
        errors.append(f"  sim.flush_every: is {opts.flush_every}. Fix: use 1 or more.")
    for name in ("prompts_per_rank", "units", "train_units"):
        if getattr(opts, name) < 0:
            errors.append(f"  sim.{name}: is {getattr(opts, name)}. Fix: use 0 (off) or more.")
    if errors:
        raise ConfigError("invalid configuration:\n" + "\n".join(errors))
    return opts


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
    hw = data.pop("hardware", None)
    opts = options or _options(data.pop("sim", None))
    data.pop("sim", None)
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
        profile = job_profile(cfg, hardware if hardware is not None else hw)
    except ProfileError as e:
        raise ConfigError(f"invalid configuration:\n  hardware: {e}") from None
    return SimSetup(cfg, profile, opts)


def compose(overrides: list[str] | tuple[str, ...] = ()) -> DictConfig:
    """Compose conf/ with Hydra's compose API and the simulator's schema (for tests and tools)."""
    from hydra import compose as hydra_compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from .. import CONF_DIR
    register_schema()
    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
            return hydra_compose("config", overrides=list(overrides))
    finally:
        register_schema(JobConfig)        # leave the runtime's schema for anyone composing after us


def setup_from_overrides(overrides: list[str] | tuple[str, ...] = ()) -> SimSetup:
    return prepare(compose(overrides))
