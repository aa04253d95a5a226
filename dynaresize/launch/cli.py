"""`dynaresize`: compose the Hydra config, validate it, then start the ranks.

Validation happens here, in the launching process, so a bad value is reported before any rank
starts or any job is submitted. `main` first composes what the command line asks for with
Hydra's compose API (`check_command_line`): a key that is not in the schema, a value of the wrong
type or an unknown preset is reported like every other configuration error (the field and the
fix, exit code 2) instead of by Hydra (its own message, exit code 1); with -m every sweep point is
composed and validated before the first job starts. Then Hydra runs the app as usual.
"""
from __future__ import annotations

import contextlib
import io
import itertools
import os
import sys
import threading
import warnings
from typing import Callable, Optional

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException, MissingConfigException
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from .. import CONF_DIR
from ..runtime.comm import in_mpi_job
from ..config import ConfigError, JobConfig, omegaconf_problem, register_schema, to_yaml
from .runlock import RunLock
from .validate import load_config


def prepare(raw: DictConfig, run_dir: str) -> JobConfig:
    cfg = load_config(raw)
    if cfg.run.mode == "simulate":
        raise ConfigError("invalid configuration:\n  run.mode: simulate is not a way to run ranks. "
                          "Fix: use dynaresize-sim with the same overrides.")
    cfg.run.output_dir = os.path.abspath(run_dir)
    # Ranks may start elsewhere (another node, another directory): paths are fixed here, where the
    # user wrote them.
    cfg.data.train_files = [os.path.abspath(os.path.expanduser(p)) for p in cfg.data.train_files]
    cfg.data.val_files = [os.path.abspath(os.path.expanduser(p)) for p in cfg.data.val_files]
    if cfg.model.path is not None:
        cfg.model.path = os.path.abspath(os.path.expanduser(cfg.model.path))
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
        from ..runtime.worker import run_rank
        run_rank(cfg)
        return 0
    config_path = write_config(cfg)
    if cfg.cluster.launcher == "local":
        from . import local
        return local.launch(cfg, config_path)
    if cfg.cluster.launcher == "srun":
        from . import srun
        return srun.launch(cfg, config_path)
    from . import slurm
    return slurm.launch(cfg, config_path)


# dynaresize/conf/hydra/launcher/submitit_slurm.yaml deliberately shadows the plugin's preset (same name).
# (?s): Hydra's message starts with a newline, which `.` does not match otherwise.
warnings.filterwarnings("ignore", message="(?s).*is validated against ConfigStore schema with the same name")

register_schema()



@hydra.main(version_base=None, config_path=CONF_DIR, config_name="config")
def hydra_app(raw: DictConfig) -> None:
    """One job (Hydra calls it once per sweep point with -m)."""
    code = launch_job(lambda: prepare(raw, HydraConfig.get().runtime.output_dir))
    if code != 0:
        sys.exit(code)


def launch_job(make_config: Callable[[], JobConfig]) -> int:
    """Check the job `make_config()` describes, then run it; its exit code. A bad value, or a
    resume that would compute something else, is refused (exit code 2) before anything starts or
    is written; a run directory that holds a finished run of as many iterations says so (0). The
    console's lines go to RUN_DIR/cli.log as well."""
    try:
        cfg = make_config()
        if not in_mpi_job():
            from ..runtime.checkpoint import check_resume, completed
            check_resume(cfg)          # a resume that would compute something else: refused, nothing written
            done = completed(cfg)
            if done:
                print(f"[dynaresize] {done}", flush=True)
                return 0
            check_inputs(cfg)
    except ConfigError as e:
        print(f"dynaresize: {e}", file=sys.stderr)
        return 2
    if in_mpi_job():
        return start(cfg)
    lock = RunLock(cfg.run.output_dir)
    try:
        lock.acquire()                 # refused while another launcher runs this run directory
    except ConfigError as e:
        print(f"dynaresize: {e}", file=sys.stderr)
        return 2
    try:
        with console_log(os.path.join(cfg.run.output_dir, LOG_FILE)):
            code = start(cfg)
            if code not in (0, 2):     # 2: refused before it started; the reason is printed already
                print(f"dynaresize: the job failed (exit code {code}); see the rank errors above and "
                      f"{cfg.run.output_dir}", file=sys.stderr, flush=True)
    finally:
        lock.release()
    return code


