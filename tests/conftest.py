"""Shared helpers: run the real CLI, and run scenario scripts on real MPI ranks."""
from __future__ import annotations

import fcntl
import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

# One thread for torch in the test processes, as the ranks have (launch.local.mpi_env): the suite
# keeps the cores busy with its ranks, and torch's threads waiting for each other on a busy core
# cost CPU time instead of saving any (a statistical test of the torch engine: 48 CPU-s with 2
# threads, 27 with 1, measured alone).
os.environ.setdefault("OMP_NUM_THREADS", "1")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCENARIOS = os.path.join(ROOT, "tests", "mpi", "scenarios.py")


# The longest files first (alone, one pytest: test_slurm 7.7 minutes, test_dataset 3.6,
# test_resize 3.4, test_core 2.9, test_faults 2.3): pytest-xdist's workers
# (DYNARESIZE_TEST_WORKERS) take a file at a time in this order, and end together instead of one
# running the Slurm tests alone at the end.
LONGEST_FIRST = ("test_slurm.py", "test_dataset.py", "test_resize.py", "test_core.py", "test_faults.py")


def pytest_collection_modifyitems(items):
    order = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: order.get(item.path.name, len(order)))     # stable: the rest as collected


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


def _made_once(tmp_path_factory, name: str, make) -> tuple:
    """`make(run_dir)`'s run, made once for the whole test session: with pytest-xdist
    (DYNARESIZE_TEST_WORKERS), or several pytests sharing a folder (DYNARESIZE_TEST_SHARED:
    tests/run.sh runs the Slurm tests beside the rest), the first to ask makes it under a lock
    and the others read it from disk. Returns (run_dir, the CompletedProcess of its CLI)."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("DYNARESIZE_TEST_SHARED"):
        root = pathlib.Path(os.environ["DYNARESIZE_TEST_SHARED"])
    elif os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent                   # the folder all workers' temporary folders share
    run_dir, record = root / name, root / f"{name}.json"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not record.exists():
            shutil.rmtree(run_dir, ignore_errors=True)       # what a worker that failed left
            proc = make(run_dir)
            record.write_text(json.dumps({"args": proc.args, "returncode": proc.returncode,
                                          "stdout": proc.stdout, "stderr": proc.stderr}))
    return run_dir, subprocess.CompletedProcess(**json.loads(record.read_text()))


@pytest.fixture(scope="session")
def default_run(tmp_path_factory):
    """The README's `dynaresize` with no arguments (dynamic policy, 4 ranks, 12 iterations)."""
    return _made_once(tmp_path_factory, "default_run", lambda d: run_cli(d, pin_policy=False, report=True))


@pytest.fixture(scope="session")
def static_run(tmp_path_factory):
    """A static 2T/2R run of 8 iterations: the reference other tests compare with."""
    return _made_once(tmp_path_factory, "static_run",
                      lambda d: run_cli(d, "policy.train_ranks=2", "run.iterations=8", report=True))


@pytest.fixture(scope="session")
def static_lag0_run(tmp_path_factory):
    """A static 2T/2R synchronous run (max_lag 0) of 8 iterations: the reference of lag-0 tests."""
    return _made_once(tmp_path_factory, "static_lag0_run",
                      lambda d: run_cli(d, "run.max_lag=0", "run.iterations=8"))[0]


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

