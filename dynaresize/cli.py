"""`dynaresize`: compose the Hydra config, validate it, then start the ranks.

Validation happens here, in the launching process, so a bad value is reported before any rank
starts or any job is submitted.
"""
from __future__ import annotations

import os
import sys
import warnings

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from .comm import in_mpi_job
from .config import ConfigError, JobConfig, load_config, to_yaml


def prepare(raw: DictConfig, run_dir: str) -> JobConfig:
    cfg = load_config(raw)
    if cfg.run.mode == "simulate":
        raise ConfigError("invalid configuration:\n  run.mode: simulate is not a way to run ranks. "
                          "Fix: use dynaresize-sim with the same overrides.")
    cfg.run.output_dir = os.path.abspath(run_dir)
    return cfg


def write_config(cfg: JobConfig) -> str:
    os.makedirs(cfg.run.output_dir, exist_ok=True)
    path = os.path.join(cfg.run.output_dir, "config.yaml")
    with open(path, "w") as f:
        f.write(to_yaml(cfg))
    return path


def start(cfg: JobConfig) -> int:
    """Run the job described by `cfg` with its launcher; returns the exit code."""
    if in_mpi_job():
        from .worker import run_rank
        run_rank(cfg)
        return 0
    config_path = write_config(cfg)
    if cfg.cluster.launcher == "local":
        from .launch import local
        return local.launch(cfg, config_path)
    if cfg.cluster.launcher == "srun":
        from .launch import srun
        return srun.launch(cfg, config_path)
    from .launch import slurm
    return slurm.launch(cfg, config_path)


# conf/hydra/launcher/submitit_slurm.yaml deliberately shadows the plugin's preset (same name).
warnings.filterwarnings("ignore", message=".*is validated against ConfigStore schema with the same name.*")

# The typed schema is the base of conf/config.yaml: every field exists, with its type and default.
ConfigStore.instance().store(name="dynaresize_schema", node=JobConfig)

# conf/ sits beside the package in the source tree (installed with `pip install -e .`).
CONF_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf")


@hydra.main(version_base=None, config_path=CONF_DIR, config_name="config")
def main(raw: DictConfig) -> None:
    try:
        cfg = prepare(raw, HydraConfig.get().runtime.output_dir)
    except ConfigError as e:
        print(f"dynaresize: {e}", file=sys.stderr)
        sys.exit(2)
    code = start(cfg)
    if code == 2:                      # refused before it started; the reason is printed already
        sys.exit(2)
    if code != 0:
        print(f"dynaresize: the job failed (exit code {code}); see the rank errors above and "
              f"{cfg.run.output_dir}", file=sys.stderr)
        sys.exit(code)


if __name__ == "__main__":
    main()