LOG_FILE = "cli.log"       # what the console showed, in the run directory


class _ConsoleLog:
    """The file RUN_DIR/cli.log, shared by both console streams. If it cannot be written (the run
    directory's disk is full) the console goes on without it, saying so once."""

    def __init__(self, path: str):
        self.path, self.lock = path, threading.Lock()
        self.file: io.TextIOBase | None = open(path, "a")

    def write(self, text: str) -> None:
        if self.file is None:
            return
        try:
            self.file.write(text)
            self.file.flush()
        except OSError as e:
            self.close()
            sys.__stderr__.write(f"[dynaresize] cannot write {self.path} ({e.strerror}): the console is no "
                                 f"longer copied there\n")

    def close(self) -> None:
        file, self.file = self.file, None
        if file is not None:
            try:
                file.close()
            except OSError:
                pass


class _Tee(io.TextIOBase):
    """A console stream that also appends what it writes to the console log (stdout and stderr
    share it; the launcher's threads write to both at once)."""

    def __init__(self, stream, log: _ConsoleLog):
        self.stream, self.log = stream, log

    def write(self, text: str) -> int:
        with self.log.lock:
            self.stream.write(text)
            self.log.write(text)
        return len(text)

    def flush(self) -> None:
        with self.log.lock:
            self.stream.flush()

    def fileno(self) -> int:
        return self.stream.fileno()


@contextlib.contextmanager
def console_log(path: str):
    """Copy everything this process prints (the ranks' output passes through it) to `path`."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    log = _ConsoleLog(path)
    out, err = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _Tee(out, log), _Tee(err, log)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        sys.stdout, sys.stderr = out, err
        log.close()


def resume_run(run_dir: str, overrides: list[str]) -> int:
    """`dynaresize run.resume=RUN_DIR [key=value ...]`: continue the run in RUN_DIR with the
    configuration it ran with (RUN_DIR/config.yaml), the given fields changed (e.g. a larger
    run.iterations; what would change the computation is refused by check_resume)."""
    path = os.path.join(os.path.expanduser(run_dir), "config.yaml")
    if not os.path.isfile(path):
        print(f"dynaresize: invalid configuration:\n  run.resume: {run_dir!r} holds no config.yaml, so it is "
              f"not a run directory. Fix: give the folder of an earlier run (outputs/DATE/TIME).", file=sys.stderr)
        return 2
    groups = {g for g in os.listdir(CONF_DIR) if os.path.isdir(os.path.join(CONF_DIR, g))}
    for line in overrides:
        key = line.partition("=")[0].lstrip("+~")
        if line.startswith("-") or "=" not in line or key in groups or key.startswith("hydra"):
            print(f"dynaresize: invalid configuration:\n  {line}: run.resume continues a run with the "
                  f"configuration it ran with; only fields can change (key.field=value, e.g. "
                  f"run.iterations=40), not presets, Hydra settings or sweeps. Fix: drop {line!r}.",
                  file=sys.stderr)
            return 2
    raw = OmegaConf.load(path)
    raw.run.output_dir = None

    def make_config() -> JobConfig:
        try:
            merged = OmegaConf.merge(raw, OmegaConf.from_dotlist(overrides))
        except OmegaConfBaseException as e:
            raise ConfigError("invalid configuration:\n" + omegaconf_problem(e)) from None
        return prepare(merged, os.path.dirname(os.path.abspath(path)))
    return launch_job(make_config)


def check_inputs(cfg: JobConfig) -> None:
    """What validation cannot see in the values alone, before anything starts: the model folder's
    files, the dataset's rows and prompt lengths, and that the reward function imports."""
    from ..data.rewards import load_reward
    from .validate import check_model_folder
    problems = check_model_folder(cfg.model.path) if cfg.model.path else []
    if problems:
        raise ConfigError("invalid configuration:\n" + "\n".join(f"  {p}" for p in problems))
    try:
        load_reward(cfg.reward._target_, cfg.reward.kwargs)
    except ValueError as e:
        raise ConfigError(f"invalid configuration:\n  {e}") from None
    if cfg.workload.task == "dataset":
        from ..data.datasets import check_dataset
        print(f"[dynaresize] {check_dataset(cfg)}", flush=True)


