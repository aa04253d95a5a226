"""Shared helpers: run the real CLI, and run scenario scripts on real MPI ranks."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCENARIOS = os.path.join(ROOT, "tests", "mpi", "scenarios.py")


def _env() -> dict[str, str]:
    from dynaresize.launch.local import mpi_env
    return mpi_env()


def run_cli(run_dir, *overrides, timeout=240, check=True, entry="dynaresize.launch.cli",
            pin_policy=True, report=False, env=None) -> subprocess.CompletedProcess:
    """`dynaresize <overrides>` with its Hydra run directory at `run_dir`. Unless the overrides
    choose a policy (or pin_policy=False), the run is static: the default policy (dynamic) moves
    ranks on measured stage times, so its splits would depend on how busy the machine is. The
    report (run.report) is drawn only where a test asks for it (report=True): matplotlib's import
    and the figures cost rank 0 about 2.5 s of CPU at the end of every run (measured)."""
    if pin_policy and not any(o.startswith("policy=") for o in overrides):
        overrides = ("policy=static", *overrides)
    if not report and not any(o.startswith("run.report=") for o in overrides):
        overrides = (*overrides, "run.report=false")
    cmd = [sys.executable, "-m", entry, f"hydra.run.dir={run_dir}", *overrides]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env={**_env(), **(env or {})},
                          cwd=ROOT)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}\nSTDOUT:\n{proc.stdout[-4000:]}\n"
                             f"STDERR:\n{proc.stderr[-4000:]}")
    return proc


def run_ranks(n: int, scenario: str, *args, timeout=240, check=True) -> subprocess.CompletedProcess:
    """Run `tests/mpi/scenarios.py SCENARIO ARGS` on `n` real MPI ranks."""
    from dynaresize.launch.local import mpiexec_command
    cmd = mpiexec_command(n) + [sys.executable, SCENARIOS, scenario, *map(str, args)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_env(), cwd=ROOT)
    if check and proc.returncode != 0:
        raise AssertionError(f"scenario {scenario} exited {proc.returncode}\nSTDOUT:\n{proc.stdout[-4000:]}\n"
                             f"STDERR:\n{proc.stderr[-6000:]}")
    return proc


@pytest.fixture(scope="session")
def default_run(tmp_path_factory):
    """The README's `dynaresize` with no arguments (dynamic policy, 4 ranks, 12 iterations)."""
    run_dir = tmp_path_factory.mktemp("default_run")
    proc = run_cli(run_dir, pin_policy=False, report=True)
    return run_dir, proc


@pytest.fixture(scope="session")
def static_run(tmp_path_factory):
    """A static 2T/2R run of 8 iterations: the reference other tests compare with."""
    run_dir = tmp_path_factory.mktemp("static_run")
    proc = run_cli(run_dir, "policy.train_ranks=2", "run.iterations=8", report=True)
    return run_dir, proc


@pytest.fixture(scope="session")
def static_lag0_run(tmp_path_factory):
    """A static 2T/2R synchronous run (max_lag 0) of 8 iterations: the reference of lag-0 tests."""
    run_dir = tmp_path_factory.mktemp("static_lag0_run")
    run_cli(run_dir, "run.max_lag=0", "run.iterations=8")
    return run_dir


@pytest.fixture
def tmpfs(tmp_path):
    """`tmpfs(size)`: a fresh tmpfs of `size` ("256k", "8m") under tmp_path, a disk that fills up
    (mounting needs root; the test is skipped elsewhere). Unmounted afterwards."""
    mounts = []

    def mount(size: str):
        path = tmp_path / f"tmpfs{len(mounts)}"
        path.mkdir()
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"mounting a small tmpfs needs root: {r.stderr.strip()}")
        mounts.append(path)
        return path

    yield mount
    for path in mounts:
        subprocess.run(["umount", "-l", str(path)], check=False)