def main() -> None:
    """The `dynaresize` command: check the command line (exit 2 with the field and the fix), then
    hand it to Hydra (a run, a sweep with -m, --cfg, --help ...); `run.resume=RUN_DIR` continues
    an earlier run without Hydra composing a new one."""
    resume = [a for a in sys.argv[1:] if a.startswith("run.resume=")]
    if resume:
        sys.exit(resume_run(resume[-1].partition("=")[2],
                            [a for a in sys.argv[1:] if not a.startswith("run.resume=")]))
    problem = check_command_line(sys.argv[1:])
    if problem:
        print(f"dynaresize: {problem}", file=sys.stderr)
        sys.exit(2)
    hydra_app()


def check_command_line(argv: list[str], config_dir: str = CONF_DIR,
                       validate: Optional[Callable[[DictConfig], object]] = None) -> Optional[str]:
    """Compose the config of every job `dynaresize ARGV` would run, as Hydra will, and return the
    problem (an invalid-configuration message naming the key and the fix), or None.

    Without -m the whole command line is composed once (its values are validated by `hydra_app`,
    before any rank starts). With -m every point of the sweep (the basic sweeper's product of the
    comma-separated values) is composed and, when Hydra runs the jobs on this machine, validated,
    so that no job starts before a bad point is found; with a remote launcher (submitit) each job
    validates its config where it runs. `validate(raw)` checks a composed config and raises
    ConfigError (default: `prepare`, this command's). Whatever this check does not understand
    (help, --info, other sweepers, another config path, an unexpected error) is left to Hydra.
    """
    from hydra import compose, initialize_config_dir
    from hydra._internal.utils import get_args_parser    # the parser hydra.main uses (hydra-core 1.3)

    args = get_args_parser().parse_args(argv)            # a usage error exits 2, as Hydra's would
    commands = args.run + args.multirun + (args.cfg is not None) + args.shell_completion + (args.info is not None)
    if (args.help or args.hydra_help or args.shell_completion or args.info is not None or commands > 1
            or args.experimental_rerun or args.config_path or args.config_dir):
        return None
    config_name = args.config_name or "config"

    parsed, problem = _parse_overrides(args.overrides)
    if problem:
        return problem
    sweeps = [o for o in parsed if o.is_sweep_override()]
    base = [o.input_line for o in parsed if not o.is_sweep_override()]
    try:
        with initialize_config_dir(config_dir=config_dir, version_base=None, job_name="dynaresize"):
            try:
                head = compose(config_name, base, return_hydra_config=True)
            except (HydraException, OmegaConfBaseException) as e:
                return composition_problem(e, parsed)
            multirun = args.multirun or OmegaConf.select(head, "hydra.mode") == RunMode.MULTIRUN
            if not multirun:
                if sweeps:
                    o = sweeps[0]
                    return (f"invalid configuration:\n  {o.key_or_group}: {o.input_line.partition('=')[2]!r} is a "
                            f"sweep but the command has no -m. Fix: add -m to run one job per value, write a "
                            f"list as [a,b], or quote the value to keep it a string.")
                return None                              # it composes; hydra_app validates it
            if not str(OmegaConf.select(head, "hydra.sweeper._target_")).endswith("BasicSweeper"):
                return None
            params = OmegaConf.select(head, "hydra.sweeper.params") or {}
            if params:                                    # the basic sweeper's own sweep, from the config
                parsed, problem = _parse_overrides([f"{k}={v}" for k, v in params.items()] + list(args.overrides))
                if problem:
                    return problem
            points = _sweep_points(parsed)
            if points is None:
                return None
            here = str(OmegaConf.select(head, "hydra.launcher._target_")).endswith("BasicLauncher")
            for i, (point, varying) in enumerate(points):
                where = f"invalid configuration (sweep job {i + 1} of {len(points)}: {' '.join(varying)}):"
                try:
                    raw = compose(config_name, point)
                except (HydraException, OmegaConfBaseException) as e:
                    return composition_problem(e, parsed).replace("invalid configuration:", where, 1)
                if here:
                    try:
                        validate(raw) if validate is not None else prepare(raw, ".")
                    except ConfigError as e:
                        return str(e).replace("invalid configuration:", where, 1)
    except Exception:                  # not a configuration error this check understands: Hydra's
        return None
    return None


def _parse_overrides(lines: list[str]) -> tuple[list, Optional[str]]:
    """Hydra's parse of each override, or the invalid-configuration message of the first bad one."""
    from hydra.errors import OverrideParseException

    parser, parsed = OverridesParser.create(), []
    for line in lines:
        try:
            parsed += parser.parse_overrides([line])
        except OverrideParseException as e:
            reason = " ".join(str(e).split()).split(" See https://")[0].rstrip(".")
            return [], (f"invalid configuration:\n  {line}: not an override Hydra can read ({reason}). Fix: write "
                        f"key=value (quote a value with spaces or special characters: 'key=a b').")
    return parsed, None


def _sweep_points(parsed: list) -> Optional[list[tuple[list[str], list[str]]]]:
    """The basic sweeper's jobs: (overrides, the swept ones) of each point of the product of the
    swept values (a later override of a key replaces an earlier one, as in the sweeper); None when
    a sweep is not a list of values (an interval, for other sweepers)."""
    choices: dict[str, list[str]] = {}
    for o in parsed:
        key = o.get_key_element()
        if not o.is_sweep_override():
            choices[key] = [o.input_line]
        elif o.is_discrete_sweep():
            choices[key] = [f"{key}={v}" for v in o.sweep_string_iterator()]
        else:
            return None
    swept = [len(v) > 1 for v in choices.values()]
    return [(list(point), [x for x, s in zip(point, swept) if s]) for point in itertools.product(*choices.values())]


def composition_problem(e: Exception, parsed: list) -> str:
    """The invalid-configuration message for Hydra's composition error `e` (overrides `parsed`)."""
    cause = e if isinstance(e, OmegaConfBaseException) else e.__cause__
    if isinstance(cause, OmegaConfBaseException) and getattr(cause, "full_key", None):
        return "invalid configuration:\n" + omegaconf_problem(cause)
    message = " ".join(str(e).split())
    if isinstance(e, MissingConfigException) and e.missing_cfg_file:
        group, _, name = e.missing_cfg_file.rpartition("/")
        options = f"choose one of {', '.join(e.options)}" if e.options else "check the name against dynaresize/conf/"
        return f"invalid configuration:\n  {group or name}: no preset {name!r}. Fix: {options}."
    override = next((o for o in parsed if f"'{o.key_or_group}'" in str(e)), None)
    key = override.key_or_group if override is not None else "overrides"
    line = override.input_line if override is not None else "the overrides"
    if "No match in the defaults list" in message:
        fix = f"add the group with +{line} (it is not selected by dynaresize/conf/config.yaml)"
    elif message.startswith("Could not append to config"):
        fix = f"drop the + ({line.lstrip('+')}): the key exists already"
    else:
        fix = (f"check {line!r}: key=value sets a field, +key=value adds one, group=option chooses a "
               f"preset, +group=option adds a group (e.g. +experiment=emulated8)")
    return f"invalid configuration:\n  {key}: {message.rstrip('.')}. Fix: {fix}."


if __name__ == "__main__":
    main()
